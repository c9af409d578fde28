use std::path::{Path, PathBuf};

use engine::{DeviceKind, EngineConfig, LLMEngine, RequestId, RequestOutput, SamplingParams};
use safetensors::SafeTensors;

/// The four tiny checkpoints with goldens.
pub const CHECKPOINTS: [&str; 4] = [
    "qwen2-tiny-untied",
    "qwen2-tiny-tied",
    "qwen3-tiny",
    "qwen3-tiny-hd32",
];

/// The default model (trained by scripts/tiny-model, real weights), under `models/`.
pub const DEFAULT_MODEL: &str = "tiny-english";

/// A checkpoint folder: `models/{name}` when there is one, else `fixtures/{name}`.
pub fn fixture(name: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let model = root.join("models").join(name);
    if model.is_dir() {
        model
    } else {
        root.join("fixtures").join(name)
    }
}

/// `golden.safetensors` and `golden.json` of a checkpoint (transformers, f32, CPU).
pub struct Golden {
    bytes: Vec<u8>,
    pub json: serde_json::Value,
}

impl Golden {
    pub fn load(checkpoint: &str) -> Self {
        let dir = fixture(checkpoint);
        Self {
            bytes: std::fs::read(dir.join("golden.safetensors")).unwrap(),
            json: serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap(),
        }
    }

    /// Whether the goldens hold tensor `name`.
    pub fn has(&self, name: &str) -> bool {
        SafeTensors::deserialize(&self.bytes)
            .unwrap()
            .tensor(name)
            .is_ok()
    }

    fn tensor<T>(&self, name: &str, width: usize, f: impl Fn(&[u8]) -> T) -> Vec<T> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st
            .tensor(name)
            .unwrap_or_else(|_| panic!("golden tensor {name}"));
        t.data().chunks_exact(width).map(f).collect()
    }

    pub fn ids(&self, name: &str) -> Vec<u32> {
        self.tensor(name, 8, |b| {
            i64::from_le_bytes(b.try_into().unwrap()) as u32
        })
    }

    pub fn f32s(&self, name: &str) -> Vec<f32> {
        self.tensor(name, 4, |b| f32::from_le_bytes(b.try_into().unwrap()))
    }

    /// Top-5 ids and logits of each greedy step of `prompt.{i}` (stored, or from the full rows).
    pub fn greedy_top5(&self, key: &str) -> (Vec<u32>, Vec<f32>) {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        if st.tensor(&format!("{key}.greedy_top5_ids")).is_ok() {
            return (
                self.ids(&format!("{key}.greedy_top5_ids")),
                self.f32s(&format!("{key}.greedy_top5_logits")),
            );
        }
        let full = self.f32s(&format!("{key}.greedy_logits"));
        let v = full.len() / 24;
        let (mut ids, mut logits) = (Vec::new(), Vec::new());
        for row in full.chunks(v) {
            let mut order: Vec<usize> = (0..v).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
            ids.extend(order[..5].iter().map(|&i| i as u32));
            logits.extend(order[..5].iter().map(|&i| row[i]));
        }
        (ids, logits)
    }

    pub fn prompts(&self) -> Vec<Vec<u32>> {
        let n = self.json["prompts"].as_array().unwrap().len();
        (0..n)
            .map(|i| self.ids(&format!("prompt.{i}.input_ids")))
            .collect()
    }
}

/// The device of the generation tests: `ENGINE_TEST_DEVICE` (`cuda`, `cubecl-cpu`, …), by
/// default Burn's CPU backend. On CUDA the engine captures decode graphs.
pub fn test_device() -> DeviceKind {
    std::env::var("ENGINE_TEST_DEVICE")
        .map(|d| d.parse().expect("ENGINE_TEST_DEVICE"))
        .unwrap_or(DeviceKind::Cpu)
}

/// An f32 engine on `device` over a fixture, with small steps so that prefills are chunked and
/// mixed with decodes.
pub fn engine_on(name: &str, device: DeviceKind, config: EngineConfig) -> LLMEngine {
    LLMEngine::new(fixture(name), EngineConfig { device, ..config }).unwrap()
}

