//! The benchmark binary's command line: its options (`Cli`), the suites, and the models'
//! configs it knows by name.

use std::path::PathBuf;

use anyhow::{Context, Result};
use burn::tensor::DType;
use clap::{Parser, ValueEnum};
use cubecl_kernels::DeviceKind;
use model_qwen2::Qwen2Config;

#[derive(Parser)]
#[command(name = "benches", about = "burn-nanovllm benchmarks")]
pub(crate) struct Cli {
    /// What to run.
    #[arg(value_enum)]
    pub(crate) suite: Vec<Suite>,
    /// cuda, cuda:N, cubecl-cpu or cpu.
    #[arg(long, default_value = "cuda")]
    pub(crate) device: DeviceKind,
    /// Smaller shapes, for a smoke test on a CPU.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Rows M of the linear and step suites (comma-separated), instead of their defaults
    /// (1,8,16,32,64,128,256,1024,4096 and 1,16,64,256).
    #[arg(long, value_delimiter = ',')]
    pub(crate) ms: Vec<usize>,
    /// Batch sizes of the decode suite (comma-separated), instead of 1,16,64,256: one shape
    /// alone for a profiler.
    #[arg(long, value_delimiter = ',')]
    pub(crate) batches: Vec<usize>,
    /// Context lengths of the decode suite (comma-separated), instead of 128,1024,4096,16384.
    #[arg(long, value_delimiter = ',')]
    pub(crate) contexts: Vec<usize>,
    /// Skip Burn's own ops (the baselines) in the linear and step suites.
    #[arg(long)]
    pub(crate) ours_only: bool,
    /// Linear suite: dtypes (comma-separated: bf16, f16, f32), instead of the device's default
    /// (bf16 on CUDA, f32 elsewhere); the step suite takes the first.
    #[arg(long, value_delimiter = ',')]
    pub(crate) dtypes: Vec<String>,
    /// Head shapes of the decode and prefill suites (comma-separated), instead of both.
    #[arg(long, value_delimiter = ',', default_values_t = ["qwen2-0.5b".to_string(), "qwen3-0.6b".to_string()])]
    pub(crate) models: Vec<String>,
    /// Models of the linear suite (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = ["qwen2-0.5b".to_string(), "qwen2-1.5b".to_string(), "qwen3-0.6b".to_string()])]
    pub(crate) linear_models: Vec<String>,
    /// Write all tables as JSON here.
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// Append one JSON record per result row to this JSON-lines file (git commit, device,
    /// dtype, engine options, command, the row), and the baseline CSV columns to its `.csv`.
    #[arg(long)]
    pub(crate) record: Option<PathBuf>,
    /// Model of the engine suites and the step suite (random weights of its config):
    /// qwen2-0.5b, qwen2-1.5b, qwen2-7b, qwen2-32b, qwen2-72b (Qwen2.5-7B/32B/72B-Instruct's)
    /// or qwen3-0.6b.
    #[arg(long, default_value = "qwen2-0.5b")]
    pub(crate) dummy: String,
    /// Engine suites: a checkpoint folder or Hugging Face repo id (real weights) instead of
    /// `--dummy`.
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// Branch, tag or commit of a `--model` repo id.
    #[arg(long)]
    pub(crate) revision: Option<String>,
    /// Engine suites: every step eagerly (no CUDA graphs).
    #[arg(long)]
    pub(crate) enforce_eager: bool,
    /// Engine suites: synchronous steps (no overlapped scheduling; the engine's default on
    /// CUDA overlaps).
    #[arg(long)]
    pub(crate) sync_steps: bool,
    /// Engine suites: prompt tokens that waiting prompts must fill before they are admitted
    /// into a busy batch (0: at once; default: the engine's).
    #[arg(long)]
    pub(crate) admission_tokens: Option<usize>,
    /// Engine suites: most consecutive steps waiting prompts are held back (default: the
    /// engine's).
    #[arg(long)]
    pub(crate) admission_wait_steps: Option<usize>,
    /// Engine suites (nano, throughput): CUDA events around every step's device work; the
    /// step profile then shows the device's busy and idle time per step (costs host time).
    #[arg(long)]
    pub(crate) gpu_timeline: bool,
    /// Engine suites: token counts of the step graphs (comma-separated), instead of the
    /// engine's default.
    #[arg(long, value_delimiter = ',')]
    pub(crate) graph_sizes: Vec<usize>,
    /// Engine suites: KV blocks in the pool (vLLM's `--num-gpu-blocks-override`) instead of
    /// what fits in memory.
    #[arg(long)]
    pub(crate) num_kv_blocks: Option<usize>,
    /// Engine suites (nano, throughput): a sampling profile of the host threads over the timed
    /// run (needs the `host-profile` feature and an unstripped binary).
    #[arg(long)]
    pub(crate) host_profile: bool,
    /// Engine suites over random weights: a folder whose tokenizer.json the engine uses
    /// (structured outputs need one), e.g. `fixtures/qwen2-tokenizer`.
    #[arg(long)]
    pub(crate) tokenizer: Option<PathBuf>,
    /// bench.py (`nano`): this fraction of the requests is constrained to a JSON schema of a
    /// few fields (structured outputs; needs a tokenizer: `--model` or `--tokenizer`).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) json_fraction: f64,
    /// Engine suites: ranks the model is split over (tensor parallelism; also `-tp`): on CUDA
    /// one process per GPU, --device's GPU and the ones after it. The step suite: one rank's
    /// share of the step (its heads and intermediate columns, without the sums).
    #[arg(long, default_value_t = 1)]
    pub(crate) tensor_parallel_size: usize,
    /// Engine suites: under tensor parallelism, split the embedding and LM head by vocabulary
    /// rows.
    #[arg(long)]
    pub(crate) vocab_parallel: bool,
    /// kv-accuracy: the text to score (a file the model did not train on).
    #[arg(long)]
    pub(crate) text: Option<PathBuf>,
    /// kv-accuracy: most positions to score.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) positions: usize,
    /// Engine suites: batch-invariant inference (one reduction order per row).
    #[arg(long)]
    pub(crate) batch_invariant: bool,
    /// Engine suites: how the KV cache stores keys and values (auto, fp8, fp8_e4m3,
    /// fp8_e5m2).
    #[arg(long, default_value = "auto")]
    pub(crate) kv_cache_dtype: burn_nanovllm::KvCacheDtype,
    /// Engine suites: how the layers' weights are stored (none, fp8); the linear suite adds
    /// the FP8 products' rows with fp8.
    #[arg(long, default_value = "none")]
    pub(crate) quantization: burn_nanovllm::Quantization,
    /// Engine suites: sequences of the nano workload.
    #[arg(long, default_value_t = 256)]
    pub(crate) num_seqs: usize,
    /// Engine suites: most sequences per step (default: the engine's for the device).
    #[arg(long)]
    pub(crate) max_num_seqs: Option<usize>,
    /// Engine suites: longest prompt + output (default: the checkpoint's own, as `serve`;
    /// the `nano` suite: bench.py's 4,096).
    #[arg(long)]
    pub(crate) max_model_len: Option<usize>,
    /// Engine suites: most tokens per step (default: the engine's).
    #[arg(long, default_value_t = burn_nanovllm::EngineConfig::default().max_num_batched_tokens)]
    pub(crate) max_num_batched_tokens: usize,
    /// Serve suite: the server's base URL (e.g. http://127.0.0.1:8000); without it, the engine
    /// runs in this process (`--dummy` / `--model`) behind the server's engine thread.
    #[arg(long)]
    pub(crate) url: Option<String>,
    /// Prefix suite: tokens of the prefix every request shares (its own `--input-len` tokens
    /// follow).
    #[arg(long, default_value_t = 512)]
    pub(crate) prefix_len: usize,
    /// Serve suite: request rates per second (comma-separated; `inf` = all at once).
    #[arg(long, value_delimiter = ',', default_values_t = [f64::INFINITY])]
    pub(crate) request_rate: Vec<f64>,
    /// Serve and throughput suites: requests (per rate).
    #[arg(long, default_value_t = 200)]
    pub(crate) num_prompts: usize,
    /// Serve, throughput and latency suites: prompt tokens per request.
    #[arg(long, default_value_t = 512)]
    pub(crate) input_len: usize,
    /// Serve, throughput and latency suites: output tokens per request.
    #[arg(long, default_value_t = 128)]
    pub(crate) output_len: usize,
    /// Throughput and serve suites: lengths vary uniformly by ± this fraction.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) random_range_ratio: f64,
    /// Serve suite without `--url`: serve the in-process engine over HTTP on a loopback port
    /// (the OpenAI server of `burn-nanovllm serve`) rather than calling its engine thread.
    #[arg(long)]
    pub(crate) http: bool,
    /// Serve suite: most requests in flight (vLLM's `--max-concurrency`; default: no bound).
    #[arg(long)]
    pub(crate) max_concurrency: Option<usize>,
    /// Latency suite: batch sizes (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 64])]
    pub(crate) batch_size: Vec<usize>,
    /// Latency suite: timed iterations per batch size.
    #[arg(long, default_value_t = 5)]
    pub(crate) iters: usize,
    /// Latency suite: untimed iterations first.
    #[arg(long, default_value_t = 1)]
    pub(crate) warmup_iters: usize,
    /// Invariance suite: rounds of the probe beside a flood of `--num-prompts` requests.
    #[arg(long, default_value_t = 20)]
    pub(crate) rounds: usize,
    /// Serve, throughput and latency suites: seed of prompts (and arrivals).
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Suite {
    Linear,
    Decode,
    Prefill,
    Step,
    /// nano-vLLM's bench.py workload through the engine.
    Nano,
    /// vLLM's `bench serve`: against a running server (`--url`) or in process.
    Serve,
    /// Shared-prefix requests with prefix caching on and off (hit ratio, TTFT).
    Prefix,
    /// vLLM's `bench throughput`: random requests all at t = 0, through the engine.
    Throughput,
    /// vLLM's `bench latency`: end-to-end time of one batch, through the engine.
    Latency,
    /// A plain request's latency alone and beside each kind of hostile request the server
    /// bounds (slow grammar compiles, 256 stop strings, 1 MB prompts, n = 64), over HTTP:
    /// against `--url` or the in-process server (needs a tokenizer: `--model` or `--tokenizer`).
    Isolation,
    /// One greedy request alone, then beside a flood of `--num-prompts` random requests
    /// (`--input-len`, `--output-len`, `--random-range-ratio`), `--rounds` times: how many rounds
    /// give the same text (run with and without `--batch-invariant`). Against `--url` or the
    /// in-process server (needs a tokenizer: `--model` or `--tokenizer`).
    Invariance,
    /// Structured outputs' host cost: masks and matcher advances per step for `--ms` rows
    /// (default 1,16,64,128,256) over `--output-len` steps; needs `--tokenizer` (no device).
    Grammar,
    /// Tensor parallelism's sum alone at `--tensor-parallel-size` ranks (one process per GPU):
    /// exactness and device time per call of messages up to 16 MB (`--dtypes`, default bf16),
    /// the IPC kernels where they apply (`BURN_NANOVLLM_ALL_REDUCE=nccl`: NCCL only). CUDA only.
    AllReduce,
    /// FP8 KV caches' accuracy on a real checkpoint (`--model`) against its own dtype:
    /// perplexity of `--text FILE` in 1,024-token windows (`--positions` predicted tokens at
    /// most), top-1 agreement at every position, greedy continuations.
    KvAccuracy,
    All,
}

/// The Hub config of a model the benchmarks know by name (`--dummy`).
pub(crate) fn config(name: &str) -> Result<Qwen2Config> {
    let text = match name {
        "qwen2-0.5b" => include_str!("../configs/qwen2-0.5b.json"),
        "qwen2-1.5b" => include_str!("../configs/qwen2-1.5b.json"),
        "qwen2-7b" => include_str!("../configs/qwen2-7b.json"),
        "qwen2-32b" => include_str!("../configs/qwen2-32b.json"),
        "qwen2-72b" => include_str!("../configs/qwen2-72b.json"),
        "qwen3-0.6b" => include_str!("../configs/qwen3-0.6b.json"),
        _ => anyhow::bail!("unknown model {name}"),
    };
    Qwen2Config::from_json(text).with_context(|| name.to_string())
}

/// `bf16`, `f16` or `f32`.
pub(crate) fn parse_dtype(name: &str) -> Result<DType> {
    Ok(match name {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "f32" => DType::F32,
        _ => anyhow::bail!("unknown dtype {name} (expected bf16, f16 or f32)"),
    })
}
