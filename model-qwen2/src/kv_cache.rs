//! The paged KV cache of a whole model.

use burn::tensor::{DType, Device};
use cubecl_kernels::LayerKvCache;

use crate::config::Qwen2Config;
use crate::error::Result;

/// One [`LayerKvCache`] per decoder layer, each
/// `[num_blocks, num_kv_heads, block_size, head_dim]`, allocated once.
#[derive(Clone, Debug)]
pub struct KvCache {
    /// Per-layer storage.
    pub layers: Vec<LayerKvCache>,
}

impl KvCache {
    /// Allocates `num_blocks` blocks of `block_size` tokens for every layer of `config`.
    pub fn new(
        config: &Qwen2Config,
        num_blocks: usize,
        block_size: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let layers = (0..config.num_hidden_layers)
            .map(|_| {
                LayerKvCache::zeros(
                    num_blocks,
                    block_size,
                    config.num_key_value_heads,
                    config.head_dim,
                    dtype,
                    device,
                )
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { layers })
    }

    /// Bytes one block takes across all layers (keys and values).
    pub fn bytes_per_block(config: &Qwen2Config, block_size: usize, dtype: DType) -> usize {
        2 * config.num_hidden_layers * block_size * config.kv_size() * dtype.size()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.layers[0].block_size()
    }

    /// Blocks per layer.
    pub fn num_blocks(&self) -> usize {
        self.layers[0].num_blocks()
    }
}
