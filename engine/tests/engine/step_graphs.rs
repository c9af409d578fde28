//! Steps through the step graphs' padded layout: decode rows and prefill chunks in stable
//! buffers sized for a token bucket, padding tokens (slot −1), padding decode rows (context 0),
//! padding prefill tiles (sequence −1), sampled rows picked by index. Without a GPU the graphs
//! are emulated (`emulate_graphs`: the same buffers and padded forward, run eagerly on CubeCL's
//! CPU runtime, every kernel involved); with `ENGINE_TEST_DEVICE=cuda` the same tests replay
//! captured CUDA graphs. Greedy outputs must equal transformers' goldens and the eager steps',
//! through chunk boundaries, prefix-cache hits and preemption. Padding that reached the KV
//! cache (the first request's first block is block 0, where a padding slot 0 would write) or
//! the sampler would change them.

use engine::scheduler::{Scheduler, SchedulerLimits};
use engine::{BlockManager, DeviceKind, EngineConfig, FinishReason, SamplingParams, Sequence};

use super::common::*;
use super::generation::check_goldens_with;

/// CUDA when the tests run there (captured graphs), else CubeCL's CPU runtime (emulated).
fn graph_device() -> DeviceKind {
    match test_device() {
        DeviceKind::Cuda(i) => DeviceKind::Cuda(i),
        _ => DeviceKind::CubeclCpu,
    }
}

/// [`small_config`] (4 sequences, 24-token steps) with step graphs of `sizes` tokens and
/// overlapped scheduling (as on CUDA by default: the graphs feed their decode rows the
/// previous step's draws).
fn graph_config(sizes: &[usize]) -> EngineConfig {
    EngineConfig {
        cuda_graph_sizes: Some(sizes.to_vec()),
        emulate_graphs: !matches!(graph_device(), DeviceKind::Cuda(_)),
        async_scheduling: Some(true),
        ..small_config()
    }
}

/// Every golden prompt batched (chunked prompts mixed with decodes), every step through a
/// graph: steps shaped to 8/16/24 tokens, decode-only steps padded to the 1- or 8-token graph;
/// overlapped and synchronous steps.
#[test]
fn graph_steps_match_transformers() {
    for name in CHECKPOINTS {
        for overlap in [true, false] {
            let config = EngineConfig {
                async_scheduling: Some(overlap),
                ..graph_config(&[1, 8, 16, 24])
            };
            check_goldens_with(name, graph_device(), config, false);
        }
    }
    let name = "qwen2-tiny-tied";
    let mut engine = engine_on(name, graph_device(), graph_config(&[1, 8, 16, 24]));
    let prompts = Golden::load(name).prompts();
    run_all(
        &mut engine,
        prompts.into_iter().map(|p| (p, greedy(24))).collect(),
    );
    let stats = engine.stats();
    assert_eq!(
        stats.graph_steps, stats.steps,
        "every step ran through a graph"
    );
    assert!(
        stats.prefill_steps > 3,
        "mixed and prefill steps ran through graphs"
    );
}

/// One 24-token graph for every step: a decode step of four rows is padded with 20 tokens,
/// a prefill chunk of 5 with 19, and their decode rows and tiles with padding entries; the
/// outputs are still the goldens and the prompts run alone give the same tokens.
#[test]
fn padding_reaches_no_request() {
    for name in ["qwen2-tiny-tied", "qwen3-tiny-hd32"] {
        check_goldens_with(name, graph_device(), graph_config(&[24]), true);
    }
}

