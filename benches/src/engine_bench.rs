//! Engine benchmarks: whole workloads through `LLM::generate` (the engine's step loop), over
//! random weights of a real config.

use std::time::Instant;

use anyhow::{Result, bail};
use burn::tensor::DType;
use burn_nanovllm::{
    EngineConfig, EngineStats, LLM, LLMEngine, Prompt, SamplingParams, StructuredOutput,
};
use model_qwen2::Qwen2Config;
use serde_json::json;

use crate::report::{Report, percentile};
use crate::step_profile::{print_graphs, print_step_profile};
use crate::workload::{WorkItem, nano_bench, random_requests, shared_prefix_requests};

/// nano-vLLM's bench.py builds its engine with `max_model_len=4096`: the `nano` suite does
/// too, unless `--max-model-len` says otherwise. Every other suite runs at the checkpoint's
/// own `max_model_len` (its `max_position_embeddings`), as `serve` and `LLM::new` do.
pub const NANO_MAX_MODEL_LEN: usize = 4096;

/// How the engine is set up for a run.
#[derive(Clone)]
pub struct EngineSetup<'a> {
    /// Model name (for the report).
    pub model: &'a str,
    /// Its config.
    pub config: &'a Qwen2Config,
    /// A checkpoint folder with real weights; `None`: random weights of `config`.
    pub dir: Option<&'a std::path::Path>,
    /// Engine options.
    pub engine: EngineConfig,
    /// Sample the host threads during the timed run (`--host-profile`).
    pub host_profile: bool,
    /// With random weights: a folder holding the tokenizer.json to use (`--tokenizer`).
    pub tokenizer: Option<&'a std::path::Path>,
    /// bench.py: the fraction of requests constrained to [`bench_schema`] (`--json-fraction`).
    pub json_fraction: f64,
}

/// The JSON schema of bench.py's constrained requests: a record of a few fields. Its strings
/// are unbounded, so that random weights write to `max_tokens` as the unconstrained requests do
/// (same output tokens, the masks' cost alone differs).
pub fn bench_schema() -> serde_json::Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "email": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "active": {"type": "boolean"},
        },
        "required": ["name", "email", "tags", "active"],
        "additionalProperties": false,
    })
}

fn build(setup: &EngineSetup<'_>) -> Result<LLM> {
    let mut llm = LLM::from_engine(build_engine(setup)?);
    llm.set_progress(false);
    Ok(llm)
}

/// The engine of `setup` (its device and dtype in `setup.engine`): its checkpoint, or random
/// weights of its config.
pub fn build_engine(setup: &EngineSetup<'_>) -> Result<LLMEngine> {
    Ok(match setup.dir {
        Some(dir) => LLMEngine::new(dir, setup.engine.clone())?,
        None => LLMEngine::with_random_weights(
            setup.config.clone(),
            setup.tokenizer,
            setup.engine.clone(),
        )?,
    })
}

