//! Sizing the KV pool: from the GPU's free memory after the weights and a profiling forward at
//! the largest step (vLLM's `gpu_memory_utilization`), or from a byte budget on CPUs.

use std::sync::Arc;

use burn::tensor::{DType, Device};
use cubecl_kernels::DeviceKind;
use model_qwen2::{KvCache, KvCacheDtype, Qwen2Config, Qwen2Model};

use crate::config::EngineConfig;
use crate::device_info::cuda_memory;
use crate::error::{EngineError, Result};
use crate::model_runner::ModelRunner;

/// The KV pool size when none is given: on CUDA, what fits in `gpu_memory_utilization` of the
/// device after the weights, the warm-up forwards (`working_set`, counted twice: the step
/// graphs pin pages the eager steps then cannot reuse) and the step graphs
/// ([`measure_graph_bytes`]), but never more than twice what `max_num_seqs` full-length
/// sequences need (the rest could only keep more cached prefixes; on an 80 GB GPU a
/// 7 M-parameter model would otherwise ask for 70 GB in 6 GB tensors, and that allocation
/// failed); on CPUs, `max_num_seqs` full-length sequences within `cpu_kv_cache_bytes`.
/// Returns the blocks and the step graphs' measured bytes (0 without a measurement).
pub(crate) fn size_kv_pool(
    model: &Arc<Qwen2Model>,
    device: &Device,
    config: &EngineConfig,
    max_model_len: usize,
    working_set: usize,
) -> Result<(usize, usize)> {
    let dtype = model.dtype();
    let c = &model.config;
    let bs = config.block_size;
    let most = config.max_num_seqs() * max_model_len.div_ceil(bs);
    let DeviceKind::Cuda(index) = config.device else {
        let fits = blocks_in(
            config.cpu_kv_cache_bytes,
            c,
            bs,
            dtype,
            config.kv_cache_dtype,
        );
        return Ok((most.min(fits).max(max_model_len.div_ceil(bs)), 0));
    };
    let read = || {
        cuda_memory(index)
            .ok_or_else(|| EngineError::Device("cannot read the GPU's free memory".into()))
    };
    let graphs = measure_graph_bytes(model, device, config, max_model_len, read)?;
    let (free, total) = read()?;
    let reserved = (total as f64 * (1.0 - config.gpu_memory_utilization as f64)) as usize;
    let budget = free
        .saturating_sub(reserved)
        .saturating_sub(graphs)
        .saturating_sub(working_set);
    let blocks = blocks_in(budget, c, bs, dtype, config.kv_cache_dtype).min(2 * most);
    if blocks * bs < max_model_len {
        return Err(EngineError::Device(format!(
            "only {blocks} KV blocks of {bs} tokens fit in gpu_memory_utilization = {} of the \
             GPU ({} MiB free of {} MiB, {} MiB of it for the step graphs): not one sequence \
             of max_model_len = {max_model_len}",
            config.gpu_memory_utilization,
            free >> 20,
            total >> 20,
            graphs >> 20,
        )));
    }
    Ok((blocks, graphs))
}

/// Device bytes the step graphs of `config` keep beyond the KV pool, measured: every graph
/// captured once against a KV cache of one sequence, the free memory read before and after
/// (less that cache), then all of it released (the pages stay in CubeCL's pools, where the
/// real captures find them). An estimate cannot do this: a graph keeps every page its recorded
/// run touched, and the dynamic pools' pages follow the largest allocation they served, so a
/// graph of one token keeps as much as one of 4,096. Counting each graph's activations had
/// reserved 25 GiB for Qwen2-0.5B's 14 graphs and 109 GiB for a 7B model. The probe's cache
/// is small and the weights and the real pool sit in persistent memory, outside those pools,
/// so the probe's graphs keep the pages the real ones will. Zero without graphs.
fn measure_graph_bytes(
    model: &Arc<Qwen2Model>,
    device: &Device,
    config: &EngineConfig,
    max_model_len: usize,
    free: impl Fn() -> Result<(usize, usize)>,
) -> Result<usize> {
    let sizes = config.graph_sizes();
    if sizes.is_empty() {
        return Ok(0);
    }
    let (dtype, bs) = (model.dtype(), config.block_size);
    let blocks = max_model_len.div_ceil(bs);
    let (before, _) = free()?;
    let kv_dtype = config.kv_cache_dtype;
    let cache = KvCache::with_dtype(&model.config, blocks, bs, dtype, kv_dtype, device)?;
    let probe = ModelRunner::new(
        model.clone(),
        cache,
        device.clone(),
        config.device,
        config.max_num_seqs(),
        max_model_len,
        &sizes,
        false,
    )?;
    let (after, _) = free()?;
    drop(probe);
    let cache_bytes = blocks * KvCache::bytes_per_block(&model.config, bs, dtype, kv_dtype);
    Ok(before.saturating_sub(after).saturating_sub(cache_bytes))
}

/// Blocks that fit in `budget` bytes for a model of `dtype` whose cache stores `kv_dtype`.
pub fn blocks_in(
    budget: usize,
    config: &Qwen2Config,
    block_size: usize,
    dtype: DType,
    kv_dtype: KvCacheDtype,
) -> usize {
    budget / KvCache::bytes_per_block(config, block_size, dtype, kv_dtype).max(1)
}
