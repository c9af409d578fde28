//! Generation through the engine against transformers' greedy continuations, and the engine's
//! promises: batched = alone, chunked prefill mixed with decodes, prefix caching, preemption,
//! seeded sampling, stop conditions, per-request failures, aborts.

use engine::{DeviceKind, EngineConfig, EngineError, FinishReason, SamplingParams};

use super::common::*;

/// Greedy ids of every golden prompt in one engine run (24-token steps: prompts are chunked
/// and mixed with the other sequences' decodes), with the top-5 log-probabilities.
pub fn check_goldens(name: &str, device: DeviceKind, alone_too: bool) {
    check_goldens_with(name, device, small_config(), alone_too);
}

/// [`check_goldens`] with the engine options `config` (its device replaced by `device`).
pub fn check_goldens_with(name: &str, device: DeviceKind, config: EngineConfig, alone_too: bool) {
    let golden = Golden::load(name);
    let prompts = golden.prompts();
    let mut engine = engine_on(name, device, config.clone());
    let params = SamplingParams {
        logprobs: Some(5),
        ..greedy(24)
    };
    let batched = run_all(
        &mut engine,
        prompts
            .iter()
            .map(|p| (p.clone(), params.clone()))
            .collect(),
    );
    let stats = engine.stats();
    assert!(stats.preemptions == 0, "{name}: unexpected preemption");
    for (i, f) in batched.iter().enumerate() {
        let key = format!("prompt.{i}");
        assert_eq!(
            f.tokens,
            golden.ids(&format!("{key}.greedy_ids")),
            "{name} {key}"
        );
        assert_eq!(f.last().finish_reason, Some(FinishReason::Length));
        // Log-probabilities differ from logits by a per-step constant: compare the gaps.
        let (ids, logits) = golden.greedy_top5(&key);
        let lps: Vec<_> = f
            .outputs
            .iter()
            .flat_map(|o| o.new_logprobs.clone())
            .collect();
        assert_eq!(lps.len(), 24);
        for (t, lp) in lps.iter().enumerate() {
            assert_eq!(lp.token_id, f.tokens[t]);
            assert!(
                (lp.logprob - lp.top[0].1).abs() < 1e-5,
                "{name} {key} step {t}: sampled = top-1"
            );
            for j in 1..5 {
                let ours = lp.top[0].1 - lp.top[j].1;
                let theirs = logits[t * 5] - logits[t * 5 + j];
                assert!(
                    (ours - theirs).abs() < 2e-4,
                    "{name} {key} step {t}: gap {j} {ours} vs {theirs}"
                );
                if (logits[t * 5 + j - 1] - logits[t * 5 + j]).abs() > 2e-4
                    && (j == 4 || (logits[t * 5 + j] - logits[t * 5 + j + 1]).abs() > 2e-4)
                {
                    assert_eq!(
                        lp.top[j].0,
                        ids[t * 5 + j],
                        "{name} {key} step {t}: top-{j} id"
                    );
                }
            }
        }
    }
    if alone_too {
        for i in [0, 3, 5] {
            let mut solo = engine_on(name, device, config.clone());
            let alone = run_all(&mut solo, vec![(prompts[i].clone(), greedy(24))]);
            assert_eq!(
                alone[0].tokens, batched[i].tokens,
                "{name} prompt {i}: alone vs batched"
            );
        }
    }
}

#[test]
fn greedy_matches_transformers_batched_chunked_and_alone() {
    for name in CHECKPOINTS {
        check_goldens(name, test_device(), true);
    }
}

/// The same on CubeCL's CPU runtime: our kernels (fused norm + linear, RoPE + KV write, the
/// decode and prefill attention kernels in mixed steps, the sampling kernel).
#[test]
fn greedy_matches_transformers_with_kernels_on_cubecl_cpu() {
    for name in CHECKPOINTS {
        check_goldens(name, DeviceKind::CubeclCpu, false);
    }
}

/// Text prompts through the tokenizer; the engine's incremental text equals the goldens'.
#[test]
fn text_prompts_stream_the_golden_text() {
    let name = "qwen2-tiny-tied";
    let golden = Golden::load(name);
    let mut engine = engine_on(name, test_device(), small_config());
    engine.set_stream_text(true);
    let cases = golden.json["text_tests"].as_array().unwrap().clone();
    let requests = cases
        .iter()
        .map(|c| {
            let p = SamplingParams {
                skip_special_tokens: false,
                ..greedy(24)
            };
            (engine.encode(c["text"].as_str().unwrap()).unwrap(), p)
        })
        .collect();
    let out = run_all(&mut engine, requests);
    for (j, case) in cases.iter().enumerate() {
        assert_eq!(
            out[j].tokens,
            golden.ids(&format!("text.{j}.greedy_ids")),
            "text {j}"
        );
        assert_eq!(
            out[j].text,
            case["greedy_text"].as_str().unwrap(),
            "text {j}"
        );
    }
}