/// nano-vLLM's `bench.py`: 256 random prompts of 100–1024 tokens, 100–1024 output tokens each,
/// temperature 0.6, `ignore_eos`; after a short warm-up generation, one timed `generate`.
pub fn nano(setup: &EngineSetup<'_>, num_seqs: usize, dtype: DType) -> Result<Report> {
    // bench.py's own `max_model_len`, unless one was given.
    let mut setup = setup.clone();
    let bench_py_len = NANO_MAX_MODEL_LEN.min(setup.config.max_position_embeddings);
    setup.engine.max_model_len = setup.engine.max_model_len.or(Some(bench_py_len));
    let setup = &setup;
    let start = Instant::now();
    let mut llm = build(setup)?;
    let load_s = start.elapsed().as_secs_f64();
    let limits = llm.engine().limits().clone();
    print_graphs(&limits);
    let mut work = nano_bench(num_seqs, 1024, 1024);
    // Smoke runs use a smaller vocabulary than bench.py's ids (< 10001).
    let vocab = setup.config.vocab_size as u32;
    for w in &mut work {
        w.prompt.iter_mut().for_each(|t| *t %= vocab);
    }
    let json = setup.json_fraction;
    let (wall, outs, before, stats) = warm_then_time(&mut llm, &work, json, setup.host_profile)?;
    print_step_profile(
        llm.engine().step_records(),
        &llm.engine().gpu_timeline()?,
        llm.engine().config().overlap(),
    );
    // Constrained requests end with their JSON (or at max_tokens); the others at max_tokens.
    let schema = jsonschema::validator_for(&bench_schema())?;
    let mut invalid = 0;
    for (i, o) in outs.iter().enumerate() {
        if is_constrained(i, json) && o.finish_reason == burn_nanovllm::FinishReason::Stop {
            let valid = o
                .text
                .as_deref()
                .and_then(|t| serde_json::from_str(t).ok())
                .is_some_and(|v| schema.is_valid(&v));
            invalid += usize::from(!valid);
        }
    }
    if invalid > 0 {
        bail!("{invalid} constrained outputs do not validate against their schema");
    }
    if let Some((o, w)) = outs
        .iter()
        .zip(&work)
        .enumerate()
        .find(|(i, (o, w))| !is_constrained(*i, json) && o.token_ids.len() != w.max_tokens)
        .map(|(_, p)| p)
    {
        bail!(
            "a request generated {} tokens instead of {} ({:?})",
            o.token_ids.len(),
            w.max_tokens,
            o.finish_reason
        );
    }
    let prompt_tokens: usize = work.iter().map(|w| w.prompt.len()).sum();
    let output_tokens: usize = outs.iter().map(|o| o.token_ids.len()).sum();
    let steps = stats.steps - before.steps;
    let mask_steps = (stats.mask_steps - before.mask_steps).max(1) as f64;
    let mask_ms = (stats.mask_time - before.mask_time).as_secs_f64() * 1e3 / mask_steps;
    let masked_rows = (stats.masked_rows - before.masked_rows) as f64 / mask_steps;
    let ms_per_step = |d: std::time::Duration| d.as_secs_f64() * 1e3 / steps.max(1) as f64;
    let graph_steps = (stats.graph_steps - before.graph_steps).max(1);
    let per_graph = |d: std::time::Duration| d.as_secs_f64() * 1e3 / graph_steps as f64;
    let mut report = Report::new(
        &format!("engine nano-vLLM bench.py {} {dtype:?}", setup.model),
        &[
            "model",
            "graphs",
            "num_seqs",
            "prompt_tokens",
            "output_tokens",
            "wall_s",
            "output_tok_s",
            "total_tok_s",
            "req_s",
            "steps",
            "graph_steps",
            "preemptions",
            "prefill_steps",
            "prefill_s",
            "decode_s",
            "host_ms_per_step",
            "prepare_ms_per_step",
            "sample_ms_per_step",
            "graph_build_ms",
            "graph_write_ms",
            "graph_replay_ms",
            "graph_input_kb",
            "max_model_len",
            "kv_blocks",
            "load_s",
            "json_fraction",
            "mask_steps",
            "mask_ms_per_step",
            "masked_rows_per_step",
        ],
    );
    report.row(vec![
        json!(setup.model),
        json!(!limits.graph_sizes.is_empty()),
        json!(num_seqs),
        json!(prompt_tokens),
        json!(output_tokens),
        json!(wall),
        json!(output_tokens as f64 / wall),
        json!((prompt_tokens + output_tokens) as f64 / wall),
        json!(num_seqs as f64 / wall),
        json!(steps),
        json!(stats.graph_steps - before.graph_steps),
        json!(stats.preemptions - before.preemptions),
        json!(stats.prefill_steps - before.prefill_steps),
        json!((stats.prefill_time - before.prefill_time).as_secs_f64()),
        json!((stats.decode_time - before.decode_time).as_secs_f64()),
        json!(ms_per_step(stats.host_time - before.host_time)),
        json!(ms_per_step(stats.prepare_time - before.prepare_time)),
        json!(ms_per_step(stats.sample_time - before.sample_time)),
        json!(per_graph(
            stats.graph_timings.build - before.graph_timings.build
        )),
        json!(per_graph(
            stats.graph_timings.write - before.graph_timings.write
        )),
        json!(per_graph(
            stats.graph_timings.replay - before.graph_timings.replay
        )),
        json!(
            (stats.graph_timings.bytes_written - before.graph_timings.bytes_written) as f64
                / 1024.0
                / graph_steps as f64
        ),
        json!(limits.max_model_len),
        json!(limits.num_kv_blocks),
        json!(load_s),
        json!(json),
        json!(stats.mask_steps - before.mask_steps),
        json!(mask_ms),
        json!(masked_rows),
    ]);
    Ok(report)
}

/// True if request `i` of bench.py is constrained when `fraction` of them are (spread evenly).
fn is_constrained(i: usize, fraction: f64) -> bool {
    ((i + 1) as f64 * fraction).floor() > (i as f64 * fraction).floor()
}

/// The random workload of `throughput` and `latency`.
pub struct RandomWorkload {
    pub num_prompts: usize,
    pub input_len: usize,
    pub output_len: usize,
    pub range_ratio: f64,
    pub seed: u64,
}

