//! The paged key/value storage of one attention layer.

use burn::tensor::{DType, Device, Tensor};

use crate::KernelError;

/// Paged key/value storage of one attention layer, allocated once and written in place.
///
/// `k`, `v`: `[num_blocks, block_size, num_kv_heads, head_dim]`. A token's slot is
/// `block * block_size + offset`; the `num_kv_heads * head_dim` values of one slot are contiguous,
/// so writing a token is one contiguous row and a block of keys is one contiguous
/// `block_size × num_kv_heads × head_dim` tile (the layout vLLM's flash backend and nano-vLLM use).
#[derive(Clone, Debug)]
pub struct LayerKvCache {
    /// Keys, `[num_blocks, block_size, num_kv_heads, head_dim]`.
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
        let shape = [num_blocks, block_size, num_kv_heads, head_dim];
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

    /// `[num_blocks, block_size, num_kv_heads, head_dim]`.
    pub fn dims(&self) -> [usize; 4] {
        self.k.dims()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.dims()[1]
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.dims()[0]
    }
}
