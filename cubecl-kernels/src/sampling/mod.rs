//! Sampling next tokens on the device: one kernel launch turns `logits [B, V]` into `[B]`
//! token ids, with per-row temperature (0 = greedy), min-p, top-k, top-p and a per-row seed.
//! Nothing of the logits leaves the device.
//!
//! The draw is the Gumbel-max trick over the kept tokens with noise from a counter-based hash
//! of (seed, counter, token id), so a row's token depends only on its logits, its seed and its
//! counter (the engine passes the position of the token being sampled): the same seed gives the
//! same tokens whatever else is in the batch, and a recomputed sequence redraws the same tokens.
//! The filters apply in vLLM's order, each on what the previous kept: min-p, top-k, then top-p
//! over the renormalised remainder; ties at a threshold are all kept.
//!
//! Under tensor parallelism with the vocabulary split over the ranks, [`sample_shard`] draws
//! each row's best over one shard and [`pick_exchanged_into`] the whole row's token from every
//! shard's (score, token) pair, summed over the group: the same token as [`sample`] over the
//! whole row (rows with filters need the whole row).
//!
//! Structured outputs mask their rows first ([`mask_logits`]: a bitmask of allowed tokens per
//! row, disallowed logits set to −∞ in place), so no filter or draw can pick a banned token.

pub(crate) mod combine;
pub(crate) mod kernel;
pub(crate) mod launch;
mod ops;
pub mod reference;

use burn::backend::Dispatch;
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData};

pub use self::ops::SamplingOps;
use crate::KernelError;

/// Temperatures below this are greedy (vLLM's `_SAMPLING_EPS`): dividing logits by a smaller
/// one overflows them to ±∞ and the draw is the argmax anyway.
pub const GREEDY_BELOW: f32 = 1e-5;

/// How one row is sampled.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingRow {
    /// Softmax temperature; below [`GREEDY_BELOW`] (0 included) greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = all).
    pub top_k: u32,
    /// Keep the smallest set of most likely tokens holding this much probability (1 = all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the most likely one's probability (0 = off).
    pub min_p: f32,
    /// The row's seed.
    pub seed: u64,
    /// Which draw of the seed this is (the position of the token being sampled).
    pub counter: u32,
}

impl SamplingRow {
    /// The temperature the kernel applies: 0 (greedy) below [`GREEDY_BELOW`].
    pub fn effective_temperature(&self) -> f32 {
        if self.temperature < GREEDY_BELOW {
            0.0
        } else {
            self.temperature
        }
    }

    /// A greedy row.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            counter: 0,
        }
    }

    /// Whether the row's draw needs its whole row of a `vocab_size`-token vocabulary at once:
    /// a filter (min-p, top-p, or a top-k below the vocabulary) on a sampled row. Other rows
    /// can be drawn shard by shard ([`sample_shard`]).
    pub fn needs_whole_row(&self, vocab_size: usize) -> bool {
        self.effective_temperature() > 0.0
            && (self.top_p < 1.0
                || self.min_p > 0.0
                || (self.top_k > 0 && (self.top_k as usize) < vocab_size))
    }

    fn check(&self) -> Result<(), KernelError> {
        let valid = self.temperature.is_finite()
            && self.top_p > 0.0
            && self.top_p <= 1.0
            && (0.0..=1.0).contains(&self.min_p);
        if !valid {
            return Err(KernelError::invalid(format!(
                "sample: invalid row {self:?} (temperature finite, top_p in (0, 1], min_p in [0, 1])"
            )));
        }
        Ok(())
    }
}

/// One token per row of `logits [B, V]` → `[B]` (i32), on the logits' device. The logits are
/// read in their dtype (f32, f16 or bf16: a model's logits need no f32 copy).
pub fn sample(logits: Tensor<2>, rows: &[SamplingRow]) -> Result<Tensor<1, Int>, KernelError> {
    sample_to(logits, rows, None)
}

