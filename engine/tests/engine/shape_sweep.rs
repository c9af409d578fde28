//! Every kernel path over the shapes a Qwen2/Qwen3 config can express: tiny random-weight
//! checkpoints (written here as safetensors) with head dims 16 to 256, multi-head, grouped
//! (ratios 3, 4, 7, 16) and multi-query attention, hidden sizes that are not multiples of 32
//! or 64, odd and prime vocabularies, tied and untied embeddings, Qwen2 (q/k/v bias) and Qwen3
//! (q/k norm). Each runs through the engine on the kernel device (CubeCL's CPU runtime here;
//! `ENGINE_TEST_DEVICE=cuda` on a GPU, where steps replay CUDA graphs) — chunked prefills
//! mixed with decodes, the sampler — and is compared with the same checkpoint on Burn's plain
//! reference backend: f32 prompt logits within 1e-4, greedy tokens identical; bf16 logits
//! within bf16 rounding of the f32 reference.

use std::path::{Path, PathBuf};

use burn::tensor::DType;
use engine::{DeviceKind, EngineConfig, LLMEngine};
use rand::{Rng, SeedableRng, rngs::StdRng};

use super::common::{greedy, run_all, test_device};

/// One config of the sweep (`fixtures/shape-sweep.json`).
#[derive(Clone, Copy, Debug, serde::Deserialize)]
struct Shape {
    qwen3: bool,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    vocab: usize,
    tied: bool,
}

#[derive(serde::Deserialize)]
struct Sweep {
    shapes: Vec<Shape>,
}

/// The sweep's shapes, shared with the kernels' per-op test.
fn shapes() -> Vec<Shape> {
    let text = std::fs::read_to_string(super::common::fixture("shape-sweep.json")).unwrap();
    serde_json::from_str::<Sweep>(&text).unwrap().shapes
}

impl Shape {
    fn config_json(&self) -> String {
        let arch = if self.qwen3 {
            "Qwen3ForCausalLM"
        } else {
            "Qwen2ForCausalLM"
        };
        let head_dim = if self.qwen3 {
            format!(r#""head_dim": {},"#, self.head_dim)
        } else {
            String::new()
        };
        format!(
            r#"{{"architectures": ["{arch}"], "vocab_size": {}, "hidden_size": {},
            "intermediate_size": {}, "num_hidden_layers": 2, "num_attention_heads": {},
            "num_key_value_heads": {}, {head_dim} "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 512, "tie_word_embeddings": {}, "eos_token_id": 0}}"#,
            self.vocab, self.hidden, self.intermediate, self.heads, self.kv_heads, self.tied
        )
    }

    /// A checkpoint folder of this shape with random f32 weights (seeded by the shape): large
    /// enough embeddings and head that the logits spread over several units, so greedy
    /// choices are not near-ties.
    fn write_checkpoint(&self, root: &Path) -> PathBuf {
        let name = format!(
            "{}-h{}-{}x{}-kv{}-i{}-v{}-{}",
            if self.qwen3 { "qwen3" } else { "qwen2" },
            self.hidden,
            self.heads,
            self.head_dim,
            self.kv_heads,
            self.intermediate,
            self.vocab,
            if self.tied { "tied" } else { "untied" }
        );
        let dir = root.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), self.config_json()).unwrap();
        let mut rng = StdRng::seed_from_u64((self.hidden * 7919 + self.vocab) as u64);
        let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
        let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
            let n = shape.iter().product();
            let values = (0..n)
                .map(|_| offset + scale * (rng.random::<f32>() * 2.0 - 1.0))
                .collect();
            tensors.push((name, shape, values));
        };
        let (h, i, d, v) = (self.hidden, self.intermediate, self.head_dim, self.vocab);
        let (q, kv) = (self.heads * d, self.kv_heads * d);
        add("model.embed_tokens.weight".into(), vec![v, h], 1.0, 0.0);
        for l in 0..2 {
            let p = format!("model.layers.{l}");
            let w = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
            add(format!("{p}.input_layernorm.weight"), vec![h], 0.2, 1.0);
            add(
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                0.2,
                1.0,
            );
            for (name, rows) in [("q_proj", q), ("k_proj", kv), ("v_proj", kv)] {
                add(
                    format!("{p}.self_attn.{name}.weight"),
                    vec![rows, h],
                    w(h),
                    0.0,
                );
                if !self.qwen3 {
                    add(format!("{p}.self_attn.{name}.bias"), vec![rows], 0.1, 0.0);
                }
            }
            if self.qwen3 {
                add(format!("{p}.self_attn.q_norm.weight"), vec![d], 0.2, 1.0);
                add(format!("{p}.self_attn.k_norm.weight"), vec![d], 0.2, 1.0);
            }
            add(
                format!("{p}.self_attn.o_proj.weight"),
                vec![h, q],
                w(q),
                0.0,
            );
            add(format!("{p}.mlp.gate_proj.weight"), vec![i, h], w(h), 0.0);
            add(format!("{p}.mlp.up_proj.weight"), vec![i, h], w(h), 0.0);
            add(format!("{p}.mlp.down_proj.weight"), vec![h, i], w(i), 0.0);
        }
        add("model.norm.weight".into(), vec![h], 0.2, 1.0);
        if !self.tied {
            add("lm_head.weight".into(), vec![v, h], 1.0, 0.0);
        }
        let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .into_iter()
            .map(|(n, s, v)| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
            .iter()
            .map(|(n, s, b)| {
                let view =
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                        .unwrap();
                (n.clone(), view)
            })
            .collect();
        safetensors::tensor::serialize_to_file(views, None, &dir.join("model.safetensors"))
            .unwrap();
        dir
    }
}