/// vLLM's `bench throughput`: every request at t = 0 (random ids, `ignore_eos`, temperature
/// 0.6 like bench.py), one timed `generate` after a short warm-up.
pub fn throughput(setup: &EngineSetup<'_>, w: &RandomWorkload, dtype: DType) -> Result<Report> {
    let mut llm = build(setup)?;
    let vocab = llm.engine().model_config().vocab_size as u32;
    let work = random_requests(
        w.num_prompts,
        w.input_len,
        w.output_len,
        w.range_ratio,
        vocab,
        w.seed,
    );
    let (wall, outs, before, stats) = warm_then_time(&mut llm, &work, 0.0, setup.host_profile)?;
    print_graphs(llm.engine().limits());
    let records = llm.engine().step_records();
    let timed = records.len() - (stats.steps - before.steps) as usize;
    let gpu = llm.engine().gpu_timeline()?;
    print_step_profile(
        &records[timed..],
        gpu.get(timed..).unwrap_or(&[]),
        llm.engine().config().overlap(),
    );
    let prompt_tokens: usize = work.iter().map(|w| w.prompt.len()).sum();
    let output_tokens: usize = outs.iter().map(|o| o.token_ids.len()).sum();
    let steps = (stats.steps - before.steps) as f64;
    let mut report = Report::new(
        &format!("engine throughput {} {dtype:?}", setup.model),
        &[
            "model",
            "num_prompts",
            "input_len",
            "output_len",
            "range_ratio",
            "prompt_tokens",
            "output_tokens",
            "wall_s",
            "req_s",
            "output_tok_s",
            "total_tok_s",
            "steps",
            "graph_steps",
            "ms_per_step",
            "preemptions",
            "max_model_len",
            "graph_input_kb",
        ],
    );
    let graph_steps = (stats.graph_steps - before.graph_steps).max(1) as f64;
    report.row(vec![
        json!(setup.model),
        json!(w.num_prompts),
        json!(w.input_len),
        json!(w.output_len),
        json!(w.range_ratio),
        json!(prompt_tokens),
        json!(output_tokens),
        json!(wall),
        json!(w.num_prompts as f64 / wall),
        json!(output_tokens as f64 / wall),
        json!((prompt_tokens + output_tokens) as f64 / wall),
        json!(stats.steps - before.steps),
        json!(stats.graph_steps - before.graph_steps),
        json!(wall * 1e3 / steps.max(1.0)),
        json!(stats.preemptions - before.preemptions),
        json!(llm.engine().limits().max_model_len),
        json!(
            (stats.graph_timings.bytes_written - before.graph_timings.bytes_written) as f64
                / 1024.0
                / graph_steps
        ),
    ]);
    Ok(report)
}

/// vLLM's `bench latency`: a batch of `batch` requests of `input_len` + `output_len` tokens,
/// `warmup` untimed then `iters` timed `generate`s; end-to-end latency percentiles per batch.
pub fn latency(
    setup: &EngineSetup<'_>,
    batches: &[usize],
    w: &RandomWorkload,
    (warmup, iters): (usize, usize),
    dtype: DType,
) -> Result<Report> {
    let mut llm = build(setup)?;
    let vocab = llm.engine().model_config().vocab_size as u32;
    let mut report = Report::new(
        &format!("engine latency {} {dtype:?}", setup.model),
        &[
            "model",
            "batch",
            "input_len",
            "output_len",
            "iters",
            "mean_ms",
            "p50_ms",
            "p90_ms",
            "p99_ms",
            "output_tok_s",
        ],
    );
    for &batch in batches {
        let work = random_requests(batch, w.input_len, w.output_len, 0.0, vocab, w.seed);
        let mut times = Vec::with_capacity(iters);
        for i in 0..warmup + iters {
            // Greedy: the timed iterations repeat the same work (prefix caching would skip the
            // prompts after the first: it is turned off by the caller's engine options).
            let (wall, _) = timed_generate(&mut llm, &work, 0.0, 0.0)?;
            if i >= warmup {
                times.push(wall);
            }
        }
        let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
        let ms = |q: f64| percentile(&mut times.clone(), q) * 1e3;
        report.row(vec![
            json!(setup.model),
            json!(batch),
            json!(w.input_len),
            json!(w.output_len),
            json!(iters),
            json!(mean * 1e3),
            json!(ms(0.5)),
            json!(ms(0.9)),
            json!(ms(0.99)),
            json!((batch * w.output_len) as f64 / mean),
        ]);
    }
    Ok(report)
}

/// The shared-prefix workload of `prefix`.
pub struct PrefixWorkload {
    pub num_prompts: usize,
    pub prefix_len: usize,
    pub suffix_len: usize,
    pub output_len: usize,
    pub seed: u64,
}

