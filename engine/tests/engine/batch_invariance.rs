//! Batch-invariant inference (`EngineConfig::batch_invariant`): one probe request's tokens and
//! log-probabilities, compared bit for bit, alone and in a batch of 64 requests (its steps mixing
//! decode rows and prefill chunks), preempted and recomputed, and after a prefix-cache hit, with
//! eager steps and with step graphs (emulated on the CPU: their padded forward). The
//! model is the fixture with the real Qwen2 vocabulary, the device CubeCL's CPU runtime in f32
//! (`ENGINE_TEST_DEVICE=cuda`: CUDA in bf16; with `ENGINE_TEST_MODEL_CONFIG=config.json` too,
//! random weights of that config, e.g. `benches/configs/qwen2-0.5b.json`: the fixture's
//! 8-wide heads take no tensor-core attention tile). Burn's CPU backend (plain-Burn products,
//! whose blocking follows the number of rows) refuses the mode.

use std::sync::OnceLock;

use engine::{DeviceKind, EngineConfig, LLMEngine, SamplingParams};
use model_qwen2::{Qwen2Config, Qwen2Model};

use super::common::{Finished, drain, fixture, greedy, test_device};

const MODEL: &str = "qwen2-tiny-tied";

/// Generated tokens of the probe.
const PROBE_TOKENS: usize = 24;

/// The probe's prompt: 45 ids of the vocabulary (three KV blocks of 16, the last one partial).
fn probe_prompt() -> Vec<u32> {
    (0..45u32).map(|i| 100 + (i * 7919) % 20_000).collect()
}

/// Prompt `i` of the other requests: 5 to 124 ids.
fn other_prompt(i: u32) -> Vec<u32> {
    let len = 5 + (i * 37) % 120;
    (0..len)
        .map(|j| 300 + (i * 131 + j * 17) % 30_000)
        .collect()
}

fn probe_params() -> SamplingParams {
    SamplingParams {
        logprobs: Some(5),
        ..greedy(PROBE_TOKENS)
    }
}

/// CUDA when `ENGINE_TEST_DEVICE` names it, else CubeCL's CPU runtime.
fn device() -> DeviceKind {
    match test_device() {
        DeviceKind::Cuda(i) => DeviceKind::Cuda(i),
        _ => DeviceKind::CubeclCpu,
    }
}

/// How the steps run: eagerly, or through step graphs (captured on CUDA, emulated elsewhere).
#[derive(Clone, Copy, Debug)]
enum Steps {
    Eager,
    Graphs,
}

/// Where and how an engine runs: its device, its steps, and its tensor-parallel ranks.
#[derive(Clone, Copy, Debug)]
struct Run {
    device: DeviceKind,
    steps: Steps,
    tp: usize,
}

impl Run {
    /// Eager steps on one rank of `device`.
    fn eager(device: DeviceKind) -> Self {
        Self {
            device,
            steps: Steps::Eager,
            tp: 1,
        }
    }
}

/// An engine (f32; bf16 on CUDA) with room for 64 sequences and small steps (prefill chunks
/// of at most 64 tokens, mixed with decode rows); `blocks` KV blocks of 16.
fn engine(run: Run, batch_invariant: bool, blocks: usize) -> LLMEngine {
    let Run { device, steps, tp } = run;
    let dtype = match device {
        DeviceKind::Cuda(_) => burn::tensor::DType::BF16,
        _ => burn::tensor::DType::F32,
    };
    let config = EngineConfig {
        device,
        dtype: Some(dtype),
        max_num_seqs: Some(64),
        max_num_batched_tokens: 64,
        num_kv_blocks: Some(blocks),
        max_model_len: Some(256),
        batch_invariant,
        tensor_parallel_size: tp,
        enforce_eager: matches!(steps, Steps::Eager),
        // CUDA captures real graphs; the CPU runtime emulates them.
        emulate_graphs: matches!(steps, Steps::Graphs) && !matches!(device, DeviceKind::Cuda(_)),
        ..EngineConfig::default()
    };
    match random_model(device) {
        Some(model) => {
            let device = device.device().unwrap();
            LLMEngine::with_model(model, None, device, config).unwrap()
        }
        None => LLMEngine::new(fixture(MODEL), config).unwrap(),
    }
}

/// On CUDA with `ENGINE_TEST_MODEL_CONFIG`: one set of random bf16 weights of that config,
/// shared by every engine of the run (module doc).
fn random_model(device: DeviceKind) -> Option<Qwen2Model> {
    static MODEL: OnceLock<Option<Qwen2Model>> = OnceLock::new();
    if !matches!(device, DeviceKind::Cuda(_)) {
        return None;
    }
    MODEL
        .get_or_init(|| {
            let path = std::env::var("ENGINE_TEST_MODEL_CONFIG").ok()?;
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            let config = Qwen2Config::from_json(&text).unwrap();
            let device = device.device().unwrap();
            Some(Qwen2Model::dummy(
                config,
                burn::tensor::DType::BF16,
                &device,
            ))
        })
        .clone()
}

/// What must not change: each generated token with the bits of its log-probability and of
/// its top 5.
type Trace = Vec<(u32, u32, Vec<(u32, u32)>)>;

