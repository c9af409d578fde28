//! FP8 KV-cache scales: the checkpoint's own (`k_scale`/`v_scale`) when it carries them, else
//! measured at start-up: the sample prompts (a short English text through
//! the checkpoint's tokenizer, and a fixed run of pseudo-random token ids, which reaches
//! embeddings a text does not) and the call to the model's calibration.

use burn::tensor::Device;
use model_qwen2::{KvScales, Qwen2Model, Qwen2Tokenizer};

use crate::config::EngineConfig;
use crate::error::Result;

/// English prose written for this purpose (no copyright), about 400 words.
const TEXT: &str = include_str!("kv_calibration.txt");

/// Tokens of the pseudo-random calibration prompt (fewer when `max_model_len` is shorter).
const RANDOM_TOKENS: usize = 512;

/// The sample prompts, each at most `max_len` tokens: the text when there is a tokenizer, and
/// [`RANDOM_TOKENS`] ids below `vocab` from a fixed linear congruential sequence.
pub(crate) fn calibration_prompts(
    tokenizer: Option<&Qwen2Tokenizer>,
    vocab: usize,
    max_len: usize,
) -> Result<Vec<Vec<u32>>> {
    let mut prompts = Vec::new();
    if let Some(t) = tokenizer {
        let mut ids = t.encode(TEXT)?;
        ids.truncate(max_len);
        prompts.push(ids);
    }
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let random = (0..RANDOM_TOKENS.min(max_len))
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 33) % vocab as u64) as u32
        })
        .collect();
    prompts.push(random);
    Ok(prompts)
}

/// The FP8 scales of `config.kv_cache_dtype` for `model` (`None` when the cache is not FP8):
/// the checkpoint's own when it carries them ([`Qwen2Model::checkpoint_kv_scales`]), else
/// measured. Tensor-parallel ranks run it together at the same point of start-up, with the same
/// prompts.
pub(crate) fn measure_kv_scales(
    model: &Qwen2Model,
    tokenizer: Option<&Qwen2Tokenizer>,
    config: &EngineConfig,
    max_model_len: usize,
    device: &Device,
) -> Result<Option<KvScales>> {
    if !config.kv_cache_dtype.is_fp8() {
        return Ok(None);
    }
    if let Some(scales) = &model.checkpoint_kv_scales {
        return Ok(Some(scales.clone()));
    }
    let prompts = calibration_prompts(
        tokenizer,
        model.config.vocab_size,
        max_model_len.min(config.max_num_batched_tokens),
    )?;
    let scales =
        model.calibrate_kv_scales(&prompts, config.block_size, config.kv_cache_dtype, device)?;
    Ok(Some(scales))
}
