//! The engine's start-up: the tokenizer and generation defaults, the batch limits resolved
//! against the device, FP8 weights quantised, the warm-up forwards, an FP8 cache's scales
//! (`kv_calibration`), the KV pool sized around the step graphs' measured memory (`memory`),
//! the pool allocated, the graphs captured against it, and the scheduler shaped to them. `LLMEngine::with_model`
//! assembles what this returns.

use std::path::Path;
use std::sync::Arc;

use burn::tensor::{DType, Device};
use cubecl_kernels::DeviceKind;
use model_qwen2::{KvCache, KvCacheDtype, KvScales, Qwen2Config, Qwen2Model, Qwen2Tokenizer};

use crate::block_manager::BlockManager;
use crate::config::EngineConfig;
use crate::device_info;
use crate::error::{EngineError, Result};
use crate::generation_config::{generation_defaults, json_ids, read_generation_config};
use crate::memory;
use crate::model_runner::ModelRunner;
use crate::sampling_params::SamplingParams;
use crate::scheduler::{Scheduler, SchedulerLimits};
use crate::structured_output::StructuredOutputs;
use crate::warm_up::warm_up;

/// The engine's resolved limits.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineLimits {
    /// Most sequences running at once: `max_num_seqs`, or the device's default as far as the
    /// KV pool serves it ([`EngineConfig::max_num_seqs`]).
    pub max_num_seqs: usize,
    /// Longest prompt + output.
    pub max_model_len: usize,
    /// KV blocks in the pool.
    pub num_kv_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Compute dtype.
    pub dtype: DType,
    /// Token counts with a step graph (empty: eager).
    pub graph_sizes: Vec<usize>,
    /// Buckets whose capture the backend refused, with its reason.
    pub graph_failures: Vec<String>,
    /// Each captured graph's bucket, capture time and device memory.
    pub graph_captures: Vec<crate::GraphCapture>,
    /// Device bytes the step graphs took when they were captured to size the KV pool
    /// (0 when `num_kv_blocks` was given, or off CUDA).
    pub graph_memory: usize,
    /// How the KV cache stores keys and values.
    pub kv_cache_dtype: KvCacheDtype,
    /// An FP8 cache's scales: the checkpoint's, or measured at start-up (`None` without FP8).
    pub kv_scales: Option<KvScales>,
    /// How the layers' products store their weights.
    pub quantization: model_qwen2::Quantization,
}

/// What start-up built, for the engine to hold.
pub(crate) struct StartUp {
    /// The options, `max_num_seqs` resolved.
    pub config: EngineConfig,
    pub limits: EngineLimits,
    pub model_config: Qwen2Config,
    /// Sampling defaults from `generation_config.json`.
    pub generation_defaults: SamplingParams,
    pub tokenizer: Option<Arc<Qwen2Tokenizer>>,
    pub eos_token_ids: Vec<u32>,
    pub scheduler: Scheduler,
    pub runner: ModelRunner,
    pub structured: StructuredOutputs,
}