/// The kernel device: CUDA when the tests run there, else CubeCL's CPU runtime.
fn kernel_device() -> DeviceKind {
    match test_device() {
        DeviceKind::Cuda(i) => DeviceKind::Cuda(i),
        _ => DeviceKind::CubeclCpu,
    }
}

fn engine(dir: &Path, device: DeviceKind, dtype: DType) -> LLMEngine {
    LLMEngine::new(
        dir,
        EngineConfig {
            device,
            dtype: Some(dtype),
            max_num_seqs: Some(4),
            // Chunked prefills mixed with decodes; on CUDA steps replay graphs of 1–32 tokens.
            max_num_batched_tokens: 32,
            num_kv_blocks: Some(64),
            max_model_len: Some(256),
            ..EngineConfig::default()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// Prompts of 1, 5, 37 and 70 tokens (ids spread over the vocabulary).
fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    [1usize, 5, 37, 70]
        .iter()
        .map(|&n| {
            (0..n)
                .map(|i| ((i * 7919 + n * 131 + 1) % vocab) as u32)
                .collect()
        })
        .collect()
}

fn rel_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    assert!(a.iter().all(|x| x.is_finite()), "non-finite logits");
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

#[test]
fn every_config_shape_matches_the_reference() {
    let root = std::env::temp_dir().join(format!("burn-nanovllm-sweep-{}", std::process::id()));
    let device = kernel_device();
    let bf16_too = matches!(device, DeviceKind::Cuda(_));
    for (n, shape) in shapes().iter().enumerate() {
        let dir = shape.write_checkpoint(&root);
        let what = dir.file_name().unwrap().to_string_lossy().into_owned();
        eprintln!("shape {n}: {what} on {device:?}");
        let reference = engine(&dir, DeviceKind::Cpu, DType::F32);
        let requests: Vec<_> = prompts(shape.vocab)
            .into_iter()
            .map(|p| (p, greedy(6)))
            .collect();
        let want_logits = reference.prompt_logits(&requests[3].0).unwrap();
        let mut reference = reference;
        let want = run_all(&mut reference, requests.clone());
        let mut dtypes = vec![DType::F32];
        // bf16 everywhere on CUDA; on the CPU runtime for two shapes (its JIT is slow).
        if bf16_too || n % 5 == 0 {
            dtypes.push(DType::BF16);
        }
        for dtype in dtypes {
            let mut ours = engine(&dir, device, dtype);
            let logits = ours.prompt_logits(&requests[3].0).unwrap();
            let err = rel_error(&logits, &want_logits);
            let tol = if dtype == DType::F32 { 1e-4 } else { 3e-2 };
            assert!(
                err < tol,
                "{what} {dtype:?}: prompt logits off by {err:e} (≥ {tol:e})"
            );
            let got = run_all(&mut ours, requests.clone());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.tokens.len(), 6, "{what} {dtype:?} prompt {i}");
                if dtype == DType::F32 {
                    assert_eq!(g.tokens, w.tokens, "{what} f32 prompt {i}: greedy tokens");
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}
