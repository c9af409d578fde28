//! The options shared by the commands (model, engine, sampling; vLLM's names) and what they
//! become: an `EngineConfig`, `SamplingParams`, a structured-output constraint.

use std::path::PathBuf;

use anyhow::{Context, Result};
use burn::tensor::DType;
use burn_nanovllm::hub::resolve_model;
use burn_nanovllm::{
    DeviceKind, EngineConfig, KvCacheDtype, Quantization, SamplingParams, StructuredOutput,
};
use clap::Args;

#[derive(Args)]
pub(crate) struct ModelArgs {
    /// Checkpoint folder (config.json, *.safetensors, tokenizer.json) or Hugging Face repo id
    /// (ORG/NAME, from the local Hugging Face cache, downloaded when online); by default the
    /// 7 M-parameter English model trained by scripts/tiny-model (served as `tiny-english`).
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// Branch, tag or commit of a repo id.
    #[arg(long)]
    pub(crate) revision: Option<String>,
    /// cpu (pure-Rust reference backend), cubecl-cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: DeviceKind,
    /// Compute dtype: f32, bf16 or f16 (default: f32 on CPUs, bf16 on CUDA).
    #[arg(long, value_parser = parse_dtype)]
    pub(crate) dtype: Option<DType>,
}

/// Engine options (vLLM's names).
#[derive(Args)]
pub(crate) struct EngineArgs {
    /// Most sequences running at once (default: vLLM's, 1,024 on GPUs of at least 70 GiB, else
    /// 256; a default of 1,024 shrinks to what the KV pool holds at 1,024 tokens a sequence).
    #[arg(long)]
    pub(crate) max_num_seqs: Option<usize>,
    /// Most tokens computed per step.
    #[arg(long, default_value_t = EngineConfig::default().max_num_batched_tokens)]
    pub(crate) max_num_batched_tokens: usize,
    /// Longest prompt + completion (default: the model's max_position_embeddings).
    #[arg(long)]
    pub(crate) max_model_len: Option<usize>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub(crate) block_size: usize,
    /// KV blocks in the pool (default: sized from free GPU memory, or 256 MiB on CPUs).
    #[arg(long)]
    pub(crate) num_kv_blocks: Option<usize>,
    /// Fraction of GPU memory the engine may use.
    #[arg(long, default_value_t = 0.9)]
    pub(crate) gpu_memory_utilization: f32,
    /// Run decode steps eagerly (no CUDA graphs).
    #[arg(long)]
    pub(crate) enforce_eager: bool,
    /// Synchronous steps: no overlapped scheduling (on by default on CUDA; for debugging).
    #[arg(long)]
    pub(crate) sync_steps: bool,
    /// Turn prefix caching off.
    #[arg(long)]
    pub(crate) no_prefix_caching: bool,
    /// Prompt tokens that waiting prompts must fill before they join a busy batch (0: at
    /// once; default: --max-num-batched-tokens).
    #[arg(long)]
    pub(crate) admission_tokens: Option<usize>,
    /// Ranks the model is split over (tensor parallelism; also `-tp`): on CUDA one process per
    /// GPU, --device's GPU and the ones after it; on CPU devices, threads.
    #[arg(long, default_value_t = 1)]
    pub(crate) tensor_parallel_size: usize,
    /// Under tensor parallelism, split the embedding and LM head by vocabulary rows (less
    /// memory per GPU; see docs/BENCHMARKS.md for its speed).
    #[arg(long)]
    pub(crate) vocab_parallel: bool,
    /// Batch-invariant inference: a request's tokens do not depend on what else runs with it
    /// (one reduction order per row, at some cost in speed).
    #[arg(long)]
    pub(crate) batch_invariant: bool,
    /// How the KV cache stores keys and values: auto (the model's dtype), fp8 (= fp8_e4m3) or
    /// fp8_e5m2 (half the bytes: twice the KV blocks; scales measured at start-up).
    #[arg(long, default_value = "auto")]
    pub(crate) kv_cache_dtype: KvCacheDtype,
    /// How the layers' weights are stored: none (the checkpoint's dtype) or fp8 (E4M3 with
    /// one scale per weight tensor, quantised at start-up: half the bytes; CUDA compute
    /// capability 8.9 or later).
    #[arg(long, default_value = "none")]
    pub(crate) quantization: Quantization,
}