/// [`sample`] into `out[..B]` (`out [n ≥ B]` i32): in place on CubeCL devices (the buffer
/// keeps its address, so a captured graph reading it sees the tokens); elsewhere `out` is
/// replaced by a tensor holding them there.
pub fn sample_into(
    logits: Tensor<2>,
    rows: &[SamplingRow],
    out: &mut Tensor<1, Int>,
) -> Result<(), KernelError> {
    let b = logits.dims()[0];
    if out.dtype() != DType::I32 || out.dims()[0] < b {
        return Err(KernelError::invalid(format!(
            "sample_into: {b} rows into a {:?} {:?} buffer",
            out.dims(),
            out.dtype()
        )));
    }
    *out = sample_to(logits, rows, Some(out.clone()))?;
    Ok(())
}

/// One tensor-parallel rank's share of a vocabulary split over `slots` ranks in token order:
/// its logits' columns are tokens `first..first + V_shard`, and its draws go in slot `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VocabShard {
    /// The id of the shard's first token.
    pub first: usize,
    /// This rank's slot in the exchange (its rank).
    pub slot: usize,
    /// Slots (ranks) in the group.
    pub slots: usize,
}

/// A vocabulary shard's part of [`sample`] under tensor parallelism: each row of
/// `logits [B, V_shard]` (f32, f16 or bf16; tokens `shard.first..`) draws its best (score,
/// global token) over the shard, with the noise of the whole row's draw (hashed by global id),
/// and writes it into slot `shard.slot` of a zeroed exchange `[B, 2·S]` f32 (scores, then
/// tokens as f32), which it returns. Summed over the group (an all-reduce), the exchange holds
/// every shard's pair, and [`pick_exchanged_into`] draws the whole row's token: `S` pairs per
/// row cross the link instead of `[B, V]` logits. `vocab_size` is the whole vocabulary; a row
/// that [needs its whole row](SamplingRow::needs_whole_row) is refused.
pub fn sample_shard(
    logits: Tensor<2>,
    rows: &[SamplingRow],
    shard: VocabShard,
    vocab_size: usize,
) -> Result<Tensor<2>, KernelError> {
    let [b, v] = logits.dims();
    let VocabShard { first, slot, slots } = shard;
    if rows.len() != b || v == 0 || slot >= slots || first + v > vocab_size || vocab_size >= 1 << 24
    {
        return Err(KernelError::invalid(format!(
            "sample_shard: {b} rows of {v} logits (tokens {first}.. of {vocab_size}, < 2^24), \
             {} rows of parameters, slot {slot} of {slots}",
            rows.len()
        )));
    }
    rows.iter().try_for_each(SamplingRow::check)?;
    if let Some(row) = rows.iter().find(|r| r.needs_whole_row(vocab_size)) {
        return Err(KernelError::invalid(format!(
            "sample_shard: row {row:?} filters its whole row: gather the logits"
        )));
    }
    let device = logits.device();
    if !crate::runs_kernels(&logits) {
        let host = logits
            .into_data()
            .try_into_vec_as::<f32>()
            .map_err(|e| KernelError::invalid(format!("sample_shard: {e:?}")))?;
        let mut exchange = vec![0.0f32; b * 2 * slots];
        for (r, row) in rows.iter().enumerate() {
            let (score, token) = reference::score_row(&host[r * v..(r + 1) * v], row, first as u32);
            exchange[r * 2 * slots + slot] = score;
            exchange[r * 2 * slots + slots + slot] = token as f32;
        }
        return Ok(Tensor::from_data(
            TensorData::new(exchange, [b, 2 * slots]),
            (&device, DType::F32),
        ));
    }
    let (params_f, params_u) = row_params(rows, &device);
    let shard = Tensor::<1, Int>::from_data(
        TensorData::new(vec![first as u32, slot as u32], [2]),
        (&device, DType::U32),
    );
    let exchange = Tensor::<2>::zeros([b, 2 * slots], (&device, DType::F32));
    Ok(Tensor::from_dispatch(Dispatch::sample_shard(
        logits_dtype(logits).into_dispatch(),
        params_f.into_dispatch(),
        params_u.into_dispatch(),
        shard.into_dispatch(),
        exchange.into_dispatch(),
    )))
}

