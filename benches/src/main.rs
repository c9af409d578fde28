//! The benchmark binary: kernels, attention and the decode step at real Qwen shapes.
//!
//! `benches all --device cuda --out results.json` runs everything; see `--help`.

#[cfg(feature = "cuda")]
mod all_reduce;
mod attention;
mod cli;
mod decode_step;
mod engine_bench;
mod grammar;
mod host_profile;
mod invariance_probe;
mod isolation;
mod kv_accuracy;
mod linear;
mod record;
mod report;
mod serve_bench;
mod step_profile;
mod timing;
mod workload;

use anyhow::{Context, Result};
use burn::tensor::DType;
use clap::Parser;
use cubecl_kernels::DeviceKind;
use model_qwen2::Qwen2Config;

use cli::{Cli, Suite, config, parse_dtype};

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
    if cli.suite.contains(&Suite::KvAccuracy) {
        let model = cli
            .model
            .as_deref()
            .context("kv-accuracy needs --model (real weights)")?;
        let dir = burn_nanovllm::hub::resolve_model(model, cli.revision.as_deref())?;
        let path = cli
            .text
            .as_deref()
            .context("kv-accuracy needs --text FILE")?;
        let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
        tables.push(kv_accuracy::run(&dir, cli.device, &text, cli.positions)?);
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
            let fp8 = cli.quantization == burn_nanovllm::Quantization::Fp8;
            for model in &cli.linear_models {
                let mut c = config(model)?;
                if q {
                    c.vocab_size = 1000;
                }
                let baselines = !cli.ours_only;
                tables.push(linear::run(model, &c, ms, baselines, fp8, &device, dtype).json());
            }
        }
    }
    if want(Suite::Decode) {
        let (mut bs, mut ctx): (&[usize], &[usize]) = if q {
            (&[1, 4], &[128, 300])
        } else {
            (&[1, 16, 64, 256], &[128, 1024, 4096, 16384])
        };
        if !cli.batches.is_empty() {
            bs = &cli.batches;
        }
        if !cli.contexts.is_empty() {
            ctx = &cli.contexts;
        }
        for model in &cli.models {
            let c = config(model)?;
            let kv = cli.kv_cache_dtype;
            tables.push(attention::decode(model, &c, bs, ctx, &device, dtype, kv).json());
        }
    }
    if want(Suite::Prefill) {
        // (sequences, new tokens, cached prefix).
        let shapes: &[(usize, usize, usize)] = if q {
            &[(1, 64, 0), (4, 32, 0), (1, 48, 40)]
        } else {
            &[(1, 4096, 0), (16, 1024, 0), (256, 512, 0), (1, 16384, 4096)]
        };
        for model in &cli.models {
            let c = config(model)?;
            let kv = cli.kv_cache_dtype;
            tables.push(attention::prefill(model, &c, shapes, &device, dtype, kv).json());
        }
    }
    if want(Suite::Step) {
        // One rank's share under `-tp`: its heads and intermediate columns (the step times
        // a rank's products and attention, without the sums over the ranks).
        let whole = config(&cli.dummy)?;
        let mut c =
            model_qwen2::TpRank::new(0, cli.tensor_parallel_size, &whole)?.local_config(&whole);
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
        let step_name = match cli.tensor_parallel_size {
            1 => cli.dummy.clone(),
            tp => format!("{} (rank share, TP {tp})", cli.dummy),
        };
        let step_dtype = match cli.dtypes.first() {
            Some(d) => parse_dtype(d)?,
            None => dtype,
        };
        tables
            .push(decode_step::run(&step_name, &c, ms, !cli.ours_only, &device, step_dtype).json());
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
                kv_cache_dtype: cli.kv_cache_dtype,
                quantization: cli.quantization,
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