/// Starts an engine over `model` on `device` (`dir`: the checkpoint folder, for the tokenizer
/// and `generation_config.json`).
pub(crate) fn start(
    mut model: Qwen2Model,
    dir: Option<&Path>,
    device: Device,
    mut config: EngineConfig,
) -> Result<StartUp> {
    if config.batch_invariant {
        model.set_reduction_order(cubecl_kernels::ReductionOrder::BatchInvariant);
    }
    // The device's default batch limit is read once (the pool may lower it below), then the
    // options are checked with it.
    let default_seqs = config.max_num_seqs.is_none();
    config.max_num_seqs = Some(config.max_num_seqs());
    config.validate()?;
    model
        .quantize_weights(config.quantization)
        .map_err(|e| EngineError::config("quantization", e.to_string()))?;
    let tokenizer = match dir {
        Some(d) if d.join("tokenizer.json").exists() => {
            Some(Arc::new(Qwen2Tokenizer::from_dir(d)?))
        }
        _ => None,
    };
    let generation = match dir {
        Some(d) => read_generation_config(&d.join("generation_config.json"))?,
        None => serde_json::Value::Null,
    };
    let mut eos_token_ids = model.config.eos_token_ids.clone();
    for id in json_ids(&generation["eos_token_id"]) {
        if !eos_token_ids.contains(&id) {
            eos_token_ids.push(id);
        }
    }
    let model_config = model.config.clone();
    let limit = model_config.max_position_embeddings;
    let max_model_len = config.max_model_len.unwrap_or(limit);
    if max_model_len > limit || max_model_len < 2 {
        return Err(EngineError::config(
            "max_model_len",
            format!("{max_model_len} is outside 2..={limit} (the model's max_position_embeddings)"),
        ));
    }
    let dtype = model.dtype();
    let model = Arc::new(model);
    // The memory the warm-up's activations take (kept by the pools): the eager steps need
    // as much again once the decode graphs have pinned pages of their own.
    let mut working_set = 0;
    if let DeviceKind::Cuda(index) = config.device {
        let before = device_info::cuda_memory(index).map_or(0, |(free, _)| free);
        warm_up(&model, &device, &config, max_model_len)?;
        let after = device_info::cuda_memory(index).map_or(0, |(free, _)| free);
        working_set = before.saturating_sub(after);
    }
    let kv_scales = crate::kv_calibration::measure_kv_scales(
        &model,
        tokenizer.as_deref(),
        &config,
        max_model_len,
        &device,
    )?;
    let (num_kv_blocks, graph_memory) = match config.num_kv_blocks {
        Some(n) => (n, 0),
        None => memory::size_kv_pool(&model, &device, &config, max_model_len, working_set)?,
    };
    // Tensor-parallel ranks sized their pools apart: every rank takes the smallest, so that a
    // block id is valid on all of them.
    let num_kv_blocks = match model.parallel() {
        Some(p) => p.all_reduce.min(num_kv_blocks),
        None => num_kv_blocks,
    };
    // The warm-ups and the graphs' probe served the device's default, and the graphs are
    // captured for it as probed; the scheduler keeps to what the pool can hold.
    let (graph_sizes, graph_seqs) = (config.graph_sizes(), config.max_num_seqs());
    if default_seqs {
        config.max_num_seqs = Some(crate::config::seqs_the_pool_serves(
            config.max_num_seqs(),
            num_kv_blocks * config.block_size,
        ));
    }
    // The pool lives as long as the engine: in persistent memory, its layers do not size
    // the dynamic pools' pages, which every step graph keeps some of.
    let cache = cubecl_kernels::persistent(&device, (), |()| {
        KvCache::with_dtype(
            &model_config,
            num_kv_blocks,
            config.block_size,
            dtype,
            config.kv_cache_dtype,
            &device,
        )?
        .with_scales(kv_scales.as_ref())
    })?;
    let mut runner = ModelRunner::new(
        model,
        cache,
        device,
        config.device,
        graph_seqs,
        max_model_len,
        &graph_sizes,
        config.emulate_graphs,
    )?;
    runner.set_mark_steps(config.gpu_timeline && config.record_steps);
    let graph_sizes = runner.graph_sizes();
    let scheduler = Scheduler::new(
        SchedulerLimits {
            max_num_seqs: config.max_num_seqs(),
            max_num_batched_tokens: config.max_num_batched_tokens,
        },
        BlockManager::new(
            num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
        ),
    )
    .with_admission(config.admission())
    // Steps shaped to the graphs that were captured.
    .with_step_sizes(
        graph_sizes.clone(),
        if graph_sizes.is_empty() {
            usize::MAX
        } else {
            crate::graph_inputs::MAX_PREFILL_CHUNKS
        },
    );
    let limits = EngineLimits {
        max_num_seqs: config.max_num_seqs(),
        max_model_len,
        num_kv_blocks,
        block_size: config.block_size,
        dtype,
        graph_sizes,
        graph_failures: runner.graph_failures(),
        graph_captures: runner.graph_captures(),
        graph_memory,
        kv_cache_dtype: config.kv_cache_dtype,
        kv_scales,
        quantization: config.quantization,
    };
    let structured = StructuredOutputs::new(
        tokenizer.clone(),
        eos_token_ids.clone(),
        model_config.vocab_size,
    );
    Ok(StartUp {
        structured,
        generation_defaults: generation_defaults(&generation),
        config,
        limits,
        model_config,
        tokenizer,
        eos_token_ids,
        scheduler,
        runner,
    })
}