/// vLLM's prefix-caching benchmark: `num_prompts` requests sharing one prefix, each with its
/// own suffix, greedy with `ignore_eos`, all at t = 0 after one request has put the prefix in
/// the cache; once with prefix caching on, once off (a fresh engine each). Prefix-hit ratio
/// (hit / queried prompt tokens), TTFT percentiles, prompt tokens computed and throughput.
pub fn prefix(setup: &EngineSetup<'_>, w: &PrefixWorkload, dtype: DType) -> Result<Report> {
    let mut report = Report::new(
        &format!("engine prefix caching {} {dtype:?}", setup.model),
        &[
            "model",
            "prefix_caching",
            "num_prompts",
            "prefix_len",
            "suffix_len",
            "output_len",
            "wall_s",
            "output_tok_s",
            "prefix_hit_tokens",
            "prefix_queried_tokens",
            "hit_ratio",
            "prompt_tokens_computed",
            "ttft_p50_ms",
            "ttft_p90_ms",
            "ttft_p99_ms",
        ],
    );
    for caching in [true, false] {
        let run = EngineSetup {
            engine: EngineConfig {
                enable_prefix_caching: caching,
                ..setup.engine.clone()
            },
            ..*setup
        };
        let mut llm = build(&run)?;
        let vocab = llm.engine().model_config().vocab_size as u32;
        let (prefix, work) = shared_prefix_requests(
            w.num_prompts,
            w.prefix_len,
            w.suffix_len,
            w.output_len,
            vocab,
            w.seed,
        );
        // Puts the prefix in the cache (when caching) and warms the step sizes up.
        let mut first = prefix.clone();
        first.extend([1, 2, 3, 4]);
        llm.generate(&[Prompt::Tokens(first)], &SamplingParams::greedy(4))?;
        let before = llm.engine().stats();
        let (wall, outs) = timed_generate(&mut llm, &work, 0.0, 0.0)?;
        let after = llm.engine().stats();
        let mut ttft: Vec<f64> = outs
            .iter()
            .filter_map(|o| o.metrics.as_ref()?.time_to_first_token)
            .map(|d| d.as_secs_f64())
            .collect();
        if ttft.len() != outs.len() {
            bail!("a request reported no time to first token");
        }
        let output_tokens: usize = outs.iter().map(|o| o.token_ids.len()).sum();
        let hit = after.prefix_hit_tokens - before.prefix_hit_tokens;
        let queried = after.prefix_queried_tokens - before.prefix_queried_tokens;
        let ms = |v: &mut Vec<f64>, q: f64| percentile(v, q) * 1e3;
        report.row(vec![
            json!(setup.model),
            json!(caching),
            json!(w.num_prompts),
            json!(w.prefix_len),
            json!(w.suffix_len),
            json!(w.output_len),
            json!(wall),
            json!(output_tokens as f64 / wall),
            json!(hit),
            json!(queried),
            json!(hit as f64 / queried.max(1) as f64),
            json!(after.prefill_tokens - before.prefill_tokens),
            json!(ms(&mut ttft, 0.5)),
            json!(ms(&mut ttft, 0.9)),
            json!(ms(&mut ttft, 0.99)),
        ]);
    }
    Ok(report)
}

/// bench.py's protocol: one short warm-up generation, then one timed `generate` of `work` at
/// temperature 0.6 (`json_fraction` of it JSON-constrained); the wall time, the completions,
/// and the engine counters before and after.
fn warm_then_time(
    llm: &mut LLM,
    work: &[WorkItem],
    json_fraction: f64,
    host_profile: bool,
) -> Result<(
    f64,
    Vec<burn_nanovllm::Completion>,
    EngineStats,
    EngineStats,
)> {
    let warm = SamplingParams {
        structured_output: (json_fraction > 0.0)
            .then(|| StructuredOutput::JsonSchema(bench_schema())),
        ..SamplingParams::default()
    };
    llm.generate(&[Prompt::Tokens(vec![33, 44, 55, 66])], &warm)?;
    let before = llm.engine().stats();
    let (wall, outs) = crate::host_profile::profile(host_profile, || {
        timed_generate(llm, work, 0.6, json_fraction)
    })?;
    Ok((wall, outs, before, llm.engine().stats()))
}

/// One timed `generate` of a workload at `temperature` with `ignore_eos`; `json_fraction` of the
/// requests constrained to [`bench_schema`].
fn timed_generate(
    llm: &mut LLM,
    work: &[WorkItem],
    temperature: f32,
    json_fraction: f64,
) -> Result<(f64, Vec<burn_nanovllm::Completion>)> {
    let prompts: Vec<Prompt> = work
        .iter()
        .map(|w| Prompt::Tokens(w.prompt.clone()))
        .collect();
    let params: Vec<SamplingParams> = work
        .iter()
        .enumerate()
        .map(|(i, w)| SamplingParams {
            temperature,
            ignore_eos: true,
            max_tokens: w.max_tokens,
            structured_output: is_constrained(i, json_fraction)
                .then(|| StructuredOutput::JsonSchema(bench_schema())),
            ..SamplingParams::default()
        })
        .collect();
    let start = Instant::now();
    let outs = llm.generate(&prompts, &params)?;
    Ok((start.elapsed().as_secs_f64(), outs))
}