#[test]
fn prefix_cache_hits_give_identical_outputs() {
    let name = "qwen3-tiny";
    let golden = Golden::load(name);
    let long = golden.prompts()[5].clone(); // 100 tokens
    let mut shared = long[..70].to_vec();
    shared.extend([7, 8, 9]);
    let reference = {
        let mut e = engine_on(
            name,
            test_device(),
            EngineConfig {
                enable_prefix_caching: false,
                ..small_config()
            },
        );
        run_all(
            &mut e,
            vec![
                (long.clone(), greedy(8)),
                (shared.clone(), greedy(8)),
                (long[..64].to_vec(), greedy(8)),
            ],
        )
    };
    let mut engine = engine_on(name, test_device(), small_config());
    let first = run_all(&mut engine, vec![(long.clone(), greedy(8))]);
    assert_eq!(first[0].last().num_cached_tokens, 0);
    // 70 shared tokens = 4 full blocks of 16.
    let second = run_all(&mut engine, vec![(shared.clone(), greedy(8))]);
    assert_eq!(second[0].last().num_cached_tokens, 64);
    // The whole prompt cached (64 tokens, 4 full blocks): the last block is recomputed.
    let third = run_all(&mut engine, vec![(long[..64].to_vec(), greedy(8))]);
    assert_eq!(third[0].last().num_cached_tokens, 48);
    assert_eq!(engine.stats().prefix_hit_tokens, 112);
    assert_eq!(first[0].tokens, reference[0].tokens);
    assert_eq!(second[0].tokens, reference[1].tokens);
    assert_eq!(third[0].tokens, reference[2].tokens);
}

#[test]
fn preemption_by_recompute_keeps_greedy_outputs() {
    let name = "qwen2-tiny-untied";
    let prompts = Golden::load(name).prompts();
    let requests = || {
        prompts
            .iter()
            .map(|p| (p.clone(), greedy(24)))
            .collect::<Vec<_>>()
    };
    let reference = run_all(
        &mut engine_on(name, test_device(), small_config()),
        requests(),
    );
    // 10 blocks of 16 tokens for six prompts of 1..100 tokens growing by 24 (21 blocks at the
    // end): the pool runs out.
    let tight = tight_pool(small_config());
    let mut engine = engine_on(name, test_device(), tight);
    let out = run_all(&mut engine, requests());
    assert!(
        engine.stats().preemptions > 0,
        "the pool should have run out"
    );
    for (i, (a, b)) in out.iter().zip(&reference).enumerate() {
        assert_eq!(a.tokens.len(), 24, "prompt {i}");
        assert_eq!(a.tokens, b.tokens, "prompt {i}");
        assert_eq!(a.last().finish_reason, Some(FinishReason::Length));
    }
    assert_eq!(engine.kv_usage(), 0.0);
}

#[test]
fn seeded_sampling_is_reproducible_whatever_the_batch() {
    let name = "qwen2-tiny-tied";
    let prompts = Golden::load(name).prompts();
    let seeded = |seed| seeded(seed, 16);
    let alone = run_all(
        &mut engine_on(name, test_device(), small_config()),
        vec![(prompts[2].clone(), seeded(7))],
    );
    let mut engine = engine_on(name, test_device(), small_config());
    let mut requests: Vec<_> = prompts.iter().map(|p| (p.clone(), seeded(99))).collect();
    requests.insert(1, (prompts[2].clone(), seeded(7)));
    let batched = run_all(&mut engine, requests);
    assert_eq!(batched[1].tokens, alone[0].tokens);
    // A different seed draws differently (16 draws from a spread-out distribution).
    assert_ne!(batched[3].tokens, alone[0].tokens);
}

