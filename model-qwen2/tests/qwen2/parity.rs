//! Logits, greedy continuations and activations against transformers (f32, CPU).

use burn::tensor::{DType, Int, Tensor, TensorData};
use model_qwen2::{AttentionMetadata, KvCache, LogitsRows, Qwen2Model, Qwen2Tokenizer};

use super::common::*;

const TOL: f32 = 1e-4;

/// Checks one row of logits against the golden: the full row where stored (vocab-1024 models),
/// else the logits at the stored top-5 ids, and top-1 where the margin makes it unambiguous.
fn check_row(what: &str, row: &[f32], full: Option<&[f32]>, top5: Option<(&[u32], &[f32])>) {
    if let Some(full) = full {
        assert_close(what, row, full, TOL);
    }
    if let Some((ids, logits)) = top5 {
        let ours: Vec<f32> = ids.iter().map(|&i| row[i as usize]).collect();
        assert_close(&format!("{what} (top-5 logits)"), &ours, logits, TOL);
        if logits[0] - logits[1] > 2e-4 {
            assert_eq!(argmax(row), ids[0], "{what}: top-1");
        }
    }
}

fn prompt_ids(golden: &Golden) -> Vec<Vec<u32>> {
    (0..golden.num_prompts())
        .map(|i| golden.ids(&format!("prompt.{i}.input_ids")))
        .collect()
}

/// Prompt logits at every position, each prompt alone in its own batch.
#[test]
fn prompt_logits_match_transformers() {
    for name in CHECKPOINTS {
        let model = load_model(name);
        let golden = Golden::load(name);
        let v = model.config.vocab_size;
        for (i, ids) in prompt_ids(&golden).iter().enumerate() {
            let mut cache =
                KvCache::new(&model.config, 16, BLOCK_SIZE, DType::F32, &device()).unwrap();
            let mut seqs = [Seq {
                tokens: ids.clone(),
                table: Blocks::new(16).take(ids.len().div_ceil(BLOCK_SIZE)),
                cached: 0,
            }];
            let rows = step(&model, &mut cache, &mut seqs, LogitsRows::All);
            assert_eq!(rows.len(), ids.len());
            let key = format!("prompt.{i}");
            if golden.has(&format!("{key}.logits")) {
                let full = golden.f32s(&format!("{key}.logits"));
                for (p, row) in rows.iter().enumerate() {
                    check_row(
                        &format!("{name} {key} pos {p}"),
                        row,
                        Some(&full[p * v..(p + 1) * v]),
                        None,
                    );
                }
            } else {
                let last = golden.f32s(&format!("{key}.last_logits"));
                assert_close(
                    &format!("{name} {key} last logits"),
                    rows.last().unwrap(),
                    &last,
                    TOL,
                );
                let (t5, t5l) = (
                    golden.ids(&format!("{key}.top5_ids")),
                    golden.f32s(&format!("{key}.top5_logits")),
                );
                for (p, row) in rows.iter().enumerate() {
                    check_row(
                        &format!("{name} {key} pos {p}"),
                        row,
                        None,
                        Some((&t5[p * 5..p * 5 + 5], &t5l[p * 5..p * 5 + 5])),
                    );
                }
            }
        }
    }
}

