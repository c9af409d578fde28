//! Tensor parallelism on the CPU: TP = 2 and 4 ranks as threads, each loading its share of a
//! fixture checkpoint, the collective a host sum ([`HostAllReduce`]). Every rank's logits equal
//! the whole model's within f32 rounding, at a prefill and at greedy decode steps over the
//! cache, and the ranks draw the same tokens; KV heads are split (TP 2) or replicated (TP 4 of
//! 2 heads); the embedding and LM head whole on every rank or split by vocabulary rows.

use std::sync::Arc;

use burn::tensor::DType;
use model_qwen2::{
    AllReduce, Checkpoint, HostAllReduce, KvCache, LogitsRows, ModelError, Parallel, Qwen2Config,
    Qwen2Model, TpRank,
};

use super::common::*;

const PROMPT: [u32; 11] = [3, 17, 101, 7, 250, 9, 64, 511, 12, 33, 5];
const STEPS: usize = 6;

/// Rank `rank`'s model of `name` in a group of `size`.
fn rank_model(
    name: &str,
    rank: usize,
    size: usize,
    all_reduce: Arc<dyn AllReduce>,
    vocab_parallel: bool,
) -> Qwen2Model {
    let config = Qwen2Config::from_file(fixture(name).join("config.json")).unwrap();
    let mut ckpt = Checkpoint::open(fixture(name)).unwrap();
    let parallel = Parallel {
        rank: TpRank { rank, size },
        all_reduce,
        vocab_parallel,
    };
    let model =
        Qwen2Model::from_checkpoint_part(config, &mut ckpt, Some(parallel), DType::F32, &device())
            .unwrap();
    ckpt.finish().unwrap();
    model
}

/// The prompt's logits at every position, then `STEPS` greedy tokens each decoded over the
/// cache: (all logits rows, tokens).
fn run(model: &Qwen2Model) -> (Vec<Vec<f32>>, Vec<u32>) {
    let mut cache = KvCache::new(&model.config, 8, BLOCK_SIZE, DType::F32, &device()).unwrap();
    let mut seqs = [Seq {
        tokens: PROMPT.to_vec(),
        table: Blocks::new(8).take(2),
        cached: 0,
    }];
    let mut rows = step(model, &mut cache, &mut seqs, LogitsRows::All);
    let mut drawn = Vec::new();
    for _ in 0..STEPS {
        let next = argmax(rows.last().unwrap());
        drawn.push(next);
        seqs[0].tokens.push(next);
        rows.extend(step(model, &mut cache, &mut seqs, LogitsRows::All));
    }
    (rows, drawn)
}

#[test]
fn sharded_ranks_match_the_whole_model() {
    for name in CHECKPOINTS {
        let (whole_rows, whole_tokens) = run(&load_model(name));
        for (size, vocab_parallel) in [(2, false), (2, true), (4, false), (4, true)] {
            let outputs: Vec<(Vec<Vec<f32>>, Vec<u32>)> = std::thread::scope(|s| {
                let group = HostAllReduce::group(size);
                let ranks: Vec<_> = group
                    .into_iter()
                    .enumerate()
                    .map(|(rank, all_reduce)| {
                        s.spawn(move || {
                            let model = rank_model(name, rank, size, all_reduce, vocab_parallel);
                            let c = &model.config;
                            // The vocabulary split in token order, every rank a part of it
                            // (or whole on every rank).
                            let v = c.vocab_size;
                            let (n, extra) = (v / size, v % size);
                            if vocab_parallel {
                                assert_eq!(model.vocab.start, rank * n + rank.min(extra));
                                assert_eq!(model.vocab.len(), n + usize::from(rank < extra));
                            } else {
                                assert_eq!(model.vocab, 0..v);
                            }
                            assert_eq!(model.embed_tokens.val().dims()[0], model.vocab.len());
                            let heads = c.num_attention_heads;
                            (
                                run(&model),
                                heads,
                                c.num_key_value_heads,
                                c.intermediate_size,
                            )
                        })
                    })
                    .collect();
                ranks
                    .into_iter()
                    .map(|r| {
                        let (out, heads, kv, inter) = r.join().unwrap();
                        let whole =
                            Qwen2Config::from_file(fixture(name).join("config.json")).unwrap();
                        assert_eq!(heads * size, whole.num_attention_heads);
                        assert_eq!(kv, (whole.num_key_value_heads / size).max(1));
                        assert_eq!(inter * size, whole.intermediate_size);
                        out
                    })
                    .collect()
            });
            for (rank, (rows, tokens)) in outputs.iter().enumerate() {
                assert_eq!(
                    tokens, &whole_tokens,
                    "{name} TP {size} (vocab parallel: {vocab_parallel}) rank {rank}: tokens"
                );
                assert_eq!(rows.len(), whole_rows.len());
                for (p, (row, want)) in rows.iter().zip(&whole_rows).enumerate() {
                    assert_close(
                        &format!(
                            "{name} TP {size} (vocab parallel: {vocab_parallel}) rank {rank} row {p}"
                        ),
                        row,
                        want,
                        1e-4,
                    );
                }
                // The ranks hold the same bits: they draw the same tokens without exchanging.
                assert_eq!(rows, &outputs[0].0, "{name} TP {size}: rank {rank} differs");
            }
        }
    }
}

/// A size the heads do not divide is refused naming the field.
#[test]
fn sizes_that_do_not_divide_the_heads_are_refused() {
    let config = Qwen2Config::from_file(fixture("qwen2-tiny-untied").join("config.json")).unwrap();
    let err = TpRank::new(0, 3, &config).unwrap_err();
    assert!(
        matches!(&err, ModelError::Unsupported { field, .. } if field == "num_attention_heads"),
        "{err}"
    );
    let err = TpRank::new(2, 2, &config).unwrap_err();
    assert!(err.to_string().contains("rank 2 is outside 0..2"), "{err}");
    assert_eq!(TpRank::new(3, 4, &config).unwrap().kv_heads(&config), 1..2);
    assert_eq!(TpRank::new(1, 2, &config).unwrap().kv_heads(&config), 1..2);
    assert_eq!(TpRank::new(1, 8, &config).unwrap().heads(&config), 1..2);
    assert_eq!(TpRank::new(5, 8, &config).unwrap().kv_heads(&config), 1..2);
}