#[test]
fn stop_conditions() {
    let name = "qwen2-tiny-tied";
    let golden = Golden::load(name);
    let prompt = golden.prompts()[4].clone();
    let want = golden.ids("prompt.4.greedy_ids");
    let mut engine = engine_on(name, test_device(), small_config());
    // A stop token: kept in the ids, ends with `stop`.
    let stop_id = want[5];
    let first = want.iter().position(|&t| t == stop_id).unwrap();
    let by_token = SamplingParams {
        stop_token_ids: vec![stop_id],
        ..SamplingParams::greedy(24)
    };
    // A stop string inside the golden text of a text prompt: the text is cut before it.
    let case = &golden.json["text_tests"][0];
    let text_prompt = engine.encode(case["text"].as_str().unwrap()).unwrap();
    let golden_text = case["greedy_text"].as_str().unwrap();
    let needle = " Sterling Sterling";
    let at = golden_text.find(needle).unwrap();
    let by_string = SamplingParams {
        stop: vec![needle.to_string()],
        skip_special_tokens: false,
        ..greedy(24)
    };
    let out = run_all(
        &mut engine,
        vec![(prompt.clone(), by_token), (text_prompt, by_string)],
    );
    assert_eq!(out[0].tokens, want[..=first].to_vec());
    assert_eq!(out[0].last().finish_reason, Some(FinishReason::Stop));
    assert_eq!(out[1].last().finish_reason, Some(FinishReason::Stop));
    assert_eq!(out[1].text, golden_text[..at]);
    // max_model_len: the prompt (33) + 5 = 38.
    let mut short = engine_on(
        name,
        test_device(),
        EngineConfig {
            max_model_len: Some(38),
            ..small_config()
        },
    );
    let out = run_all(&mut short, vec![(prompt.clone(), greedy(24))]);
    assert_eq!(out[0].tokens, want[..5].to_vec());
    assert_eq!(out[0].last().finish_reason, Some(FinishReason::Length));
    // min_tokens bans the stop token for the first 8 tokens.
    let min = SamplingParams {
        stop_token_ids: vec![stop_id],
        min_tokens: 8,
        ..SamplingParams::greedy(24)
    };
    let out = run_all(&mut engine, vec![(prompt, min)]);
    assert!(out[0].tokens.len() > 8);
    assert!(!out[0].tokens[..8].contains(&stop_id));
}

#[test]
fn bad_requests_fail_alone() {
    let name = "qwen3-tiny";
    let prompts = Golden::load(name).prompts();
    let config = EngineConfig {
        max_model_len: Some(120),
        num_kv_blocks: Some(12),
        ..small_config()
    };
    let mut engine = engine_on(name, test_device(), config);
    let ok = engine.add_request(prompts[3].clone(), greedy(4)).unwrap();
    let err = |r: Result<u64, EngineError>| r.unwrap_err().to_string();
    let bad_t = SamplingParams {
        temperature: -1.0,
        ..SamplingParams::default()
    };
    assert!(err(engine.add_request(prompts[3].clone(), bad_t)).contains("`temperature`"));
    let bad_p = SamplingParams {
        top_p: 1.5,
        ..SamplingParams::default()
    };
    assert!(err(engine.add_request(prompts[3].clone(), bad_p)).contains("`top_p`"));
    assert!(err(engine.add_request(vec![1; 120], greedy(4))).contains("max_model_len = 120"));
    assert!(err(engine.add_request(vec![], greedy(4))).contains("empty"));
    assert!(err(engine.add_request(vec![10_000_000], greedy(4))).contains("vocabulary"));
    // Fits the pool (12 blocks = 192 tokens) but grows past it: fails with an error output
    // while the other request finishes.
    let big = EngineConfig {
        max_model_len: Some(400),
        num_kv_blocks: Some(12),
        ..small_config()
    };
    let mut engine2 = engine_on(name, test_device(), big);
    let grows = engine2
        .add_request(prompts[5].clone(), greedy(150))
        .unwrap();
    let fine = engine2.add_request(prompts[2].clone(), greedy(10)).unwrap();
    let out = drain(&mut engine2, &[grows, fine]);
    match &out[0].last().finish_reason {
        Some(FinishReason::Error(e)) => assert!(e.contains("out of KV blocks"), "{e}"),
        other => panic!("expected an out-of-blocks error, got {other:?}"),
    }
    assert_eq!(out[1].tokens.len(), 10);
    assert_eq!(out[1].last().finish_reason, Some(FinishReason::Length));
    let out = drain(&mut engine, &[ok]);
    assert_eq!(out[0].tokens.len(), 4);
}

