//! Tensor parallelism through the engine on the CPU: TP = 2 and 4, ranks as threads over the
//! host collective. Greedy continuations and log-probability gaps equal transformers' on every
//! fixture (KV heads split at TP 2, replicated at TP 4); seeded draws, preemption and prefix
//! caching give what one rank gives; a size the heads do not divide is refused naming the
//! field.

use engine::{EngineConfig, EngineError, LLMEngine, SamplingParams};

use super::common::*;
use super::generation::check_goldens_with;

fn tp(size: usize, config: EngineConfig) -> EngineConfig {
    EngineConfig {
        tensor_parallel_size: size,
        ..config
    }
}

#[test]
fn greedy_matches_transformers_at_tp_2_and_4() {
    for name in CHECKPOINTS {
        for size in [2, 4] {
            check_goldens_with(name, test_device(), tp(size, small_config()), false);
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
    for size in [2, 4] {
        let mut engine = engine_on(name, test_device(), tp(size, config.clone()));
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
        let err = loop {
            if let Err(e) = engine.step() {
                break e;
            }
        };
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
