//! FP8 KV-cache scales measured on the model itself: a prefill of sample prompts into a cache
//! of the model's dtype, then the largest magnitude each layer's kv heads wrote.
//!
//! vLLM and SGLang default to a scale of 1.0 when a checkpoint has none, which is known to
//! break Qwen2 checkpoints: their q/k/v biases make keys large (hundreds), past E4M3's 448
//! after saturation. A scale per layer and kv head from the measured range keeps every head's
//! values inside the format with [`KV_SCALE_HEADROOM`] to spare for values the sample did not
//! reach.

use burn::tensor::{Device, FloatDType, Tensor};
use cubecl_kernels::{AttentionMetadata, KvCacheDtype};

use crate::error::{ModelError, Result};
use crate::kv_cache::{KvCache, KvScales};
use crate::model::{LogitsRows, Qwen2Model};

/// The largest magnitude a calibration saw maps to `max_finite / KV_SCALE_HEADROOM` of the
/// FP8 format (E4M3: 224), leaving twice the range for values beyond the sample.
pub const KV_SCALE_HEADROOM: f32 = 2.0;

impl Qwen2Model {
    /// Measures `kv_dtype`'s scales for this model: each of `prompts` (token ids, at least one
    /// non-empty) is prefilled into a cache of the model's dtype in blocks of `block_size`,
    /// then each layer's kv head gets `max |x| · KV_SCALE_HEADROOM / max_finite` for its keys
    /// and for its values. Tensor-parallel ranks call it together with the same prompts (the
    /// forward's collectives); each measures its own heads.
    pub fn calibrate_kv_scales(
        &self,
        prompts: &[Vec<u32>],
        block_size: usize,
        kv_dtype: KvCacheDtype,
        device: &Device,
    ) -> Result<KvScales> {
        let Some(max_finite) = kv_dtype.max_finite() else {
            return Err(ModelError::Input(
                "KV scales are measured for FP8 caches only".to_string(),
            ));
        };
        let prompts: Vec<&Vec<u32>> = prompts.iter().filter(|p| !p.is_empty()).collect();
        if prompts.is_empty() {
            return Err(ModelError::Input(
                "KV-scale calibration needs a non-empty prompt".to_string(),
            ));
        }
        let blocks: Vec<usize> = prompts
            .iter()
            .map(|p| p.len().div_ceil(block_size))
            .collect();
        let mut cache = KvCache::new(
            &self.config,
            blocks.iter().sum(),
            block_size,
            self.dtype(),
            device,
        )?;
        let mut next = 0u32;
        for (ids, &n) in prompts.iter().zip(&blocks) {
            let table: Vec<u32> = (next..next + n as u32).collect();
            next += n as u32;
            let meta = AttentionMetadata::new(
                vec![ids.len()],
                vec![ids.len()],
                vec![table],
                block_size,
                device,
            )?;
            // Only the keys and values written matter; one logits row is the least to ask for.
            let _ = self.forward(
                self.input_ids(ids, device)?,
                &meta,
                &mut cache,
                LogitsRows::LastPerSequence,
            );
        }
        let to_scale = |amax: f32| (amax * KV_SCALE_HEADROOM / max_finite).max(f32::MIN_POSITIVE);
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for layer in &cache.layers {
            keys.push(head_amax(&layer.k)?.into_iter().map(to_scale).collect());
            values.push(head_amax(&layer.v)?.into_iter().map(to_scale).collect());
        }
        Ok(KvScales { keys, values })
    }
}

/// The largest magnitude of each kv head of a cache `[num_blocks, kv_heads, block_size, D]`.
fn head_amax(cache: &Tensor<4>) -> Result<Vec<f32>> {
    let [nb, kvh, bs, d] = cache.dims();
    cache
        .clone()
        .abs()
        .swap_dims(0, 1)
        .reshape([kvh, nb * bs * d])
        .max_dim(1)
        .cast(FloatDType::F32)
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .map_err(|e| ModelError::Input(format!("reading the calibration cache: {e:?}")))
}