#[test]
fn abort_frees_the_request() {
    let name = "qwen2-tiny-untied";
    let prompts = Golden::load(name).prompts();
    let mut engine = engine_on(name, test_device(), small_config());
    let a = engine.add_request(prompts[5].clone(), greedy(50)).unwrap();
    let b = engine.add_request(prompts[4].clone(), greedy(6)).unwrap();
    engine.step().unwrap();
    engine.step().unwrap();
    assert!(engine.kv_usage() > 0.0);
    engine.abort(a).unwrap();
    assert!(
        engine.abort(a).is_err(),
        "a second abort names an unknown request"
    );
    let out = drain(&mut engine, &[a, b]);
    assert_eq!(out[0].last().finish_reason, Some(FinishReason::Abort));
    assert_eq!(out[1].tokens.len(), 6);
    assert_eq!(engine.kv_usage(), 0.0);
    assert!(!engine.has_unfinished());
}

/// A device failure injected in the runner (an error, then a panic, as a faulting backend
/// gives either) ends every running and waiting request with its cause and stops the engine:
/// later steps and requests answer the same error, and nothing panics out of `step`.
#[test]
fn a_failed_device_ends_every_request_and_the_engine() {
    let name = "qwen2-tiny-untied";
    let prompts = Golden::load(name).prompts();
    for panics in [false, true] {
        let config = EngineConfig {
            max_num_seqs: Some(2),
            ..small_config()
        };
        let mut engine = engine_on(name, test_device(), config);
        engine.set_fault_hook(Box::new(move |forward| match forward {
            0..3 => Ok(()),
            _ if panics => panic!("injected kernel panic at forward {forward}"),
            _ => Err(format!("injected device fault at forward {forward}")),
        }));
        let ids: Vec<_> = prompts
            .iter()
            .take(4)
            .map(|p| engine.add_request(p.clone(), greedy(20)).unwrap())
            .collect();
        let mut steps = 0;
        let err = loop {
            match engine.step() {
                Ok(_) => steps += 1,
                Err(e) => break e,
            }
            assert!(steps < 10, "the injected fault never surfaced");
        };
        assert_eq!(steps, 3, "three forwards ran before the fault");
        let cause = if panics {
            "injected kernel panic at forward 3"
        } else {
            "injected device fault at forward 3"
        };
        assert!(
            matches!(&err, EngineError::DeviceFailed(c) if c.contains(cause)),
            "{err}"
        );
        assert_eq!(engine.failure().map(|c| c.contains(cause)), Some(true));
        // Two requests ran and two waited (max_num_seqs = 2): none is left.
        assert_eq!(ids.len(), 4);
        assert!(!engine.has_unfinished());
        assert_eq!((engine.num_running(), engine.num_waiting()), (0, 0));
        assert_eq!(engine.kv_usage(), 0.0);
        let again = engine.step().unwrap_err();
        assert!(again.to_string().contains(cause), "{again}");
        let refused = engine
            .add_request(prompts[0].clone(), greedy(4))
            .unwrap_err();
        assert!(matches!(refused, EngineError::DeviceFailed(_)), "{refused}");
    }
}

/// Decode steps replayed as CUDA graphs (captured once, at one-token contexts, with the
/// decode split planned for `max_model_len`) give the tokens eager steps give, as contexts
/// grow to hundreds of tokens. Without CUDA both runs are eager.
#[test]
fn step_graphs_match_eager_steps_as_contexts_grow() {
    let name = "qwen3-tiny";
    let device = test_device();
    let vocab = 1000;
    let prompts: Vec<Vec<u32>> = [5usize, 300, 900]
        .iter()
        .map(|&n| {
            (0..n as u32)
                .map(|i| (i * 7919 + n as u32 * 31) % vocab)
                .collect()
        })
        .collect();
    let config = EngineConfig {
        max_num_batched_tokens: 512,
        max_model_len: Some(2048),
        num_kv_blocks: Some(256),
        ..small_config()
    };
    let requests = || {
        prompts
            .iter()
            .map(|p| (p.clone(), greedy(40)))
            .collect::<Vec<_>>()
    };
    let mut eager = engine_on(
        name,
        device,
        EngineConfig {
            enforce_eager: true,
            ..config.clone()
        },
    );
    let want = run_all(&mut eager, requests());
    let mut graphed = engine_on(name, device, config);
    let got = run_all(&mut graphed, requests());
    if matches!(device, DeviceKind::Cuda(_)) {
        assert_eq!(
            graphed.limits().graph_sizes,
            engine::default_graph_sizes(4, 512),
            "{:?}",
            graphed.limits().graph_failures
        );
        assert!(
            graphed.stats().graph_steps > 30,
            "decode steps replayed graphs"
        );
    }
    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
        assert_eq!(a.tokens, b.tokens, "prompt {i}");
    }
}