/// Each row's token of a group-summed exchange `[B, 2·S]` f32 (see [`sample_shard`]: the best
/// score, the lowest token among equal ones, so the whole row's draw) into `out[..B]`
/// (`out [n ≥ B]` i32): in place on CubeCL devices, elsewhere `out` is replaced by a tensor
/// holding them there.
pub fn pick_exchanged_into(
    exchange: Tensor<2>,
    out: &mut Tensor<1, Int>,
) -> Result<(), KernelError> {
    let [b, w] = exchange.dims();
    if w < 2 || w % 2 != 0 || out.dtype() != DType::I32 || out.dims()[0] < b {
        return Err(KernelError::invalid(format!(
            "pick_exchanged_into: a [{b}, {w}] exchange (2·S columns) into a {:?} {:?} buffer",
            out.dims(),
            out.dtype()
        )));
    }
    if b == 0 {
        return Ok(());
    }
    if !crate::runs_kernels(&exchange) {
        let device = exchange.device();
        let host = exchange
            .into_data()
            .try_into_vec_as::<f32>()
            .map_err(|e| KernelError::invalid(format!("pick_exchanged_into: {e:?}")))?;
        let ids: Vec<i32> = reference::pick_exchanged(&host, w / 2)
            .into_iter()
            .map(|t| t as i32)
            .collect();
        let ids = Tensor::from_data(TensorData::new(ids, [b]), (&device, DType::I32));
        *out = out.clone().slice_assign(0..b, ids);
        return Ok(());
    }
    let exchange = exchange.cast(FloatDType::F32);
    *out = Tensor::from_dispatch(Dispatch::pick_exchanged_into(
        exchange.into_dispatch(),
        out.extract().into_dispatch(),
    ));
    Ok(())
}

/// The kernels' parameter rows: `params_f [B, 4]` f32 = (temperature, top_p, min_p, 0),
/// `params_u [B, 4]` u32 = (top_k, seed_lo, seed_hi, counter).
fn row_params(rows: &[SamplingRow], device: &burn::tensor::Device) -> (Tensor<2>, Tensor<2, Int>) {
    let b = rows.len();
    let mut pf = Vec::with_capacity(4 * b);
    let mut pu = Vec::with_capacity(4 * b);
    for r in rows {
        pf.extend([r.effective_temperature(), r.top_p, r.min_p, 0.0]);
        pu.extend([r.top_k, r.seed as u32, (r.seed >> 32) as u32, r.counter]);
    }
    (
        Tensor::<2>::from_data(TensorData::new(pf, [b, 4]), (device, DType::F32)),
        Tensor::<2, Int>::from_data(TensorData::new(pu, [b, 4]), (device, DType::U32)),
    )
}

/// u32 words of one token bitmask row over a `vocab_size`-token vocabulary: `⌈V/32⌉` (bit
/// `t mod 32` of word `t / 32` is token `t`), the row width [`mask_logits`] takes.
pub fn mask_words(vocab_size: usize) -> usize {
    vocab_size.div_ceil(32)
}

