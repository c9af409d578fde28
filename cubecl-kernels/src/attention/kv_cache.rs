//! The paged key/value storage of one attention layer.

use burn::tensor::{DType, Device, Tensor};
use cubecl::prelude::*;

use crate::KernelError;

/// Paged key/value storage of one attention layer, allocated once and written in place.
///
/// `k`, `v`: `[num_blocks, num_kv_heads, block_size, head_dim]`, head-major (FlashInfer's `HND`).
/// A token's slot is `block * block_size + offset`; one kv head's keys of a block are one
/// contiguous `block_size × head_dim` run, which is what a decode cube streams (one cube per kv
/// head). Against the token-major `[num_blocks, block_size, num_kv_heads, head_dim]` (vLLM's
/// flash layout), measured on the H100: our decode of Qwen2-0.5B's heads (2 × 64: 128-byte
/// rows) 4 % faster at 256 × 4k and 16k contexts, Qwen3-0.6B's (8 × 128) unchanged; a plain
/// Triton read of a decode step's cache 2–11 % faster at 78–256 sequences, 30 % at 32
/// (`scripts/baselines/kv_layout_read.py`, docs/BENCHMARKS.md). `cache_row` (private) is the
/// layout's one address formula.
#[derive(Clone, Debug)]
pub struct LayerKvCache {
    /// Keys, `[num_blocks, num_kv_heads, block_size, head_dim]`.
    pub k: Tensor<4>,
    /// Values, same shape as `k`.
    pub v: Tensor<4>,
}

impl LayerKvCache {
    /// Allocates a zeroed cache (zeroing also makes the allocation real on lazy allocators).
    pub fn zeros(
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, KernelError> {
        if !(1..=1024).contains(&block_size) {
            return Err(KernelError::invalid(format!(
                "KV cache: block_size {block_size} is outside 1..=1024"
            )));
        }
        let shape = [num_blocks, num_kv_heads, block_size, head_dim];
        // Made 1-D and viewed as 4-D: the kernels index the cache contiguously, and a 4-D CUDA
        // tensor is row-pitched when a head's row is not a power of two of bytes (head_dim 24,
        // 40, 48, 80, 96, …), which would make every write copy the whole layer.
        let zeros = || {
            Tensor::<1>::zeros([shape.iter().product::<usize>()], (device, dtype)).reshape(shape)
        };
        Ok(Self {
            k: zeros(),
            v: zeros(),
        })
    }

    /// `[num_blocks, num_kv_heads, block_size, head_dim]`.
    pub fn dims(&self) -> [usize; 4] {
        self.k.dims()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.dims()[2]
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.dims()[1]
    }

    /// Elements per head.
    pub fn head_dim(&self) -> usize {
        self.dims()[3]
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.dims()[0]
    }
}

/// The row of key `offset` of block `block`, kv head `kvh`, in a [`LayerKvCache`] of `kv_heads`
/// heads and `block_size`-token blocks, counted in rows of one head (`head_dim` elements, or
/// `head_dim / N` vectors of `N`): every kernel addresses the cache through it.
#[cube]
pub(crate) fn cache_row(
    block: usize,
    offset: usize,
    kvh: usize,
    #[comptime] kv_heads: usize,
    #[comptime] block_size: usize,
) -> usize {
    (block * kv_heads + kvh) * block_size + offset
}