/// A prompt prefilled in two chunks (the second attends to the first through the cache, as with
/// a prefix-cache hit) gives the same logits as transformers over the whole prompt.
#[test]
fn chunked_prefill_over_cached_prefix() {
    for name in ["qwen2-tiny-untied", "qwen3-tiny-hd32"] {
        let model = load_model(name);
        let golden = Golden::load(name);
        let v = model.config.vocab_size;
        let ids = golden.ids("prompt.5.input_ids"); // 100 tokens
        let full = golden.f32s("prompt.5.logits");
        for split in [1, 16, 17, 63] {
            let mut cache =
                KvCache::new(&model.config, 16, BLOCK_SIZE, DType::F32, &device()).unwrap();
            let mut seqs = [Seq {
                tokens: ids[..split].to_vec(),
                table: Blocks::new(16).take(7),
                cached: 0,
            }];
            step(&model, &mut cache, &mut seqs, LogitsRows::All);
            seqs[0].tokens = ids.clone();
            let rows = step(&model, &mut cache, &mut seqs, LogitsRows::All);
            assert_eq!(rows.len(), ids.len() - split);
            for (j, row) in rows.iter().enumerate() {
                let p = split + j;
                assert_close(
                    &format!("{name} split {split} pos {p}"),
                    row,
                    &full[p * v..(p + 1) * v],
                    TOL,
                );
            }
        }
    }
}

/// Layer-0 activations, every layer's output and the final norm for the prompts the goldens store.
#[test]
fn activations_match_transformers() {
    for name in CHECKPOINTS {
        let model = load_model(name);
        let golden = Golden::load(name);
        for p in [0usize, 3] {
            check_activations(name, &model, &golden, p);
        }
    }
}

fn check_activations(name: &str, model: &Qwen2Model, golden: &Golden, p: usize) {
    let device = device();
    let ids = golden.ids(&format!("prompt.{p}.input_ids"));
    let l = ids.len();
    let act = |k: &str| golden.f32s(&format!("act.p{p}.{k}"));
    let check = |k: &str, t: Vec<f32>| assert_close(&format!("{name} p{p} {k}"), &t, &act(k), TOL);
    let layer = &model.layers[0];
    let attn = &layer.self_attn;
    let meta = AttentionMetadata::prefill(
        vec![l],
        vec![Blocks::new(8).take(l.div_ceil(BLOCK_SIZE))],
        BLOCK_SIZE,
        &device,
    )
    .unwrap();
    let input = model.input_ids(&ids, &device).unwrap();

    let embed = model.embed(input.clone());
    check("embed", to_vec(embed.clone()));
    check(
        "layer0.input_norm",
        to_vec(layer.input_layernorm.forward(embed.clone())),
    );
    // The projection of the normalised rows: the gain sits in the weight, the row scale and
    // bias are applied after the product (in the KV write on the production path).
    let eps = layer.input_layernorm.eps;
    let qkv = attn
        .row_scale(&embed, eps)
        .apply(attn.project(embed.clone()));
    let (q_sz, kv_sz) = (model.config.q_size(), model.config.kv_size());
    check("layer0.q_proj", to_vec(qkv.clone().slice_dim(1, 0..q_sz)));
    check(
        "layer0.k_proj",
        to_vec(qkv.clone().slice_dim(1, q_sz..q_sz + kv_sz)),
    );
    check(
        "layer0.v_proj",
        to_vec(qkv.clone().slice_dim(1, q_sz + kv_sz..q_sz + 2 * kv_sz)),
    );
    let (q, k, _) = attn.split_qkv(qkv.clone());
    if model.config.qk_norm {
        check("layer0.q_normed", to_vec(q.clone()));
        check("layer0.k_normed", to_vec(k.clone()));
    }
    let positions = meta.tensors.positions.clone();
    check(
        "layer0.q_rope",
        to_vec(model.rotary.apply(q, positions.clone()).swap_dims(0, 1)),
    );
    check(
        "layer0.k_rope",
        to_vec(model.rotary.apply(k, positions).swap_dims(0, 1)),
    );

    let mut cache = KvCache::new(&model.config, 8, BLOCK_SIZE, DType::F32, &device).unwrap();
    let attn_out = attn.o_proj.forward(attn.attend(
        attn.project(embed.clone()),
        attn.row_scale(&embed, eps),
        &model.rotary,
        &meta,
        &mut cache.layers[0],
    ));
    check("layer0.attn_out", to_vec(attn_out.clone()));
    let residual = attn_out + embed.clone();
    check("layer0.attn_residual", to_vec(residual.clone()));
    let post = layer.post_attention_layernorm.forward(residual.clone());
    check("layer0.post_attn_norm", to_vec(post));
    let post_eps = layer.post_attention_layernorm.eps;
    check(
        "layer0.mlp_out",
        to_vec(
            layer
                .mlp
                .down_proj
                .forward(layer.mlp.activation(&residual, post_eps)),
        ),
    );

    // Every layer's output through the production forward (deferred norms, residual adds in
    // the products).
    let mut cache = KvCache::new(&model.config, 8, BLOCK_SIZE, DType::F32, &device).unwrap();
    let mut h: Tensor<2> = embed;
    for (k, layer) in model.layers.iter().enumerate() {
        h = layer.forward(h, &model.rotary, &meta, &mut cache.layers[k]);
        check(&format!("layer{k}.output"), to_vec(h.clone()));
    }
    check("final_norm", to_vec(model.norm.forward(h)));
}