/// Prefix-cache hits and preemption by recompute through graph steps: the tokens of eager
/// steps without caching and without a tight pool.
#[test]
fn graph_steps_keep_prefix_hits_and_preemption_exact() {
    let name = "qwen3-tiny";
    let golden = Golden::load(name);
    let long = golden.prompts()[5].clone(); // 100 tokens
    let mut shared = long[..70].to_vec();
    shared.extend([7, 8, 9]);
    let requests = vec![
        (long.clone(), greedy(8)),
        (shared, greedy(8)),
        (long[..64].to_vec(), greedy(8)),
    ];
    let eager = EngineConfig {
        enable_prefix_caching: false,
        enforce_eager: true,
        ..small_config()
    };
    let mut want = Vec::new();
    for r in &requests {
        want.extend(run_all(
            &mut engine_on(name, graph_device(), eager.clone()),
            vec![r.clone()],
        ));
    }
    let mut engine = engine_on(name, graph_device(), graph_config(&[1, 8, 16, 24]));
    for (r, w) in requests.into_iter().zip(&want) {
        let got = run_all(&mut engine, vec![r]);
        assert_eq!(got[0].tokens, w.tokens);
    }
    assert_eq!(engine.stats().prefix_hit_tokens, 112);

    let name = "qwen2-tiny-untied";
    let golden = Golden::load(name);
    let tight = tight_pool(graph_config(&[1, 8, 16, 24]));
    let mut engine = engine_on(name, graph_device(), tight);
    let out = run_all(
        &mut engine,
        golden
            .prompts()
            .into_iter()
            .map(|p| (p, greedy(24)))
            .collect(),
    );
    assert!(
        engine.stats().preemptions > 0,
        "the pool should have run out"
    );
    for (i, f) in out.iter().enumerate() {
        let key = format!("prompt.{i}.greedy_ids");
        assert_eq!(f.tokens, golden.ids(&key), "{name} {key}");
        assert_eq!(f.last().finish_reason, Some(FinishReason::Length));
    }
    assert_eq!(engine.kv_usage(), 0.0);
}

/// The default buckets: every doubling from 256 up to `max_num_seqs` for decode steps (a
/// decode step of `b > 128` rows never pads to `2b` rows or more), `max_num_seqs` itself, the
/// mixed-step sizes up to 8,192, nothing above the token limit.
#[test]
fn default_graph_sizes_double_up_to_max_num_seqs() {
    use engine::default_graph_sizes as sizes;
    let common = [1, 8, 32, 128, 256, 512, 1024, 2048, 4096, 8192];
    assert_eq!(sizes(256, 8192), common);
    assert_eq!(sizes(512, 16384), common);
    assert_eq!(sizes(1024, 16384), common);
    assert_eq!(sizes(2048, 16384), common);
    assert_eq!(
        sizes(384, 12000),
        [1, 8, 32, 128, 256, 384, 512, 1024, 2048, 4096, 8192]
    );
    assert_eq!(sizes(4, 512), [1, 4, 8, 32, 128, 512]);
    assert_eq!(sizes(8, 64), [1, 8, 32]);
    for (seqs, tokens) in [
        (256, 8192),
        (512, 16384),
        (1024, 16384),
        (384, 12000),
        (700, 4096),
    ] {
        let all = sizes(seqs, tokens);
        for b in 129..=seqs.min(tokens) {
            let bucket = all
                .iter()
                .copied()
                .find(|&s| s >= b)
                .expect("a bucket holds it");
            assert!(bucket < 2 * b, "{seqs}/{tokens}: {b} rows pad to {bucket}");
        }
    }
}

/// The default batch limit: vLLM's 256 off large GPUs (a CPU here), and a default of 1,024
/// lowered to the sequences the KV pool gives 1,024 tokens each, never below 256.
#[test]
fn default_batch_limit_follows_the_device_and_the_pool() {
    use engine::{TOKENS_PER_DEFAULT_SEQ, default_max_num_seqs, seqs_the_pool_serves};
    assert_eq!(default_max_num_seqs(DeviceKind::Cpu), 256);
    assert_eq!(EngineConfig::default().max_num_seqs(), 256);
    // A default never exceeds the step's tokens; a given limit that does is refused.
    let small_steps = EngineConfig {
        max_num_batched_tokens: 100,
        ..EngineConfig::default()
    };
    assert_eq!(small_steps.max_num_seqs(), 100);
    assert!(small_steps.validate().is_ok());
    let too_many = EngineConfig {
        max_num_seqs: Some(101),
        ..small_steps
    };
    assert!(
        too_many
            .validate()
            .unwrap_err()
            .to_string()
            .contains("max_num_batched_tokens")
    );
    assert_eq!(TOKENS_PER_DEFAULT_SEQ, 1024);
    // A 0.5B model's pool (4.4 M tokens), a 7B model's (544 k), a small one (100 k).
    assert_eq!(seqs_the_pool_serves(1024, 4_400_000), 1024);
    assert_eq!(seqs_the_pool_serves(1024, 544_000), 531);
    assert_eq!(seqs_the_pool_serves(1024, 100_000), 256);
    assert_eq!(seqs_the_pool_serves(256, 100_000), 256);
    // The engine reports the limit in force.
    let config = EngineConfig {
        num_kv_blocks: Some(64),
        max_model_len: Some(256),
        ..EngineConfig::default()
    };
    let engine = engine_on("qwen2-tiny-tied", DeviceKind::Cpu, config);
    assert_eq!(engine.limits().max_num_seqs, 256);
    assert_eq!(engine.config().max_num_seqs, Some(256));
}

