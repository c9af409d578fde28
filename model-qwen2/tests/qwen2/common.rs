use std::path::{Path, PathBuf};

use burn::tensor::{DType, Device, Int, Tensor};
use model_qwen2::{AttentionMetadata, KvCache, LogitsRows, Qwen2Model};
use safetensors::SafeTensors;

/// The four tiny checkpoints with goldens.
pub const CHECKPOINTS: [&str; 4] = [
    "qwen2-tiny-untied",
    "qwen2-tiny-tied",
    "qwen3-tiny",
    "qwen3-tiny-hd32",
];

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(name)
}

pub fn device() -> Device {
    Device::flex()
}

/// `golden.safetensors` of a checkpoint.
pub struct Golden {
    bytes: Vec<u8>,
    pub json: serde_json::Value,
}

impl Golden {
    pub fn load(checkpoint: &str) -> Self {
        let dir = fixture(checkpoint);
        let bytes = std::fs::read(dir.join("golden.safetensors")).unwrap();
        let json = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
            .unwrap();
        Self { bytes, json }
    }

    pub fn has(&self, name: &str) -> bool {
        SafeTensors::deserialize(&self.bytes)
            .unwrap()
            .tensor(name)
            .is_ok()
    }

    pub fn f32s(&self, name: &str) -> Vec<f32> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st
            .tensor(name)
            .unwrap_or_else(|_| panic!("golden tensor {name}"));
        assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
        t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    pub fn ids(&self, name: &str) -> Vec<u32> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st
            .tensor(name)
            .unwrap_or_else(|_| panic!("golden tensor {name}"));
        assert_eq!(t.dtype(), safetensors::Dtype::I64, "{name}");
        t.data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
            .collect()
    }

    pub fn num_prompts(&self) -> usize {
        self.json["prompts"].as_array().unwrap().len()
    }
}

pub fn load_model(checkpoint: &str) -> Qwen2Model {
    Qwen2Model::from_pretrained(fixture(checkpoint), DType::F32, &device()).unwrap()
}

pub fn to_vec<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[track_caller]
pub fn assert_close(what: &str, actual: &[f32], expected: &[f32], tol: f32) {
    assert!(
        actual.iter().all(|v| v.is_finite()),
        "{what}: non-finite output"
    );
    let d = max_abs_diff(actual, expected);
    assert!(d <= tol, "{what}: max |Δ| = {d:e} > {tol:e}");
}

pub fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0 as u32
}

/// Hands out KV blocks in a scrambled order so that block tables are never contiguous.
pub struct Blocks {
    free: Vec<u32>,
}

impl Blocks {
    pub fn new(num_blocks: usize) -> Self {
        // A fixed permutation (multiplication by a unit mod a prime-ish count).
        let n = num_blocks as u64;
        let mut free: Vec<u32> = (0..n).map(|i| ((i * 7919 + 13) % n) as u32).collect();
        free.dedup();
        assert_eq!(free.len(), num_blocks);
        Self { free }
    }

    pub fn take(&mut self, n: usize) -> Vec<u32> {
        self.free.split_off(self.free.len() - n)
    }
}

pub const BLOCK_SIZE: usize = 16;

/// A sequence being generated: its tokens and its block table.
pub struct Seq {
    pub tokens: Vec<u32>,
    pub table: Vec<u32>,
    pub cached: usize,
}

/// Runs one step over `seqs`, each contributing all its not-yet-cached tokens, and returns the
/// logits `rows` as host rows.
pub fn step(
    model: &Qwen2Model,
    cache: &mut KvCache,
    seqs: &mut [Seq],
    rows: LogitsRows,
) -> Vec<Vec<f32>> {
    let device = model.embed_tokens.val().device();
    let ids: Vec<u32> = seqs
        .iter()
        .flat_map(|s| s.tokens[s.cached..].to_vec())
        .collect();
    let meta = AttentionMetadata::new(
        seqs.iter().map(|s| s.tokens.len() - s.cached).collect(),
        seqs.iter().map(|s| s.tokens.len()).collect(),
        seqs.iter().map(|s| s.table.clone()).collect(),
        BLOCK_SIZE,
        &device,
    )
    .unwrap();
    let input: Tensor<1, Int> = model.input_ids(&ids, &device).unwrap();
    let logits = model.forward(input, &meta, cache, rows);
    let v = model.config.vocab_size;
    for s in seqs.iter_mut() {
        s.cached = s.tokens.len();
    }
    to_vec(logits).chunks(v).map(<[f32]>::to_vec).collect()
}