/// Small limits: 4 sequences, 24 tokens per step, 128 blocks.
pub fn small_config() -> EngineConfig {
    EngineConfig {
        dtype: Some(burn::tensor::DType::F32),
        max_num_seqs: Some(4),
        max_num_batched_tokens: 24,
        num_kv_blocks: Some(128),
        max_model_len: Some(256),
        ..EngineConfig::default()
    }
}

/// `config` with a pool too small for the six golden prompts growing by 24 tokens (10 blocks
/// of 16 for up to 21 needed, 6 sequences, `max_model_len` 160): it forces preemption.
pub fn tight_pool(config: EngineConfig) -> EngineConfig {
    EngineConfig {
        max_num_seqs: Some(6),
        num_kv_blocks: Some(10),
        max_model_len: Some(160),
        ..config
    }
}

/// A seeded draw after top-k 40, top-p 0.9 and min-p 0.01 at temperature 0.8, `n` tokens,
/// end-of-sequence ignored.
pub fn seeded(seed: u64, n: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.9,
        min_p: 0.01,
        seed: Some(seed),
        ignore_eos: true,
        max_tokens: n,
        ..SamplingParams::default()
    }
}

/// Greedy, `n` tokens, end-of-sequence ignored.
pub fn greedy(n: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(n)
    }
}

/// A finished request: every output of it, merged.
#[derive(Clone, Debug, Default)]
pub struct Finished {
    pub tokens: Vec<u32>,
    pub text: String,
    pub outputs: Vec<RequestOutput>,
}

impl Finished {
    pub fn last(&self) -> &RequestOutput {
        self.outputs.last().unwrap()
    }
}

/// Adds every request, steps until all finish (bounded), and returns their outputs in order.
pub fn run_all(engine: &mut LLMEngine, requests: Vec<(Vec<u32>, SamplingParams)>) -> Vec<Finished> {
    let ids: Vec<RequestId> = requests
        .into_iter()
        .map(|(p, s)| engine.add_request(p, s).unwrap())
        .collect();
    drain(engine, &ids)
}

/// Steps until every request of `ids` finished (at most 10 000 steps).
pub fn drain(engine: &mut LLMEngine, ids: &[RequestId]) -> Vec<Finished> {
    let mut done: std::collections::HashMap<RequestId, Finished> = Default::default();
    let mut steps = 0;
    let finished = |f: &Finished| f.last().finish_reason.is_some();
    while !ids.iter().all(|id| done.get(id).is_some_and(finished)) {
        steps += 1;
        assert!(steps < 10_000, "engine did not finish");
        for out in engine.step().unwrap() {
            let f = done.entry(out.id).or_default();
            f.tokens.extend(&out.new_token_ids);
            f.text.push_str(&out.new_text);
            f.outputs.push(out);
        }
    }
    ids.iter().map(|id| done.remove(id).unwrap()).collect()
}

/// Row-wise log-softmax of `[n, vocab]` logits.
pub fn log_softmax(logits: &[f32], vocab: usize) -> Vec<f32> {
    logits
        .chunks(vocab)
        .flat_map(|row| {
            let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let z = row.iter().map(|x| (x - m).exp()).sum::<f32>().ln() + m;
            row.iter().map(move |x| x - z)
        })
        .collect()
}

/// The index of a row's largest value.
pub fn argmax(row: &[f32]) -> usize {
    (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]))
        .unwrap()
}

/// The mean next-token negative log-likelihood of `prompts` under `e` and its top-1 pick at
/// every position (`LLMEngine::prompt_logits`).
pub fn prompt_scores(e: &engine::LLMEngine, prompts: &[Vec<u32>]) -> (f64, Vec<usize>) {
    let vocab = e.model_config().vocab_size;
    let (mut nll, mut picks, mut n) = (0f64, Vec::new(), 0usize);
    for ids in prompts {
        let lp = log_softmax(&e.prompt_logits(ids).unwrap(), vocab);
        for (pos, next) in ids.iter().enumerate().skip(1) {
            nll -= lp[(pos - 1) * vocab + *next as usize] as f64;
            n += 1;
        }
        picks.extend(lp.chunks(vocab).map(argmax));
    }
    (nll / n as f64, picks)
}