/// The scheduler shapes steps to the graph sizes: a prefill-heavy step is cut to the largest
/// size it can fill, a step that cannot fill one keeps its demand (the graph pads it), decodes
/// alone are never cut.
#[test]
fn steps_are_shaped_to_graph_sizes() {
    // Prompts of 30, 30 and 3 tokens; the token counts of the first steps.
    let steps = |sizes: Vec<usize>, n: usize| {
        let mut s = Scheduler::new(
            SchedulerLimits {
                max_num_seqs: 8,
                max_num_batched_tokens: 64,
            },
            BlockManager::new(64, 4, false),
        )
        .with_step_sizes(sizes, 32);
        let params = std::sync::Arc::new(SamplingParams::default());
        for (id, len) in [(0u64, 30u32), (1, 30), (2, 3)] {
            s.add(Sequence::new(id, (0..len).collect(), params.clone(), 0));
        }
        (0..n)
            .map(|_| {
                let out = s.schedule();
                for seq in &out.seqs {
                    s.on_computed(seq);
                    if seq.samples {
                        s.get_mut(seq.id).unwrap().token_ids.push(1);
                    }
                }
                out.num_tokens()
            })
            .collect::<Vec<_>>()
    };
    // 63 tokens of demand, cut to 48 (the first prompt, 18 of the second: more than half of
    // the 63 prefill tokens); then one decode, 12 + 3 prompt tokens: 16; a cut to 8 would
    // compute 7 of the 15 prefill tokens, under half: the step runs whole (padded to 32);
    // then three one-token rows: 3, under every size, run as they are.
    assert_eq!(steps(vec![32, 8, 48], 4), [48, 16, 3, 3]);
    // With a size of 12, the cut computes 11 of the 15 (the second prompt's, but its last):
    // 12, then 1 + 1 + 3 = 5 (under every size).
    assert_eq!(steps(vec![32, 12, 48], 3), [48, 12, 5]);
    // Without sizes, the budget alone: 63 tokens at once.
    assert_eq!(steps(Vec::new(), 2), [63, 3]);
}

/// With a cap of one prefill chunk a step, the three prompts take turns.
#[test]
fn steps_hold_at_most_the_graphs_prefill_chunks() {
    let mut s = Scheduler::new(
        SchedulerLimits {
            max_num_seqs: 8,
            max_num_batched_tokens: 64,
        },
        BlockManager::new(64, 4, false),
    )
    .with_step_sizes(vec![64], 1);
    let params = std::sync::Arc::new(SamplingParams::default());
    for id in 0..3u64 {
        s.add(Sequence::new(id, (0..20).collect(), params.clone(), 0));
    }
    let mut tokens = Vec::new();
    for _ in 0..4 {
        let out = s.schedule();
        assert!(out.seqs.len() - out.num_decodes <= 1);
        tokens.push(out.num_tokens());
        for seq in &out.seqs {
            s.on_computed(seq);
            if seq.samples {
                s.get_mut(seq.id).unwrap().token_ids.push(1);
            }
        }
    }
    // One 20-token prompt a step (a demand of 20: no size fits under it, so it runs whole),
    // joined by the decodes of those before it.
    assert_eq!(tokens, [20, 21, 22, 3]);
}

