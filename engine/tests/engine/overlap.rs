//! Overlapped (asynchronous) scheduling: a step is enqueued before the previous one's draws
//! are processed, its decode rows take those draws on the device, and stop conditions run one
//! step behind. On the CPU the same code runs (the draws buffer, the device-side feed, the late
//! stop checks); these tests hold it to the synchronous engine and the transformers goldens,
//! and check that no token drawn after a stop or an abort reaches any output.

use std::collections::HashMap;

use engine::{DeviceKind, EngineConfig, FinishReason, LLMEngine, RequestId, SamplingParams};
use proptest::prelude::*;

use super::common::*;
use super::generation::check_goldens_with;

/// `config` with overlapped or synchronous steps.
fn stepping(config: EngineConfig, overlap: bool) -> EngineConfig {
    EngineConfig {
        async_scheduling: Some(overlap),
        ..config
    }
}

/// Runs `requests` with synchronous and with overlapped steps; returns both runs' outputs.
fn both_ways(
    name: &str,
    device: DeviceKind,
    config: &EngineConfig,
    requests: &[(Vec<u32>, SamplingParams)],
    stream_text: bool,
) -> [Vec<Finished>; 2] {
    [false, true].map(|overlap| {
        let mut engine = engine_on(name, device, stepping(config.clone(), overlap));
        engine.set_stream_text(stream_text);
        run_all(&mut engine, requests.to_vec())
    })
}

/// Every field of two runs' final outputs agrees, and each request's streamed tokens are
/// exactly its final count (nothing emitted past a stop).
fn assert_same(what: &str, sync: &[Finished], overlap: &[Finished]) {
    for (i, (a, b)) in sync.iter().zip(overlap).enumerate() {
        assert_eq!(a.tokens, b.tokens, "{what} request {i}: tokens");
        assert_eq!(a.text, b.text, "{what} request {i}: text");
        let (la, lb) = (a.last(), b.last());
        assert_eq!(la.finish_reason, lb.finish_reason, "{what} request {i}");
        assert_eq!(
            la.num_output_tokens, lb.num_output_tokens,
            "{what} request {i}"
        );
        assert_eq!(b.tokens.len(), lb.num_output_tokens, "{what} request {i}");
    }
}

/// Greedy ids and top-5 log-probabilities of every golden prompt, batched with chunked
/// prefills mixed into decodes and alone, with overlapped steps on Burn's CPU backend (the
/// eager forward feeds the draws).
#[test]
fn overlapped_steps_match_transformers() {
    for name in CHECKPOINTS {
        check_goldens_with(name, test_device(), stepping(small_config(), true), true);
    }
}

/// Stop tokens, end-of-sequence, stop strings, `max_tokens`, `min_tokens` and `max_model_len`
/// end requests exactly where synchronous steps end them, in tokens and text, though the
/// overlapped engine has drawn one more token for each before it saw the stop.
#[test]
fn stops_are_exact_under_overlap() {
    let name = "qwen2-tiny-tied";
    let golden = Golden::load(name);
    let prompts = golden.prompts();
    let want = golden.ids("prompt.4.greedy_ids");
    let engine = engine_on(name, test_device(), small_config());
    let case = &golden.json["text_tests"][0];
    let text_prompt = engine.encode(case["text"].as_str().unwrap()).unwrap();
    let stop_id = want[5];
    let requests = vec![
        (
            prompts[4].clone(),
            SamplingParams {
                stop_token_ids: vec![stop_id],
                ..SamplingParams::greedy(24)
            },
        ),
        (
            text_prompt.clone(),
            SamplingParams {
                stop: vec![" Sterling Sterling".to_string()],
                skip_special_tokens: false,
                ..greedy(24)
            },
        ),
        (
            prompts[4].clone(),
            SamplingParams {
                stop_token_ids: vec![stop_id],
                min_tokens: 8,
                ..SamplingParams::greedy(24)
            },
        ),
        // A stop at the very first token.
        (
            prompts[1].clone(),
            SamplingParams {
                stop_token_ids: vec![golden.ids("prompt.1.greedy_ids")[0]],
                ..SamplingParams::greedy(24)
            },
        ),
        (prompts[0].clone(), SamplingParams::greedy(1)),
        (prompts[5].clone(), greedy(7)),
        (text_prompt, SamplingParams::greedy(24)),
    ];
    let [sync, overlap] = both_ways(name, test_device(), &small_config(), &requests, true);
    assert_same("stops", &sync, &overlap);
    let first = want.iter().position(|&t| t == stop_id).unwrap();
    assert_eq!(overlap[0].tokens, want[..=first]);
    let min = &overlap[2].tokens;
    assert!(
        min.len() > 8 && !min[..8].contains(&stop_id),
        "min_tokens: {min:?}"
    );
    assert_eq!(overlap[3].tokens.len(), 1, "stops at its first token");
    assert_eq!(overlap[4].tokens.len(), 1);
    assert_eq!(overlap[5].last().finish_reason, Some(FinishReason::Length));
    // max_model_len: the prompt (33) + 5 = 38, hit while a draw is in flight.
    let short = EngineConfig {
        max_model_len: Some(38),
        ..small_config()
    };
    let [sync, overlap] = both_ways(
        name,
        test_device(),
        &short,
        &[(prompts[4].clone(), greedy(24))],
        false,
    );
    assert_same("max_model_len", &sync, &overlap);
    assert_eq!(overlap[0].tokens, want[..5]);
}

