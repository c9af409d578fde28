//! The paged KV cache of a whole model.

use burn::tensor::{DType, Device};
use cubecl_kernels::{KvCacheDtype, LayerKvCache};

use crate::config::Qwen2Config;
use crate::error::{ModelError, Result};

/// One [`LayerKvCache`] per decoder layer, each
/// `[num_blocks, num_kv_heads, block_size, head_dim]`, allocated once.
#[derive(Clone, Debug)]
pub struct KvCache {
    /// Per-layer storage.
    pub layers: Vec<LayerKvCache>,
}

/// Per-layer FP8 scales of a [`KvCache`]: `keys[layer][kv_head]`, `values[layer][kv_head]`
/// (stored = round(x / scale)).
#[derive(Clone, Debug, PartialEq)]
pub struct KvScales {
    /// The keys' scale of each layer's kv heads.
    pub keys: Vec<Vec<f32>>,
    /// The values' scale of each layer's kv heads.
    pub values: Vec<Vec<f32>>,
}

impl KvCache {
    /// Allocates `num_blocks` blocks of `block_size` tokens for every layer of `config`, in the
    /// model's `dtype`.
    pub fn new(
        config: &Qwen2Config,
        num_blocks: usize,
        block_size: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::with_dtype(
            config,
            num_blocks,
            block_size,
            dtype,
            KvCacheDtype::Auto,
            device,
        )
    }

    /// [`Self::new`] stored as `kv_dtype` (FP8 caches start with scales of 1: set them with
    /// [`Self::set_scales`]). FP8 needs a CubeCL device.
    pub fn with_dtype(
        config: &Qwen2Config,
        num_blocks: usize,
        block_size: usize,
        dtype: DType,
        kv_dtype: KvCacheDtype,
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
                    kv_dtype,
                    device,
                )
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { layers })
    }

    /// Bytes one block takes across all layers (keys and values) for a model of `dtype`
    /// stored as `kv_dtype`.
    pub fn bytes_per_block(
        config: &Qwen2Config,
        block_size: usize,
        dtype: DType,
        kv_dtype: KvCacheDtype,
    ) -> usize {
        2 * config.num_hidden_layers * block_size * config.kv_size() * kv_dtype.element_bytes(dtype)
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.layers[0].block_size()
    }

    /// Blocks per layer.
    pub fn num_blocks(&self) -> usize {
        self.layers[0].num_blocks()
    }

    /// The storage format.
    pub fn kv_dtype(&self) -> KvCacheDtype {
        self.layers[0].kv_dtype()
    }

    /// The cache with `scales` set ([`Self::set_scales`]) when there are some.
    pub fn with_scales(mut self, scales: Option<&KvScales>) -> Result<Self> {
        if let Some(scales) = scales {
            self.set_scales(scales)?;
        }
        Ok(self)
    }

    /// Sets an FP8 cache's scales (one list per layer, one scale per kv head).
    pub fn set_scales(&mut self, scales: &KvScales) -> Result<()> {
        if scales.keys.len() != self.layers.len() || scales.values.len() != self.layers.len() {
            return Err(ModelError::Input(format!(
                "KV scales for {} and {} layers; the cache has {}",
                scales.keys.len(),
                scales.values.len(),
                self.layers.len()
            )));
        }
        for (layer, (k, v)) in self
            .layers
            .iter_mut()
            .zip(scales.keys.iter().zip(&scales.values))
        {
            layer.set_scales(k, v)?;
        }
        Ok(())
    }
}