/// Sampling options (vLLM's names); unset ones come from the model's generation_config.json.
#[derive(Args)]
pub(crate) struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub(crate) max_tokens: usize,
    /// Tokens to generate before end-of-sequence may stop.
    #[arg(long, default_value_t = 0)]
    pub(crate) min_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long)]
    pub(crate) temperature: Option<f32>,
    /// Nucleus sampling mass.
    #[arg(long)]
    pub(crate) top_p: Option<f32>,
    /// Keep the k most likely tokens (0 = all).
    #[arg(long)]
    pub(crate) top_k: Option<u32>,
    /// Drop tokens below min_p × the top probability.
    #[arg(long)]
    pub(crate) min_p: Option<f32>,
    /// Repetition penalty (1 = off).
    #[arg(long)]
    pub(crate) repetition_penalty: Option<f32>,
    /// Presence penalty.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) presence_penalty: f32,
    /// Frequency penalty.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) frequency_penalty: f32,
    /// Sampling seed (each request gets it).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Stop string (repeatable).
    #[arg(long)]
    pub(crate) stop: Vec<String>,
    /// Keep going past end-of-sequence tokens.
    #[arg(long)]
    pub(crate) ignore_eos: bool,
    /// Print the log-probability of each token and this many alternatives.
    #[arg(long)]
    pub(crate) logprobs: Option<usize>,
    /// Constrain the output to JSON valid under the JSON schema in this file.
    #[arg(long, value_name = "FILE", group = "structured")]
    pub(crate) json_schema: Option<PathBuf>,
    /// Constrain the output to any JSON object.
    #[arg(long, group = "structured")]
    pub(crate) json_object: bool,
    /// Constrain the output to this regular expression.
    #[arg(long, group = "structured")]
    pub(crate) regex: Option<String>,
    /// Constrain the output to one of these strings (repeatable).
    #[arg(long, group = "structured")]
    pub(crate) choice: Vec<String>,
    /// Constrain the output to the Lark grammar (llguidance's dialect) in this file.
    #[arg(long, value_name = "FILE", group = "structured")]
    pub(crate) grammar: Option<PathBuf>,
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    match s {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        _ => Err(format!("unknown dtype `{s}` (expected f32, bf16 or f16)")),
    }
}

impl ModelArgs {
    /// The checkpoint folder: `--model` resolved, or the default model's.
    pub(crate) fn dir(&self) -> Result<PathBuf> {
        match &self.model {
            Some(model) => Ok(resolve_model(model, self.revision.as_deref())?),
            None => Ok(burn_nanovllm::default_model_dir()),
        }
    }

    /// The name a server gives the model: the `--model` argument as given (vLLM's rule), or
    /// `tiny-english` for the default model.
    pub(crate) fn served_name(&self) -> String {
        self.model.clone().unwrap_or_else(|| "tiny-english".into())
    }
}

/// The engine configuration the model and engine options ask for.
pub(crate) fn engine_config(model: &ModelArgs, e: &EngineArgs) -> EngineConfig {
    EngineConfig {
        device: model.device,
        dtype: model.dtype,
        max_num_seqs: e.max_num_seqs,
        max_num_batched_tokens: e.max_num_batched_tokens,
        max_model_len: e.max_model_len,
        block_size: e.block_size,
        num_kv_blocks: e.num_kv_blocks,
        gpu_memory_utilization: e.gpu_memory_utilization,
        enforce_eager: e.enforce_eager,
        async_scheduling: e.sync_steps.then_some(false),
        admission_min_tokens: e.admission_tokens,
        enable_prefix_caching: !e.no_prefix_caching,
        tensor_parallel_size: e.tensor_parallel_size,
        vocab_parallel: e.vocab_parallel,
        batch_invariant: e.batch_invariant,
        kv_cache_dtype: e.kv_cache_dtype,
        quantization: e.quantization,
        ..EngineConfig::default()
    }
}

/// The structured-output constraint of `--json-schema`, `--json-object`, `--regex`, `--choice`
/// or `--grammar` (at most one of them: clap checks).
fn structured_output(s: &SamplingArgs) -> Result<Option<StructuredOutput>> {
    let read = |path: &PathBuf| {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
    };
    Ok(if let Some(path) = &s.json_schema {
        let schema = serde_json::from_str(&read(path)?)
            .with_context(|| format!("--json-schema {}: not JSON", path.display()))?;
        Some(StructuredOutput::JsonSchema(schema))
    } else if s.json_object {
        Some(StructuredOutput::JsonObject)
    } else if let Some(rx) = &s.regex {
        Some(StructuredOutput::Regex(rx.clone()))
    } else if !s.choice.is_empty() {
        Some(StructuredOutput::Choice(s.choice.clone()))
    } else if let Some(path) = &s.grammar {
        Some(StructuredOutput::Grammar(read(path)?))
    } else {
        None
    })
}

/// The sampling options over `defaults` (the model's generation_config.json).
pub(crate) fn sampling_params(
    defaults: SamplingParams,
    s: &SamplingArgs,
) -> Result<SamplingParams> {
    Ok(SamplingParams {
        temperature: s.temperature.unwrap_or(defaults.temperature),
        top_p: s.top_p.unwrap_or(defaults.top_p),
        top_k: s.top_k.unwrap_or(defaults.top_k),
        min_p: s.min_p.unwrap_or(defaults.min_p),
        repetition_penalty: s.repetition_penalty.unwrap_or(defaults.repetition_penalty),
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        seed: s.seed,
        max_tokens: s.max_tokens,
        min_tokens: s.min_tokens,
        stop: s.stop.clone(),
        ignore_eos: s.ignore_eos,
        logprobs: s.logprobs,
        structured_output: structured_output(s)?,
        ..defaults
    })
}