fn trace(done: &Finished) -> Trace {
    let logprobs: Vec<_> = done
        .outputs
        .iter()
        .flat_map(|o| o.new_logprobs.iter())
        .collect();
    assert_eq!(
        logprobs.len(),
        PROBE_TOKENS,
        "one entry per generated token"
    );
    logprobs
        .into_iter()
        .map(|l| {
            let top = l.top.iter().map(|&(t, p)| (t, p.to_bits())).collect();
            (l.token_id, l.logprob.to_bits(), top)
        })
        .collect()
}

/// The probe alone.
fn alone(run: Run, batch_invariant: bool) -> Trace {
    let mut e = engine(run, batch_invariant, 1024);
    let id = e.add_request(probe_prompt(), probe_params()).unwrap();
    trace(&drain(&mut e, &[id])[0])
}

/// The probe added 20th of 64 requests of mixed lengths (4 to 33 tokens each).
fn in_batch(run: Run, batch_invariant: bool) -> Trace {
    let mut e = engine(run, batch_invariant, 1024);
    let mut ids = Vec::new();
    let mut probe = None;
    for i in 0..63u32 {
        if i == 20 {
            probe = Some(e.add_request(probe_prompt(), probe_params()).unwrap());
        }
        let params = greedy(4 + (i as usize * 11) % 30);
        ids.push(e.add_request(other_prompt(i), params).unwrap());
    }
    let probe = probe.unwrap();
    ids.insert(20, probe);
    let done = drain(&mut e, &ids);
    let stats = e.stats();
    assert!(
        stats.steps < 64 * PROBE_TOKENS as u64,
        "the requests shared steps"
    );
    if matches!(run.steps, Steps::Graphs) {
        assert!(
            stats.graph_steps * 2 > stats.steps,
            "most steps replayed graphs ({} of {})",
            stats.graph_steps,
            stats.steps
        );
    }
    trace(&done[20])
}

/// The probe last of 12 long requests in a pool too small for all of them: it is preempted
/// and recomputed.
fn preempted(run: Run) -> Trace {
    let mut e = engine(run, true, 24);
    let mut ids: Vec<_> = (0..11u32)
        .map(|i| e.add_request(other_prompt(i * 3 + 1), greedy(40)).unwrap())
        .collect();
    ids.push(e.add_request(probe_prompt(), probe_params()).unwrap());
    let done = drain(&mut e, &ids);
    let probe = done.last().unwrap();
    let preemptions = probe
        .last()
        .metrics
        .as_ref()
        .map_or(0, |m| m.num_preemptions);
    assert!(
        preemptions > 0,
        "the probe was preempted (engine: {})",
        e.stats().preemptions
    );
    trace(probe)
}

/// The probe after a request that shares its first two blocks: the probe reads them from the
/// prefix cache.
fn after_prefix_hit(run: Run) -> Trace {
    let mut e = engine(run, true, 1024);
    let mut first = probe_prompt()[..32].to_vec();
    first.extend([11, 12, 13, 14, 15]);
    let id = e.add_request(first, greedy(3)).unwrap();
    drain(&mut e, &[id]);
    let id = e.add_request(probe_prompt(), probe_params()).unwrap();
    let done = drain(&mut e, &[id]);
    assert_eq!(
        done[0].last().num_cached_tokens,
        32,
        "two blocks from the cache"
    );
    trace(&done[0])
}

/// Every case against the probe alone in eager steps.
fn check(device: DeviceKind) {
    let eager = Run::eager(device);
    let reference = alone(eager, true);
    for steps in [Steps::Eager, Steps::Graphs] {
        let run = Run { steps, ..eager };
        let what = format!("{device:?}, {steps:?}");
        if matches!(steps, Steps::Graphs) {
            assert_eq!(alone(run, true), reference, "{what}: alone");
        }
        assert_eq!(in_batch(run, true), reference, "{what}: in a batch of 64");
        assert_eq!(preempted(run), reference, "{what}: preempted");
        assert_eq!(
            after_prefix_hit(run),
            reference,
            "{what}: after a prefix-cache hit"
        );
    }
}

#[test]
fn a_requests_logprobs_do_not_depend_on_its_batch() {
    let device = device();
    check(device);
    // The control: without the mode, the probe's decode rows take the skinny kernel alone
    // and the tiled one in the batch (CPU runtime), and its log-probabilities differ in their
    // last bits. (Were they equal, the comparisons above would prove nothing about the mode.)
    let eager = Run::eager(device);
    assert_ne!(
        in_batch(eager, false),
        alone(eager, false),
        "without batch invariance the batch changes the probe's last bits"
    );
}

/// Under tensor parallelism (2 ranks as threads on CubeCL's CPU runtime, the sum in rank
/// order) too: alone, in a batch of 64 and preempted, eager steps.
#[test]
fn under_tensor_parallelism_too_a_requests_logprobs_do_not_depend_on_its_batch() {
    let run = Run {
        tp: 2,
        ..Run::eager(DeviceKind::CubeclCpu)
    };
    let reference = alone(run, true);
    assert_eq!(in_batch(run, true), reference, "TP 2: in a batch of 64");
    assert_eq!(preempted(run), reference, "TP 2: preempted");
}

#[test]
fn burns_cpu_backend_refuses_batch_invariance_naming_the_option() {
    let config = EngineConfig {
        batch_invariant: true,
        ..EngineConfig::default()
    };
    let err = LLMEngine::new(fixture(MODEL), config)
        .err()
        .expect("refused");
    assert!(err.to_string().contains("batch_invariant"), "{err}");
}
