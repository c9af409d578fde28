//! One record per benchmark row, appended to `--record PATH` (JSON lines) and `PATH.csv`: the
//! run's context (git commit, device, dtype, engine options, command line) with the row, and
//! the seed documents' baseline columns (model_name, batch_size, seq_len, latency_ms,
//! throughput_tokens_per_sec, peak_memory_mb).

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{Value, json};

/// What every record of a run shares.
pub struct RunContext {
    pub git_sha: String,
    pub device: String,
    /// The CUDA device of the run, whose memory in use is recorded.
    pub cuda_index: Option<usize>,
    pub dtype: String,
    pub engine: Value,
    pub command: String,
}

impl RunContext {
    /// The commit from `git rev-parse HEAD` (or `unknown` outside a checkout), the device name
    /// from the driver where there is one.
    pub fn new(device: &cubecl_kernels::DeviceKind, dtype: &str, engine: Value) -> Self {
        let git_sha = std::process::Command::new("git")
            .args(["rev-parse", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        let cuda_index = match device {
            cubecl_kernels::DeviceKind::Cuda(i) => Some(*i),
            _ => None,
        };
        let name = cuda_index.and_then(engine::device_info::cuda_device_name);
        Self {
            git_sha,
            device: name.unwrap_or_else(|| format!("{device:?}")),
            cuda_index,
            dtype: dtype.into(),
            engine,
            command: std::env::args().collect::<Vec<_>>().join(" "),
        }
    }
}

/// Device memory in use now on CUDA device `index` (MiB; the pools keep their peak), or null
/// off CUDA.
fn memory_in_use_mb(index: Option<usize>) -> Value {
    index
        .and_then(engine::device_info::cuda_memory)
        .map_or(Value::Null, |(free, total)| {
            json!((total - free) as f64 / 1048576.0)
        })
}

/// The baseline columns of a row, from whichever of its fields the suite has.
fn csv_row(table: &str, row: &Value, peak: &Value) -> String {
    let f = |k: &str| row.get(k).and_then(Value::as_f64);
    let batch = f("batch").or(f("num_prompts")).or(f("num_seqs"));
    let seq_len = match (f("input_len"), f("output_len")) {
        (Some(i), Some(o)) => Some(i + o),
        _ => f("prompt_tokens")
            .zip(f("output_tokens"))
            .zip(batch)
            .map(|((p, o), b)| (p + o) / b),
    };
    let latency = f("mean_ms")
        .or(f("wall_s").map(|s| s * 1e3))
        .or(f("duration_s").map(|s| s * 1e3));
    let cell = |v: Option<f64>| v.map_or(String::new(), |x| format!("{x}"));
    let model = row.get("model").and_then(Value::as_str).unwrap_or(table);
    format!(
        "{model},{},{},{},{},{}",
        cell(batch),
        cell(seq_len),
        cell(latency),
        cell(f("output_tok_s").or(f("output_tok_per_s"))),
        cell(peak.as_f64())
    )
}

/// Appends a record (and a CSV row) for every row of every table.
pub fn append(path: &Path, ctx: &RunContext, tables: &[Value]) -> Result<()> {
    let peak = memory_in_use_mb(ctx.cuda_index);
    let open = |p: &Path| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .with_context(|| p.display().to_string())
    };
    let csv_path = path.with_extension("csv");
    let new_csv = !csv_path.exists();
    let (mut jsonl, mut csv) = (open(path)?, open(&csv_path)?);
    if new_csv {
        writeln!(
            csv,
            "model_name,batch_size,seq_len,latency_ms,throughput_tokens_per_sec,peak_memory_mb"
        )?;
    }
    for table in tables {
        let name = table["name"].as_str().unwrap_or_default();
        for row in table["rows"].as_array().into_iter().flatten() {
            let record = json!({
                "git_sha": ctx.git_sha, "device": ctx.device, "dtype": ctx.dtype,
                "engine": ctx.engine, "command": ctx.command, "table": name, "row": row,
                "peak_memory_mb": peak,
            });
            writeln!(jsonl, "{record}")?;
            writeln!(csv, "{}", csv_row(name, row, &peak))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baseline_columns_come_from_each_suite_s_fields() {
        let latency = json!({"model": "m", "batch": 64, "input_len": 512, "output_len": 128,
                             "mean_ms": 884.3, "output_tok_s": 9263.0});
        assert_eq!(
            csv_row("t", &latency, &json!(1024.0)),
            "m,64,640,884.3,9263,1024"
        );
        let nano = json!({"model": "m", "num_seqs": 2, "prompt_tokens": 100, "output_tokens": 60,
                          "wall_s": 1.5, "output_tok_s": 40.0});
        assert_eq!(csv_row("t", &nano, &Value::Null), "m,2,80,1500,40,");
    }
}