/// A KV pool the engine sizes itself (no `num_kv_blocks`): on CUDA the step graphs are
/// captured once to measure their memory, released, and captured again against the pool;
/// the outputs are still the goldens, and the pool holds one sequence of `max_model_len` and
/// at most twice `max_num_seqs` of them (on CUDA exactly that: a tiny model's graphs leave
/// the GPU plenty). A tiny model's graphs may fit in pages the pools already hold, so their
/// measured memory can be 0 on CUDA too.
#[test]
fn a_pool_sized_around_the_graphs_serves_the_goldens() {
    let config = EngineConfig {
        num_kv_blocks: None,
        ..graph_config(&[1, 8, 24])
    };
    let name = "qwen2-tiny-tied";
    check_goldens_with(name, graph_device(), config.clone(), false);
    let engine = engine_on(name, graph_device(), config.clone());
    let l = engine.limits();
    let per_seq = l.max_model_len.div_ceil(l.block_size);
    assert!(l.num_kv_blocks >= per_seq, "{} blocks", l.num_kv_blocks);
    assert!(l.num_kv_blocks <= 2 * config.max_num_seqs() * per_seq);
    if matches!(graph_device(), DeviceKind::Cuda(_)) {
        assert!(l.graph_failures.is_empty(), "{:?}", l.graph_failures);
        assert_eq!(l.graph_captures.len(), 3, "1, 8 and 24 tokens");
        assert_eq!(l.num_kv_blocks, 2 * config.max_num_seqs() * per_seq);
    } else {
        assert_eq!(l.graph_memory, 0, "nothing to measure off CUDA");
    }
}

/// A copy of fixture `name` whose config says `max_position_embeddings = positions` (a
/// checkpoint of a longer context), in a fresh temporary folder.
fn with_positions(name: &str, positions: usize) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "burn-nanovllm-{name}-{positions}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let file = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    config["max_position_embeddings"] = positions.into();
    std::fs::write(&file, config.to_string()).unwrap();
    dir
}

/// A step's host work does not grow with `max_model_len`: the same requests through the same
/// graphs, at the checkpoint's own 131,072 positions (its default `max_model_len`) and at
/// 4,096, give the same tokens from the same steps, and write the same bytes of inputs to the
/// device (block tables by changed entry: rebuilt whole, a graph's tables were `rows × 8,192`
/// entries a step at 131,072 and `rows × 256` at 4,096). Overlapped and synchronous steps,
/// graphs and eager.
#[test]
fn step_inputs_do_not_grow_with_max_model_len() {
    let name = "qwen3-tiny";
    let dir = with_positions(name, 131_072);
    let prompts = Golden::load(name).prompts();
    for (overlap, eager) in [(true, false), (false, false), (true, true)] {
        let run = |max_model_len: Option<usize>| {
            let config = EngineConfig {
                max_model_len,
                async_scheduling: Some(overlap),
                enforce_eager: eager,
                ..graph_config(&[1, 8, 16, 24])
            };
            let mut engine = engine::LLMEngine::new(
                &dir,
                EngineConfig {
                    device: graph_device(),
                    ..config
                },
            )
            .unwrap();
            assert_eq!(
                engine.limits().max_model_len,
                max_model_len.unwrap_or(131_072)
            );
            let out = run_all(
                &mut engine,
                prompts.iter().map(|p| (p.clone(), greedy(40))).collect(),
            );
            let tokens: Vec<Vec<u32>> = out.into_iter().map(|f| f.tokens).collect();
            (tokens, engine.stats())
        };
        let (short, s) = run(Some(4096));
        let (long, l) = run(None);
        assert_eq!(short, long, "overlap {overlap}, eager {eager}");
        assert_eq!((s.steps, s.graph_steps), (l.steps, l.graph_steps));
        assert_eq!(
            s.graph_timings.bytes_written, l.graph_timings.bytes_written,
            "overlap {overlap}, eager {eager}"
        );
        if !eager {
            assert!(s.graph_steps > 10 && s.graph_timings.bytes_written > 0);
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}
