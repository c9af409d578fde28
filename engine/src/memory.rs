//! Sizing the KV pool: from the GPU's free memory after the weights and a profiling forward at
//! the largest step (vLLM's `gpu_memory_utilization`), or from a byte budget on CPUs.

use burn::tensor::DType;
use model_qwen2::{KvCache, Qwen2Config};

use crate::cuda_graph::Capacity;

/// `(free, total)` bytes of CUDA device `index`, from the driver (`cuMemGetInfo`).
#[cfg(feature = "cuda")]
pub fn cuda_memory(index: usize) -> Option<(usize, usize)> {
    use cudarc::driver::result;
    result::init().ok()?;
    let dev = result::device::get(index as i32).ok()?;
    // SAFETY: the primary context of an existing device, retained (never released: it lives as
    // long as the process, like CubeCL's own) and made current on this thread only to query.
    unsafe {
        let ctx = result::primary_ctx::retain(dev).ok()?;
        result::ctx::set_current(ctx).ok()?;
    }
    result::mem_get_info().ok()
}

/// Without the CUDA runtime there is nothing to ask.
#[cfg(not(feature = "cuda"))]
pub fn cuda_memory(_index: usize) -> Option<(usize, usize)> {
    None
}

/// The name of CUDA device `index` ("NVIDIA H100 80GB HBM3"), from the driver.
#[cfg(feature = "cuda")]
pub fn cuda_device_name(index: usize) -> Option<String> {
    use cudarc::driver::result;
    result::init().ok()?;
    result::device::get_name(result::device::get(index as i32).ok()?).ok()
}

/// Without the CUDA runtime there is nothing to ask.
#[cfg(not(feature = "cuda"))]
pub fn cuda_device_name(_index: usize) -> Option<String> {
    None
}

/// Bytes the step graphs of token counts `sizes` keep pinned beyond the KV pool: a graph
/// keeps the pages its recorded run touched, at most every activation of every layer for each
/// of its tokens and the (model-dtype) logits of its sample rows (`min(size, max_num_seqs)`),
/// twice for buckets with a decode-only graph; half as much again for the
/// pools' page granularity.
pub fn graph_bytes(
    config: &Qwen2Config,
    dtype_size: usize,
    sizes: &[usize],
    max_num_seqs: usize,
) -> usize {
    let per_layer = (config.q_size() + 2 * config.kv_size())
        + 3 * config.q_size()
        + 3 * config.hidden_size
        + 3 * config.intermediate_size;
    let per_token = config.num_hidden_layers * per_layer * dtype_size;
    let per_sample = config.vocab_size * dtype_size;
    let bytes: usize = sizes
        .iter()
        .map(|&t| {
            let graphs = if Capacity::has_decode_only(t, max_num_seqs) {
                2
            } else {
                1
            };
            graphs * (t * per_token + t.min(max_num_seqs) * per_sample)
        })
        .sum();
    bytes * 3 / 2
}

/// Blocks that fit in `budget` bytes.
pub fn blocks_in(budget: usize, config: &Qwen2Config, block_size: usize, dtype: DType) -> usize {
    budget / KvCache::bytes_per_block(config, block_size, dtype).max(1)
}