#[test]
fn rope_tables_match_transformers() {
    for name in CHECKPOINTS {
        let model = load_model(name);
        let golden = Golden::load(name);
        let inv = model_qwen2::layers::RotaryEmbedding::inv_freq(
            model.config.head_dim,
            model.config.rope_theta,
        );
        assert_close(
            &format!("{name} inv_freq"),
            &inv,
            &golden.f32s("rope.inv_freq"),
            1e-6,
        );
        let (cos, sin) = model.rotary.tables();
        let half = model.config.head_dim / 2;
        let (cos, sin) = (
            to_vec(cos.clone().slice_dim(0, 0..17)),
            to_vec(sin.clone().slice_dim(0, 0..17)),
        );
        // The goldens repeat the half-width table: [f(p·inv_0..d/2), f(p·inv_0..d/2)].
        let doubled = |t: &[f32]| {
            t.chunks(half)
                .flat_map(|r| r.iter().chain(r.iter()).copied().collect::<Vec<_>>())
                .collect::<Vec<_>>()
        };
        assert_close(
            &format!("{name} cos"),
            &doubled(&cos),
            &golden.f32s("rope.cos"),
            1e-6,
        );
        assert_close(
            &format!("{name} sin"),
            &doubled(&sin),
            &golden.f32s("rope.sin"),
            1e-6,
        );
    }
}

/// The tied model with the real vocabulary: the goldens' text prompts tokenize to the ids
/// transformers used (their greedy continuations are checked through the engine).
#[test]
fn text_prompts_tokenize_like_transformers() {
    let name = "qwen2-tiny-tied";
    let golden = Golden::load(name);
    let tok = Qwen2Tokenizer::from_dir(fixture(name)).unwrap();
    let cases = golden.json["text_tests"].as_array().unwrap().clone();
    for (j, case) in cases.iter().enumerate() {
        let ids = tok.encode(case["text"].as_str().unwrap()).unwrap();
        assert_eq!(
            ids,
            golden.ids(&format!("text.{j}.input_ids")),
            "text {j} ids"
        );
    }
}

/// An id past the embedding table reads its last row (clamped on the device), never out of
/// bounds; ids inside it read their own rows.
#[test]
fn embedding_ids_are_clamped_into_the_table() {
    let model = load_model("qwen2-tiny-tied");
    let rows = model.embed_tokens.val().dims()[0];
    let ids = |v: &[i32]| {
        Tensor::<1, Int>::from_data(
            TensorData::new(v.to_vec(), [v.len()]),
            (&device(), DType::I32),
        )
    };
    let last = rows as i32 - 1;
    let got = to_vec(model.embed(ids(&[3, last + 1, i32::MAX, -5])));
    let want = to_vec(model.embed(ids(&[3, last, last, 0])));
    assert_eq!(got, want);
    let table = to_vec(model.embed_tokens.val());
    let width = table.len() / rows;
    assert_eq!(got[..width], table[3 * width..4 * width]);
}
