//! A checkpoint's `generation_config.json`: the EOS ids and sampling defaults it recommends.

use std::path::Path;

use crate::error::Result;
use crate::sampling_params::SamplingParams;

/// `generation_config.json` as JSON (`Null` when absent).
pub(crate) fn read_generation_config(path: &Path) -> Result<serde_json::Value> {
    if !path.exists() {
        return Ok(serde_json::Value::Null);
    }
    let text = std::fs::read_to_string(path).map_err(|source| model_qwen2::ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| {
        model_qwen2::ModelError::Parse {
            path: path.to_path_buf(),
            message: e.to_string(),
        }
        .into()
    })
}

/// A token id or a list of them.
pub(crate) fn json_ids(value: &serde_json::Value) -> Vec<u32> {
    match value {
        serde_json::Value::Number(n) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        serde_json::Value::Array(a) => a
            .iter()
            .filter_map(|v| v.as_u64())
            .map(|v| v as u32)
            .collect(),
        _ => Vec::new(),
    }
}

/// Sampling defaults a checkpoint recommends (`do_sample: false` means greedy).
pub(crate) fn generation_defaults(json: &serde_json::Value) -> SamplingParams {
    let mut p = SamplingParams::default();
    let f = |k: &str| json[k].as_f64().map(|v| v as f32);
    if let Some(t) = f("temperature") {
        p.temperature = t;
    }
    if let Some(v) = f("top_p") {
        p.top_p = v;
    }
    if let Some(k) = json["top_k"].as_u64() {
        p.top_k = k as u32;
    }
    if let Some(v) = f("min_p") {
        p.min_p = v;
    }
    if let Some(v) = f("repetition_penalty") {
        p.repetition_penalty = v;
    }
    if json["do_sample"] == serde_json::Value::Bool(false) {
        p.temperature = 0.0;
    }
    p
}
