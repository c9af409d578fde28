//! The engine's warm-up: a forward pass at every step size the scheduler builds, before the KV
//! pool is sized and before any request.

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use cubecl_kernels::AttentionMetadata;
use model_qwen2::{KvCache, LogitsRows, Qwen2Model};

use crate::config::EngineConfig;
use crate::error::{EngineError, Result};
use crate::sampler::{self, SamplerRow, TokenMasks};
use crate::sampling_params::SamplingParams;

/// Forward passes at every step size the scheduler builds, largest first: `max_num_batched_tokens`
/// prompt tokens with logits for `max_num_seqs` rows (its activations take their memory before
/// the KV pool is sized), then mixed steps (decode rows and a prefill chunk, as most steps are)
/// of about each power of two below it down to 16 tokens: the matrix products autotune per size
/// class and compile per vector width, and the fused kernels per op pattern, here rather than
/// in the first requests' steps.
pub(crate) fn warm_up(
    model: &Qwen2Model,
    device: &Device,
    config: &EngineConfig,
    max_model_len: usize,
) -> Result<()> {
    let max = config.max_num_batched_tokens;
    warm_up_step(model, device, config, max_model_len, max, 0)?;
    let mut t = max;
    // Token counts off powers of two by 0, 1, 2 and 4 in turn: the products' vector widths
    // follow the row count's alignment, and each width is a kernel of its own.
    for offset in [0, 1, 2, 4].into_iter().cycle() {
        if t < 16 {
            break;
        }
        let total = t - offset.min(t - 1);
        let decodes = config.max_num_seqs().min(total / 2);
        warm_up_step(model, device, config, max_model_len, total, decodes)?;
        t = t.next_power_of_two() / 2;
    }
    Ok(())
}

/// One forward of `total` tokens: `decodes` one-token rows over 17-token contexts, then prefill
/// sequences (of up to `max_model_len − 1` tokens) for the rest, with logits for up to
/// `max_num_seqs` rows and the sampler over them.
fn warm_up_step(
    model: &Qwen2Model,
    device: &Device,
    config: &EngineConfig,
    max_model_len: usize,
    total: usize,
    decodes: usize,
) -> Result<()> {
    let bs = config.block_size;
    let (mut queries, mut contexts) = (vec![1; decodes], vec![17.min(max_model_len - 1); decodes]);
    let per_seq = (max_model_len - 1).min(total);
    let mut left = total - decodes;
    while left > 0 {
        let l = per_seq.min(left);
        queries.push(l);
        contexts.push(l);
        left -= l;
    }
    let blocks: Vec<usize> = contexts.iter().map(|l| l.div_ceil(bs)).collect();
    // FP8 caches compile their kernels here too (scales of 1: the values do not matter).
    let mut cache = KvCache::with_dtype(
        &model.config,
        blocks.iter().sum(),
        bs,
        model.dtype(),
        config.kv_cache_dtype,
        device,
    )?;
    let mut next = 0u32;
    let tables = blocks
        .iter()
        .map(|&n| {
            let t: Vec<u32> = (next..next + n as u32).collect();
            next += n as u32;
            t
        })
        .collect();
    let meta = AttentionMetadata::new(queries, contexts, tables, bs, device)?;
    let ids = vec![0u32; total];
    let n = config.max_num_seqs().min(total);
    let rows: Vec<i32> = (0..n).map(|r| ((r * total) / n) as i32).collect();
    let rows = Tensor::<1, Int>::from_data(TensorData::new(rows, [n]), (device, DType::I32));
    let logits = model.forward(
        model.input_ids(&ids, device)?,
        &meta,
        &mut cache,
        LogitsRows::Rows(Box::new(rows)),
    );
    let params = SamplingParams::default();
    let rows: Vec<SamplerRow<'_>> = (0..n)
        .map(|_| SamplerRow {
            params: &params,
            seed: 0,
            prompt: &[],
            output: &[],
            banned: Vec::new(),
        })
        .collect();
    let mut draws =
        Tensor::<1, Int>::from_data(TensorData::new(vec![0i32; n], [n]), (device, DType::I32));
    sampler::sample(
        logits,
        &rows,
        TokenMasks::none(model.config.vocab_size),
        &vec![0; n],
        &mut draws,
    )?
    .0
    .wait()?;
    device
        .sync()
        .map_err(|e| EngineError::Device(format!("warm-up forward: {e:?}")))?;
    Ok(())
}
