//! Tensor parallelism through the engine on the CPU: TP = 2 and 4, ranks as threads over the
//! host collective. Greedy continuations and log-probability gaps equal transformers' on every
//! fixture (KV heads split at TP 2, replicated at TP 4); seeded draws, preemption and prefix
//! caching give what one rank gives, whether a step's rows draw over vocabulary shards and
//! exchange their best (plain and greedy rows, with penalties, biases and token masks) or
//! gather whole rows (filters, log-probabilities); a size the heads do not divide is refused
//! naming the field; a rank that fails or hangs ends the engine.

use burn::tensor::TensorData;
use engine::sampler::TokenMasks;
use engine::{EngineConfig, EngineError, LLMEngine, SamplingParams};

use super::common::*;
use super::generation::check_goldens_with;

fn tp(size: usize, config: EngineConfig) -> EngineConfig {
    EngineConfig {
        tensor_parallel_size: size,
        ..config
    }
}

/// Steps until a step fails; returns its error.
fn first_error(engine: &mut LLMEngine) -> EngineError {
    loop {
        if let Err(e) = engine.step() {
            return e;
        }
    }
}

/// [`tp`] with the embedding and LM head split by vocabulary rows.
fn tp_vocab(size: usize, config: EngineConfig) -> EngineConfig {
    EngineConfig {
        vocab_parallel: true,
        ..tp(size, config)
    }
}

#[test]
fn greedy_matches_transformers_at_tp_2_and_4() {
    for name in CHECKPOINTS {
        for size in [2, 4] {
            check_goldens_with(name, test_device(), tp(size, small_config()), false);
            check_goldens_with(name, test_device(), tp_vocab(size, small_config()), false);
        }
    }
}

/// Seeded sampling (top-k, top-p, min-p, penalties, a logit bias) among other requests, under
/// preemption (a pool too small for the batch) and with a prefix-cache hit: the same tokens as
/// one rank.
#[test]
fn sampling_preemption_and_prefix_hits_match_one_rank() {
    let name = "qwen2-tiny-untied";
    let prompts = Golden::load(name).prompts();
    let seeded = |seed| SamplingParams {
        repetition_penalty: 1.2,
        frequency_penalty: 0.3,
        logit_bias: vec![(7, 2.0)],
        ..seeded(seed, 24)
    };
    let mut requests: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| (p.clone(), seeded(i as u64)))
        .collect();
    // The longest prompt again: its blocks are cached by then.
    requests.push((prompts[5].clone(), seeded(5)));
    let config = tight_pool(small_config());
    let mut one = engine_on(name, test_device(), config.clone());
    let reference = run_all(&mut one, requests.clone());
    for config in [2, 4]
        .map(|s| tp(s, config.clone()))
        .into_iter()
        .chain([tp_vocab(2, config)])
    {
        let size = config.tensor_parallel_size;
        let mut engine = engine_on(name, test_device(), config);
        let out = run_all(&mut engine, requests.clone());
        assert!(
            engine.stats().preemptions > 0,
            "TP {size}: the pool should run out"
        );
        for (i, (a, b)) in out.iter().zip(&reference).enumerate() {
            assert_eq!(a.tokens, b.tokens, "TP {size} request {i}");
        }
        assert_eq!(engine.kv_usage(), 0.0);
    }
}

/// Rows drawn shard by shard (plain temperature with penalties and a logit bias, allowed
/// tokens, bad words, greedy) beside rows that need whole rows (filters, log-probabilities),
/// on the real Qwen2 vocabulary (151,936 tokens: shards of 75,968 and 37,984): the same tokens
/// and log-probabilities as one rank.
#[test]
fn shard_draws_and_gathered_rows_match_one_rank() {
    let name = "qwen2-tiny-tied";
    let prompts = Golden::load(name).prompts();
    let plain = |seed| SamplingParams {
        temperature: 0.9,
        seed: Some(seed),
        ignore_eos: true,
        max_tokens: 12,
        ..SamplingParams::default()
    };
    let vocab = 151_936u32;
    let requests: Vec<(Vec<u32>, SamplingParams)> = vec![
        (
            prompts[0].clone(),
            SamplingParams {
                repetition_penalty: 1.3,
                presence_penalty: 0.5,
                logit_bias: vec![(vocab - 3, 4.0), (100_000, 3.0)],
                ..plain(1)
            },
        ),
        (
            prompts[1].clone(),
            SamplingParams {
                // Tokens on both sides of every shard boundary, and the last one.
                allowed_token_ids: Some(vec![5, 37_983, 37_984, 75_967, 75_968, vocab - 1]),
                ..plain(2)
            },
        ),
        (
            prompts[2].clone(),
            SamplingParams {
                bad_words: vec![vec![11], vec![13]],
                ..greedy(12)
            },
        ),
        (
            prompts[3].clone(),
            SamplingParams {
                logprobs: Some(3),
                ..plain(4)
            },
        ),
        (prompts[4].clone(), seeded(5, 12)),
        (prompts[5].clone(), plain(6)),
    ];
    // Alone, the shard-drawn rows exchange every step; with the others, every step gathers.
    let batches = [vec![0, 1, 2, 5], vec![3, 4, 0, 1]];
    let config = small_config();
    let mut one = engine_on(name, test_device(), config.clone());
    let mut engines: Vec<_> = [2, 4]
        .map(|size| {
            (
                size,
                engine_on(name, test_device(), tp_vocab(size, config.clone())),
            )
        })
        .into();
    for batch in batches {
        let requests: Vec<_> = batch.iter().map(|&i| requests[i].clone()).collect();
        let reference = run_all(&mut one, requests.clone());
        for (size, engine) in &mut engines {
            let out = run_all(engine, requests.clone());
            for (k, (a, b)) in out.iter().zip(&reference).enumerate() {
                let i = batch[k];
                assert_eq!(a.tokens, b.tokens, "TP {size} request {i}");
                let lp = |f: &Finished| -> Vec<_> {
                    f.outputs
                        .iter()
                        .flat_map(|o| o.new_logprobs.clone())
                        .collect()
                };
                let (got, want) = (lp(a), lp(b));
                assert_eq!(got.len(), want.len(), "TP {size} request {i}: log-probs");
                assert_eq!(got.is_empty(), i != 3, "request {i}: log-probs");
                for (g, w) in got.iter().zip(&want) {
                    assert_eq!(g.token_id, w.token_id);
                    assert!((g.logprob - w.logprob).abs() < 1e-4, "{g:?} vs {w:?}");
                    let ids =
                        |t: &engine::TokenLogprobs| t.top.iter().map(|p| p.0).collect::<Vec<_>>();
                    assert_eq!(ids(g), ids(w));
                }
                if i == 1 {
                    let allowed = [5, 37_983, 37_984, 75_967, 75_968, vocab - 1];
                    assert!(
                        a.tokens.iter().all(|t| allowed.contains(t)),
                        "{:?}",
                        a.tokens
                    );
                }
            }
        }
    }
}