/// Prefix-cache hits, preemption by recompute and seeded sampling give the synchronous
/// engine's tokens.
#[test]
fn prefix_hits_preemption_and_seeds_are_exact_under_overlap() {
    let name = "qwen3-tiny";
    let long = Golden::load(name).prompts()[5].clone(); // 100 tokens
    let mut shared = long[..70].to_vec();
    shared.extend([7, 8, 9]);
    for overlap in [false, true] {
        let mut engine = engine_on(name, test_device(), stepping(small_config(), overlap));
        for r in [long.clone(), shared.clone(), long[..64].to_vec()] {
            run_all(&mut engine, vec![(r, greedy(8))]);
        }
        assert_eq!(engine.stats().prefix_hit_tokens, 112, "overlap {overlap}");
    }
    let requests: Vec<_> = [long.clone(), shared, long[..64].to_vec()]
        .into_iter()
        .map(|p| (p, greedy(8)))
        .collect();
    let [sync, overlap] = both_ways(name, test_device(), &small_config(), &requests, false);
    assert_same("prefix", &sync, &overlap);

    let name = "qwen2-tiny-untied";
    let golden = Golden::load(name);
    let tight = tight_pool(small_config());
    let mut engine = engine_on(name, test_device(), stepping(tight, true));
    let requests = golden
        .prompts()
        .into_iter()
        .map(|p| (p, greedy(24)))
        .collect();
    let out = run_all(&mut engine, requests);
    assert!(
        engine.stats().preemptions > 0,
        "the pool should have run out"
    );
    for (i, f) in out.iter().enumerate() {
        assert_eq!(
            f.tokens,
            golden.ids(&format!("prompt.{i}.greedy_ids")),
            "{i}"
        );
    }
    assert_eq!(engine.kv_usage(), 0.0);

    let name = "qwen2-tiny-tied";
    let seeded = |seed| SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.9,
        seed: Some(seed),
        ignore_eos: true,
        max_tokens: 16,
        ..SamplingParams::default()
    };
    let requests: Vec<_> = Golden::load(name)
        .prompts()
        .into_iter()
        .enumerate()
        .map(|(i, p)| (p, seeded(i as u64)))
        .collect();
    let [sync, overlap] = both_ways(name, test_device(), &small_config(), &requests, false);
    assert_same("seeded", &sync, &overlap);
}

/// One operation of a random session.
#[derive(Clone, Debug)]
enum Op {
    /// Add a request: golden prompt `prompt`, `max_tokens`, and a stop id taken from its
    /// greedy continuation at index `stop_at` (if any).
    Add {
        prompt: usize,
        max_tokens: usize,
        stop_at: Option<usize>,
    },
    /// Abort the `k`-th live request (modulo their count).
    Abort(usize),
    /// Run `n` steps.
    Step(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..6usize, 1..12usize, prop::option::of(0..12usize))
            .prop_map(|(prompt, max_tokens, stop_at)| Op::Add { prompt, max_tokens, stop_at }),
        1 => (0..8usize).prop_map(Op::Abort),
        3 => (1..4usize).prop_map(Op::Step),
    ]
}

/// How one request of a session ended.
struct Ended {
    /// Every token it streamed.
    tokens: Vec<u32>,
    /// Its last output's `num_output_tokens`.
    count: usize,
    /// Its last output's finish reason.
    reason: Option<FinishReason>,
    /// The session aborted it.
    aborted: bool,
    params: SamplingParams,
}