/// Structured outputs' token masks: row `rows[r]` of `logits [B, V]` keeps only the tokens
/// whose bit is set in row `r` of `allowed` (`[M, W]` u32, `M = rows.len()`, `W = ⌈V/32⌉`;
/// bit `t mod 32` of word `t / 32` is token `t`), every other one becomes −∞; rows not listed
/// are untouched. Returns the logits in their dtype (f32, f16 or bf16), masked in place on
/// CubeCL devices when the buffer is not shared. `allowed` is uploaded as it is: from a [`crate::UploadBuffer`], without a
/// host copy (at 256 rows of a 152k vocabulary it is 4.9 MB a step).
pub fn mask_logits(
    logits: Tensor<2>,
    allowed: TensorData,
    rows: &[u32],
) -> Result<Tensor<2>, KernelError> {
    let [b, v] = logits.dims();
    let (m, words) = (rows.len(), mask_words(v));
    if allowed.shape().as_slice() != [m, words] || allowed.dtype() != DType::U32 {
        return Err(KernelError::invalid(format!(
            "mask_logits: {m} rows of a {v}-token vocabulary need [{m}, {words}] u32 words, \
             got {:?} {:?}",
            allowed.shape().as_slice(),
            allowed.dtype()
        )));
    }
    if let Some(&r) = rows.iter().find(|&&r| r as usize >= b) {
        return Err(KernelError::invalid(format!(
            "mask_logits: row {r} of {b} rows of logits"
        )));
    }
    let logits = logits_dtype(logits);
    if m == 0 {
        return Ok(logits);
    }
    let device = logits.device();
    if !crate::runs_kernels(&logits) {
        let dtype = logits.dtype();
        let mut host = logits
            .into_data()
            .try_into_vec_as::<f32>()
            .map_err(|e| KernelError::invalid(format!("mask_logits: {e:?}")))?;
        let allowed = allowed
            .as_slice::<u32>()
            .map_err(|e| KernelError::invalid(format!("mask_logits: {e:?}")))?;
        reference::mask_logits(&mut host, v, allowed, rows);
        return Ok(Tensor::from_data(
            TensorData::new(host, [b, v]),
            (&device, dtype),
        ));
    }
    let allowed = Tensor::<2, Int>::from_data(allowed, (&device, DType::U32));
    let rows =
        Tensor::<1, Int>::from_data(TensorData::new(rows.to_vec(), [m]), (&device, DType::U32));
    Ok(Tensor::from_dispatch(Dispatch::mask_logits(
        logits.into_dispatch(),
        allowed.into_dispatch(),
        rows.into_dispatch(),
    )))
}

/// [`sample`], into `out[..B]` when given.
fn sample_to(
    logits: Tensor<2>,
    rows: &[SamplingRow],
    out: Option<Tensor<1, Int>>,
) -> Result<Tensor<1, Int>, KernelError> {
    let [b, v] = logits.dims();
    if rows.len() != b {
        return Err(KernelError::invalid(format!(
            "sample: {b} rows of logits, {} rows of parameters",
            rows.len()
        )));
    }
    if v == 0 && b > 0 {
        return Err(KernelError::invalid(
            "sample: logits of an empty vocabulary",
        ));
    }
    rows.iter().try_for_each(SamplingRow::check)?;
    let device = logits.device();
    if !crate::runs_kernels(&logits) {
        let host = logits
            .into_data()
            .try_into_vec_as::<f32>()
            .map_err(|e| KernelError::invalid(format!("sample: {e:?}")))?;
        let ids: Vec<i32> = reference::sample(&host, v, rows)
            .into_iter()
            .map(|t| t as i32)
            .collect();
        let ids = Tensor::from_data(TensorData::new(ids, [b]), (&device, DType::I32));
        return Ok(match out {
            Some(out) if b > 0 => out.slice_assign(0..b, ids),
            Some(out) => out,
            None => ids,
        });
    }
    let (params_f, params_u) = row_params(rows, &device);
    let (logits, params_f, params_u) = (
        logits_dtype(logits).into_dispatch(),
        params_f.into_dispatch(),
        params_u.into_dispatch(),
    );
    Ok(Tensor::from_dispatch(match out {
        Some(mut out) => {
            Dispatch::sample_into(logits, params_f, params_u, out.extract().into_dispatch())
        }
        None => Dispatch::sample(logits, params_f, params_u),
    }))
}

/// Logits as the kernels read them: f32, f16 and bf16 as they are (a model's logits need no f32
/// copy), any other float dtype cast to f32.
fn logits_dtype(logits: Tensor<2>) -> Tensor<2> {
    if launch::is_logits_dtype(logits.dtype()) {
        logits
    } else {
        logits.cast(FloatDType::F32)
    }
}