/// A shard's bits of structured outputs' masks are the whole masks' bits of its tokens, at
/// boundaries inside a word and at the end of the vocabulary.
#[test]
fn token_masks_cut_at_any_token() {
    let vocab = 1000usize;
    let words = vocab.div_ceil(32);
    let bits: Vec<u32> = (0..2 * words as u32)
        .map(|i| i.wrapping_mul(0x9e37_79b9) ^ (i << 7))
        .collect();
    let masks = TokenMasks {
        allowed: TensorData::new(bits.clone(), [2, words]),
        rows: vec![0, 3],
    };
    for tokens in [0..333, 333..666, 666..1000, 32..64, 31..1000, 999..1000] {
        let part = masks.shard(&tokens).unwrap();
        let got = part.as_slice::<u32>().unwrap();
        let w = tokens.len().div_ceil(32);
        assert_eq!(part.shape().as_slice(), [2, w]);
        for r in 0..2 {
            for (k, t) in tokens.clone().enumerate() {
                let want = bits[r * words + t / 32] >> (t % 32) & 1;
                assert_eq!(
                    got[r * w + k / 32] >> (k % 32) & 1,
                    want,
                    "{tokens:?} row {r} token {t}"
                );
            }
        }
    }
}

#[test]
fn sizes_that_do_not_divide_the_model_are_refused() {
    // 8 query heads: 3 does not divide them.
    let err = LLMEngine::new(fixture("qwen2-tiny-untied"), tp(3, small_config()))
        .err()
        .expect("TP 3 of 8 heads");
    assert!(
        matches!(&err, EngineError::InvalidConfig { field, .. } if *field == "tensor_parallel_size"),
        "{err}"
    );
    assert!(err.to_string().contains("num_attention_heads"), "{err}");
}

/// A device failure on rank 0 mid-run (injected at its fourth forward, after the workers were
/// sent that step) ends the engine with its cause and every request; the workers, left waiting
/// in the step's first all-reduce, leave the group, and dropping the engine returns (bounded
/// here by a minute).
#[test]
fn a_failed_rank_ends_the_engine_and_its_workers() {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let name = "qwen2-tiny-untied";
        let prompts = Golden::load(name).prompts();
        let mut engine = engine_on(name, test_device(), tp(2, small_config()));
        engine.set_fault_hook(Box::new(|forward| match forward {
            0..3 => Ok(()),
            _ => Err(format!("injected device fault at forward {forward}")),
        }));
        for p in prompts.iter().take(4) {
            engine.add_request(p.clone(), greedy(20)).unwrap();
        }
        let err = first_error(&mut engine);
        let unfinished = engine.has_unfinished();
        drop(engine);
        let _ = done.send((err, unfinished));
    });
    let (err, unfinished) = finished
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the engine and its workers stopped");
    assert!(
        matches!(&err, EngineError::DeviceFailed(c) if c.contains("injected device fault at forward 3")),
        "{err}"
    );
    assert!(!unfinished);
}

/// A worker that hangs (stalled for ten minutes before its next step) ends the engine with an
/// error naming it once the step timeout passes, and dropping the engine returns (the whole
/// bounded here by a minute).
#[test]
fn a_hung_rank_ends_the_engine_within_the_step_timeout() {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let name = "qwen2-tiny-untied";
        let prompts = Golden::load(name).prompts();
        let config = EngineConfig {
            tensor_parallel_step_timeout: std::time::Duration::from_secs(5),
            ..tp(2, small_config())
        };
        let mut engine = engine_on(name, test_device(), config);
        for p in prompts.iter().take(2) {
            engine.add_request(p.clone(), greedy(8)).unwrap();
        }
        // A few steps first: a healthy group is not taken for hung.
        for _ in 0..3 {
            engine.step().unwrap();
        }
        let start = std::time::Instant::now();
        engine
            .stall_worker(1, std::time::Duration::from_secs(600))
            .unwrap();
        let err = first_error(&mut engine);
        let waited = start.elapsed();
        drop(engine);
        let _ = done.send((err, waited));
    });
    let (err, waited) = finished
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the engine ended and returned");
    assert!(
        matches!(&err, EngineError::DeviceFailed(c) if c.contains("rank 1 hung")),
        "{err}"
    );
    assert!(waited >= std::time::Duration::from_secs(5), "{waited:?}");
}