/// Runs a session of random arrivals, aborts and steps to its end on `engine`; returns how
/// each request ended.
fn session(
    engine: &mut LLMEngine,
    ops: &[Op],
    prompts: &[Vec<u32>],
    goldens: &[Vec<u32>],
) -> Vec<Ended> {
    type Streamed = HashMap<RequestId, (Vec<u32>, usize, Option<FinishReason>)>;
    let mut requests: Vec<(RequestId, SamplingParams)> = Vec::new();
    let mut streamed = Streamed::new();
    let mut aborted = Vec::new();
    let take = |streamed: &mut Streamed, outs: Vec<engine::RequestOutput>| {
        for o in outs {
            let e = streamed.entry(o.id).or_default();
            assert!(e.2.is_none(), "request {}: output after its last", o.id);
            e.0.extend(&o.new_token_ids);
            e.1 = o.num_output_tokens;
            e.2 = o.finish_reason;
        }
    };
    for op in ops {
        match *op {
            Op::Add {
                prompt,
                max_tokens,
                stop_at,
            } => {
                let params = SamplingParams {
                    stop_token_ids: stop_at
                        .map(|i| vec![goldens[prompt][i.min(goldens[prompt].len() - 1)]])
                        .unwrap_or_default(),
                    ..greedy(max_tokens)
                };
                let id = engine
                    .add_request(prompts[prompt].clone(), params.clone())
                    .unwrap();
                requests.push((id, params));
            }
            Op::Abort(k) => {
                let live: Vec<RequestId> = requests
                    .iter()
                    .map(|r| r.0)
                    .filter(|id| streamed.get(id).is_none_or(|s| s.2.is_none()))
                    .filter(|id| !aborted.contains(id))
                    .collect();
                if !live.is_empty() {
                    let id = live[k % live.len()];
                    engine.abort(id).unwrap();
                    aborted.push(id);
                }
            }
            Op::Step(n) => {
                for _ in 0..n {
                    take(&mut streamed, engine.step().unwrap());
                }
            }
        }
    }
    let mut steps = 0;
    while engine.has_unfinished() {
        take(&mut streamed, engine.step().unwrap());
        steps += 1;
        assert!(steps < 1000, "the session did not end");
    }
    requests
        .into_iter()
        .map(|(id, params)| {
            let (tokens, count, reason) = streamed.remove(&id).unwrap_or_default();
            Ended {
                tokens,
                count,
                reason,
                aborted: aborted.contains(&id),
                params,
            }
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Random arrivals, aborts and stop ids under overlapped steps: every request ends once;
    /// what it streamed is what its last output counts; a finished request's tokens are its
    /// golden greedy continuation cut at the first stop id or `max_tokens`; an aborted one's
    /// are a prefix of it; and the pool is whole again at the end.
    #[test]
    fn random_sessions_end_exactly_and_free_every_block(ops in prop::collection::vec(op(), 1..14)) {
        let name = "qwen2-tiny-untied";
        let golden = Golden::load(name);
        let prompts = golden.prompts();
        let goldens: Vec<Vec<u32>> = (0..prompts.len())
            .map(|i| golden.ids(&format!("prompt.{i}.greedy_ids")))
            .collect();
        let config = EngineConfig {
            num_kv_blocks: Some(24),
            ..stepping(small_config(), true)
        };
        let mut engine = engine_on(name, test_device(), config);
        let results = session(&mut engine, &ops, &prompts, &goldens);
        for (i, Ended { tokens, count: n, reason, aborted, params }) in results.into_iter().enumerate() {
            prop_assert!(reason.is_some(), "request {} never ended", i);
            prop_assert_eq!(tokens.len(), n, "request {}: streamed vs counted", i);
            let prompt = ops.iter().filter_map(|o| match o {
                Op::Add { prompt, .. } => Some(*prompt),
                _ => None,
            }).nth(i).unwrap();
            let want = &goldens[prompt];
            let mut end = params.max_tokens.min(want.len());
            if let Some(at) = want[..end].iter().position(|t| params.stop_token_ids.contains(t)) {
                end = at + 1;
            }
            if aborted && reason == Some(FinishReason::Abort) {
                prop_assert!(tokens.len() <= end && tokens[..] == want[..tokens.len()], "request {}", i);
            } else {
                prop_assert_eq!(&tokens[..], &want[..end], "request {}", i);
            }
        }
        prop_assert_eq!(engine.kv_usage(), 0.0);
        prop_assert!(!engine.has_unfinished());
    }
}
