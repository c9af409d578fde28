//! The benchmark binary: kernels, attention and the decode step at real Qwen shapes.
//!
//! `benches all --device cuda --out results.json` runs everything; see `--help`.

#[cfg(feature = "cuda")]
mod all_reduce;
mod attention;
mod decode_step;
mod engine_bench;
mod grammar;
mod host_profile;
mod invariance_probe;
mod isolation;
mod linear;
mod record;
mod report;
mod serve_bench;
mod step_profile;
mod timing;
mod workload;

use std::path::PathBuf;

use anyhow::{Context, Result};
use burn::tensor::DType;
use clap::{Parser, ValueEnum};
use cubecl_kernels::DeviceKind;
use model_qwen2::Qwen2Config;

#[derive(Parser)]
#[command(name = "benches", about = "burn-nanovllm benchmarks")]
struct Cli {
    /// What to run.
    #[arg(value_enum)]
    suite: Vec<Suite>,
    /// cuda, cuda:N, cubecl-cpu or cpu.
    #[arg(long, default_value = "cuda")]
    device: DeviceKind,
    /// Smaller shapes, for a smoke test on a CPU.
    #[arg(long)]
    quick: bool,
    /// Rows M of the linear and step suites (comma-separated), instead of their defaults
    /// (1,8,16,32,64,128,256,1024,4096 and 1,16,64,256).
    #[arg(long, value_delimiter = ',')]
    ms: Vec<usize>,
    /// Skip Burn's own ops (the baselines) in the linear and step suites.
    #[arg(long)]
    ours_only: bool,
    /// Linear suite: dtypes (comma-separated: bf16, f16, f32), instead of the device's default
    /// (bf16 on CUDA, f32 elsewhere); the step suite takes the first.
    #[arg(long, value_delimiter = ',')]
    dtypes: Vec<String>,
    /// Head shapes of the decode and prefill suites (comma-separated), instead of both.
    #[arg(long, value_delimiter = ',', default_values_t = ["qwen2-0.5b".to_string(), "qwen3-0.6b".to_string()])]
    models: Vec<String>,
    /// Write all tables as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Append one JSON record per result row to this JSON-lines file (git commit, device,
    /// dtype, engine options, command, the row), and the baseline CSV columns to its `.csv`.
    #[arg(long)]
    record: Option<PathBuf>,
    /// Model of the engine suites (random weights of its config): qwen2-0.5b, qwen2-1.5b,
    /// qwen2-7b, qwen2-32b, qwen2-72b (Qwen2.5-7B/32B/72B-Instruct's) or qwen3-0.6b.
    #[arg(long, default_value = "qwen2-0.5b")]
    dummy: String,
    /// Engine suites: a checkpoint folder or Hugging Face repo id (real weights) instead of
    /// `--dummy`.
    #[arg(long)]
    model: Option<String>,
    /// Branch, tag or commit of a `--model` repo id.
    #[arg(long)]
    revision: Option<String>,
    /// Engine suites: every step eagerly (no CUDA graphs).
    #[arg(long)]
    enforce_eager: bool,
    /// Engine suites: synchronous steps (no overlapped scheduling; the engine's default on
    /// CUDA overlaps).
    #[arg(long)]
    sync_steps: bool,
    /// Engine suites: prompt tokens that waiting prompts must fill before they are admitted
    /// into a busy batch (0: at once; default: the engine's).
    #[arg(long)]
    admission_tokens: Option<usize>,
    /// Engine suites: most consecutive steps waiting prompts are held back (default: the
    /// engine's).
    #[arg(long)]
    admission_wait_steps: Option<usize>,
    /// Engine suites (nano, throughput): CUDA events around every step's device work; the
    /// step profile then shows the device's busy and idle time per step (costs host time).
    #[arg(long)]
    gpu_timeline: bool,
    /// Engine suites: token counts of the step graphs (comma-separated), instead of the
    /// engine's default.
    #[arg(long, value_delimiter = ',')]
    graph_sizes: Vec<usize>,
    /// Engine suites: KV blocks in the pool (vLLM's `--num-gpu-blocks-override`) instead of
    /// what fits in memory.
    #[arg(long)]
    num_kv_blocks: Option<usize>,
    /// Engine suites (nano, throughput): a sampling profile of the host threads over the timed
    /// run (needs the `host-profile` feature and an unstripped binary).
    #[arg(long)]
    host_profile: bool,
    /// Engine suites over random weights: a folder whose tokenizer.json the engine uses
    /// (structured outputs need one), e.g. `fixtures/qwen2-tokenizer`.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// bench.py (`nano`): this fraction of the requests is constrained to a JSON schema of a
    /// few fields (structured outputs; needs a tokenizer: `--model` or `--tokenizer`).
    #[arg(long, default_value_t = 0.0)]
    json_fraction: f64,
    /// Engine suites: ranks the model is split over (tensor parallelism; also `-tp`): on CUDA
    /// one process per GPU, --device's GPU and the ones after it.
    #[arg(long, default_value_t = 1)]
    tensor_parallel_size: usize,
    /// Engine suites: under tensor parallelism, split the embedding and LM head by vocabulary
    /// rows.
    #[arg(long)]
    vocab_parallel: bool,
    /// Engine suites: batch-invariant inference (one reduction order per row).
    #[arg(long)]
    batch_invariant: bool,
    /// Engine suites: sequences of the nano workload.
    #[arg(long, default_value_t = 256)]
    num_seqs: usize,
    /// Engine suites: most sequences per step (default: the engine's for the device).
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// Engine suites: longest prompt + output (default: the checkpoint's own, as `serve`;
    /// the `nano` suite: bench.py's 4,096).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Engine suites: most tokens per step (default: the engine's).
    #[arg(long, default_value_t = burn_nanovllm::EngineConfig::default().max_num_batched_tokens)]
    max_num_batched_tokens: usize,
    /// Serve suite: the server's base URL (e.g. http://127.0.0.1:8000); without it, the engine
    /// runs in this process (`--dummy` / `--model`) behind the server's engine thread.
    #[arg(long)]
    url: Option<String>,
    /// Prefix suite: tokens of the prefix every request shares (its own `--input-len` tokens
    /// follow).
    #[arg(long, default_value_t = 512)]
    prefix_len: usize,
    /// Serve suite: request rates per second (comma-separated; `inf` = all at once).
    #[arg(long, value_delimiter = ',', default_values_t = [f64::INFINITY])]
    request_rate: Vec<f64>,
    /// Serve and throughput suites: requests (per rate).
    #[arg(long, default_value_t = 200)]
    num_prompts: usize,
    /// Serve, throughput and latency suites: prompt tokens per request.
    #[arg(long, default_value_t = 512)]
    input_len: usize,
    /// Serve, throughput and latency suites: output tokens per request.
    #[arg(long, default_value_t = 128)]
    output_len: usize,
    /// Throughput and serve suites: lengths vary uniformly by ± this fraction.
    #[arg(long, default_value_t = 0.0)]
    random_range_ratio: f64,
    /// Serve suite without `--url`: serve the in-process engine over HTTP on a loopback port
    /// (the OpenAI server of `burn-nanovllm serve`) rather than calling its engine thread.
    #[arg(long)]
    http: bool,
    /// Serve suite: most requests in flight (vLLM's `--max-concurrency`; default: no bound).
    #[arg(long)]
    max_concurrency: Option<usize>,
    /// Latency suite: batch sizes (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 64])]
    batch_size: Vec<usize>,
    /// Latency suite: timed iterations per batch size.
    #[arg(long, default_value_t = 5)]
    iters: usize,
    /// Latency suite: untimed iterations first.
    #[arg(long, default_value_t = 1)]
    warmup_iters: usize,
    /// Invariance suite: rounds of the probe beside a flood of `--num-prompts` requests.
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Serve, throughput and latency suites: seed of prompts (and arrivals).
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Suite {
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
    All,
}

fn config(name: &str) -> Result<Qwen2Config> {
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

fn parse_dtype(name: &str) -> Result<DType> {
    Ok(match name {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "f32" => DType::F32,
        _ => anyhow::bail!("unknown dtype {name} (expected bf16, f16 or f32)"),
    })
}

fn main() -> Result<()> {
    // A tensor-parallel worker process serves its rank and exits here.
    burn_nanovllm::serve_if_worker();
    // vLLM's `-tp`.
    let cli = Cli::parse_from(std::env::args().map(|a| match a.as_str() {
        "-tp" => "--tensor-parallel-size".to_string(),
        _ => a,
    }));
    let mut tables = Vec::new();
    if cli.suite.contains(&Suite::Grammar) {
        let dir = cli
            .tokenizer
            .as_deref()
            .context("the grammar suite needs --tokenizer DIR (a folder with tokenizer.json)")?;
        let rows = if cli.ms.is_empty() {
            &[1, 16, 64, 128, 256][..]
        } else {
            &cli.ms[..]
        };
        let vocab = config(&cli.dummy)?.vocab_size;
        tables.push(grammar::run(dir, vocab, rows, cli.output_len)?.json());
    }
    if cli.suite == [Suite::Grammar] {
        return write_tables(&cli, &tables);
    }
    if cli.suite.contains(&Suite::AllReduce) {
        let dtypes = match cli.dtypes.is_empty() {
            true => vec![DType::BF16],
            false => cli
                .dtypes
                .iter()
                .map(|d| parse_dtype(d))
                .collect::<Result<_>>()?,
        };
        #[cfg(feature = "cuda")]
        {
            all_reduce::serve_if_worker(&dtypes);
            tables.push(all_reduce::run(cli.tensor_parallel_size, &dtypes)?.json());
        }
        #[cfg(not(feature = "cuda"))]
        anyhow::bail!(
            "the all-reduce suite needs a CUDA build ({} dtypes)",
            dtypes.len()
        );
    }
    if cli.suite == [Suite::AllReduce] {
        return write_tables(&cli, &tables);
    }
    let device = cli.device.device()?;
    let dtype = if matches!(cli.device, DeviceKind::Cuda(_)) {
        DType::BF16
    } else {
        DType::F32
    };
    let want = |s: Suite| cli.suite.contains(&s) || cli.suite.contains(&Suite::All);
    let q = cli.quick;
    if want(Suite::Linear) {
        let default: &[usize] = if q {
            &[1, 3, 40]
        } else {
            &[1, 8, 16, 32, 64, 128, 256, 1024, 4096]
        };
        let ms = if cli.ms.is_empty() {
            default
        } else {
            &cli.ms[..]
        };
        let dtypes = if cli.dtypes.is_empty() {
            vec![dtype]
        } else {
            cli.dtypes
                .iter()
                .map(|d| parse_dtype(d))
                .collect::<Result<_>>()?
        };
        for dtype in dtypes {
            for model in ["qwen2-0.5b", "qwen2-1.5b", "qwen3-0.6b"] {
                let mut c = config(model)?;
                if q {
                    c.vocab_size = 1000;
                }
                tables.push(linear::run(model, &c, ms, !cli.ours_only, &device, dtype).json());
            }
        }
    }
    if want(Suite::Decode) {
        let (bs, ctx): (&[usize], &[usize]) = if q {
            (&[1, 4], &[128, 300])
        } else {
            (&[1, 16, 64, 256], &[128, 1024, 4096, 16384])
        };
        for model in &cli.models {
            tables.push(attention::decode(model, &config(model)?, bs, ctx, &device, dtype).json());
        }
    }
    if want(Suite::Prefill) {
        let shapes: &[(usize, usize)] = if q {
            &[(1, 64), (4, 32)]
        } else {
            &[(1, 4096), (16, 1024), (256, 512)]
        };
        for model in &cli.models {
            tables.push(attention::prefill(model, &config(model)?, shapes, &device, dtype).json());
        }
    }
    if want(Suite::Step) {
        let mut c = config("qwen2-0.5b")?;
        let default: &[usize] = if q { &[1, 4] } else { &[1, 16, 64, 256] };
        let ms = if cli.ms.is_empty() {
            default
        } else {
            &cli.ms[..]
        };
        if q {
            c.num_hidden_layers = 2;
            c.vocab_size = 1000;
        }
        let step_dtype = match cli.dtypes.first() {
            Some(d) => parse_dtype(d)?,
            None => dtype,
        };
        tables.push(
            decode_step::run("qwen2-0.5b", &c, ms, !cli.ours_only, &device, step_dtype).json(),
        );
    }
    let isolation = cli.suite.contains(&Suite::Isolation);
    let probe = cli.suite.contains(&Suite::Invariance);
    let in_process_serve =
        (cli.suite.contains(&Suite::Serve) || isolation || probe) && cli.url.is_none();
    let engine_suites = [
        Suite::Nano,
        Suite::Throughput,
        Suite::Latency,
        Suite::Prefix,
    ];
    let mut serve_target = cli
        .url
        .as_deref()
        .map(|u| serve_bench::Target::Url(u.trim_end_matches('/').to_string()));
    let mut serve_vocab = 10_000;
    if in_process_serve || engine_suites.iter().any(|s| cli.suite.contains(s)) {
        let dir = match &cli.model {
            Some(m) => Some(burn_nanovllm::hub::resolve_model(
                m,
                cli.revision.as_deref(),
            )?),
            None => None,
        };
        let mut c = match &dir {
            Some(d) => Qwen2Config::from_file(d.join("config.json"))?,
            None => config(&cli.dummy)?,
        };
        let mut num_seqs = cli.num_seqs;
        if q {
            c.num_hidden_layers = 2;
            c.vocab_size = 1000;
            num_seqs = num_seqs.min(4);
        }
        let mut setup = engine_bench::EngineSetup {
            model: cli.model.as_deref().unwrap_or(&cli.dummy),
            config: &c,
            dir: dir.as_deref(),
            engine: burn_nanovllm::EngineConfig {
                device: cli.device,
                dtype: Some(dtype),
                max_model_len: cli.max_model_len,
                max_num_seqs: cli.max_num_seqs,
                max_num_batched_tokens: cli.max_num_batched_tokens,
                enforce_eager: cli.enforce_eager,
                async_scheduling: cli.sync_steps.then_some(false),
                admission_min_tokens: cli.admission_tokens,
                admission_max_wait_steps: cli
                    .admission_wait_steps
                    .unwrap_or(burn_nanovllm::EngineConfig::default().admission_max_wait_steps),
                gpu_timeline: cli.gpu_timeline,
                tensor_parallel_size: cli.tensor_parallel_size,
                vocab_parallel: cli.vocab_parallel,
                batch_invariant: cli.batch_invariant,
                cuda_graph_sizes: (!cli.graph_sizes.is_empty()).then(|| cli.graph_sizes.clone()),
                num_kv_blocks: cli.num_kv_blocks,
                record_steps: true,
                ..burn_nanovllm::EngineConfig::default()
            },
            host_profile: cli.host_profile,
            tokenizer: cli.tokenizer.as_deref(),
            json_fraction: cli.json_fraction,
        };
        let workload = engine_bench::RandomWorkload {
            num_prompts: cli.num_prompts,
            input_len: cli.input_len,
            output_len: cli.output_len,
            range_ratio: cli.random_range_ratio,
            seed: cli.seed,
        };
        if cli.suite.contains(&Suite::Nano) {
            tables.push(engine_bench::nano(&setup, num_seqs, dtype)?.json());
        }
        if cli.suite.contains(&Suite::Throughput) {
            tables.push(engine_bench::throughput(&setup, &workload, dtype)?.json());
        }
        if cli.suite.contains(&Suite::Prefix) {
            let prefix = engine_bench::PrefixWorkload {
                num_prompts: cli.num_prompts,
                prefix_len: cli.prefix_len,
                suffix_len: cli.input_len,
                output_len: cli.output_len,
                seed: cli.seed,
            };
            tables.push(engine_bench::prefix(&setup, &prefix, dtype)?.json());
        }
        if in_process_serve {
            // Built on the engine thread, which replays its CUDA graphs (CubeCL's streams are
            // per thread), as the server does.
            let (model, config) = (setup.model.to_string(), setup.config.clone());
            let (dir, engine) = (setup.dir.map(|d| d.to_path_buf()), setup.engine.clone());
            // The probe's requests are text: the random-weight engine gets the tokenizer.
            let tokenizer = cli.tokenizer.clone().filter(|_| probe);
            let make = move || {
                let setup = engine_bench::EngineSetup {
                    model: &model,
                    config: &config,
                    dir: dir.as_deref(),
                    engine,
                    host_profile: false,
                    tokenizer: tokenizer.as_deref(),
                    json_fraction: 0.0,
                };
                engine_bench::build_engine(&setup)
                    .map_err(|e| burn_nanovllm::LlmError::Invalid(format!("{e:#}")))
            };
            serve_target = Some(if cli.http || isolation || probe {
                serve_bench::Target::Url(serve_bench::spawn_server(make)?)
            } else {
                let (metrics, _) = burn_nanovllm::server::Metrics::new();
                let handle = burn_nanovllm::server::EngineHandle::spawn(make, usize::MAX, metrics)?;
                serve_bench::Target::Engine(std::sync::Arc::new(handle))
            });
            serve_vocab = serve_vocab.min(c.vocab_size as u32);
        }
        if cli.suite.contains(&Suite::Latency) {
            // Repeated identical batches: no prefix cache, or every repeat would be a hit.
            setup.engine.enable_prefix_caching = false;
            let iters = (cli.warmup_iters, cli.iters);
            let report = engine_bench::latency(&setup, &cli.batch_size, &workload, iters, dtype)?;
            tables.push(report.json());
        }
    }
    if isolation {
        let Some(serve_bench::Target::Url(url)) = &serve_target else {
            anyhow::bail!("the isolation suite needs a server: --url, or an engine suite's model");
        };
        tables.push(isolation::run(url)?.json());
    }
    if probe {
        let Some(serve_bench::Target::Url(url)) = &serve_target else {
            anyhow::bail!("the invariance suite needs a server: --url, or an engine suite's model");
        };
        let probe = invariance_probe::Probe {
            url,
            flood: cli.num_prompts,
            rounds: cli.rounds,
            input_len: cli.input_len,
            output_len: cli.output_len,
            range_ratio: cli.random_range_ratio,
            vocab: serve_vocab,
            seed: cli.seed,
        };
        tables.push(invariance_probe::run(&probe)?.json());
    }
    if let Some(target) = serve_target.filter(|_| cli.suite.contains(&Suite::Serve)) {
        let workload = serve_bench::ServeWorkload {
            target,
            rates: &cli.request_rate,
            num_prompts: cli.num_prompts,
            vocab: serve_vocab,
            input_len: cli.input_len,
            output_len: cli.output_len,
            range_ratio: cli.random_range_ratio,
            max_concurrency: cli.max_concurrency,
            seed: cli.seed,
        };
        tables.push(serve_bench::run(&workload)?.json());
    }
    if let Some(path) = &cli.record {
        let engine = serde_json::json!({
            "model": cli.model.as_deref().unwrap_or(&cli.dummy),
            "max_num_seqs": cli.max_num_seqs,
            "max_num_batched_tokens": cli.max_num_batched_tokens,
            "enforce_eager": cli.enforce_eager,
            "sync_steps": cli.sync_steps,
            "admission_tokens": cli.admission_tokens,
            "admission_wait_steps": cli.admission_wait_steps,
            "num_kv_blocks": cli.num_kv_blocks,
            "max_model_len": cli.max_model_len,
        });
        let ctx = record::RunContext::new(&cli.device, &format!("{dtype:?}"), engine);
        record::append(path, &ctx, &tables)?;
    }
    write_tables(&cli, &tables)
}

/// Writes the tables as JSON to `--out`, if given.
fn write_tables(cli: &Cli, tables: &[serde_json::Value]) -> Result<()> {
    if let Some(out) = &cli.out {
        std::fs::write(out, serde_json::to_string_pretty(tables)?)
            .with_context(|| out.display().to_string())?;
    }
    Ok(())
}
