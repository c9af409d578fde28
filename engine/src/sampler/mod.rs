//! Turning a step's logits into next tokens on the device: penalties, `logit_bias`, and the
//! bans of `min_tokens` and `bad_words` as one gather/scatter over the affected logits, then the sampling kernel
//! ([`cubecl_kernels::sample`]: greedy, or a seeded min-p/top-k/top-p draw per row), and
//! log-probabilities for the rows that ask. Only the sampled ids (and requested log-probs)
//! come back to the host; the `[rows, V]` logits never do. The ids land in the runner's
//! standing buffer of draws (the next step's forward reads them there) and come back
//! asynchronously ([`Draws`]): the engine enqueues the next step before it waits for them.

mod penalties;
mod plan;
mod rows;

use std::time::{Duration, Instant};

use burn::tensor::{FloatDType, Int, Tensor, TensorData, activation::log_softmax};

pub use self::penalties::{Penalties, apply_penalties, apply_penalties_host};
pub use self::plan::{LogitsShard, SamplePlan, TokenMasks};
pub use self::rows::SamplerRow;
use crate::error::{EngineError, Result};

/// Log-probabilities of one sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// The sampled token.
    pub token_id: u32,
    /// Its log-probability under the model's distribution (before temperature and filters).
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// One row's result.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The next token.
    pub token_id: u32,
    /// Its log-probabilities, when asked for.
    pub logprobs: Option<TokenLogprobs>,
}

/// A step's draws on their way to the host.
#[derive(Debug)]
pub enum Draws {
    /// The ids' copy is enqueued behind the sampling kernel: `n` rows.
    Copying(cubecl_kernels::PendingInts, usize),
    /// Read already (rows that asked for log-probabilities need them on the host).
    Ready(Vec<Sampled>),
}

impl Draws {
    /// Waits for the ids (and so for the step that drew them).
    pub fn wait(self) -> Result<Vec<Sampled>> {
        match self {
            Self::Ready(sampled) => Ok(sampled),
            Self::Copying(pending, n) => {
                let ids = pending
                    .wait()
                    .map_err(|e| EngineError::Device(format!("sampled ids: {e}")))?;
                Ok(ids[..n]
                    .iter()
                    .map(|&t| Sampled {
                        token_id: t as u32,
                        logprobs: None,
                    })
                    .collect())
            }
        }
    }
}

/// Samples one token per row of `logits [rows, V]` (f32, f16 or bf16: the model's, read as
/// they are) into `draws[..rows]` (the runner's
/// standing `[max_num_seqs]` i32 buffer, in place) and starts reading them back. Rows with a
/// mask in `masks` draw only their allowed tokens (the masks are uploaded as they are, not
/// copied). `counters[r]` is the position of the token being drawn (it keys the row's random
/// stream). With rows that ask for log-probabilities, the ids are read (and the
/// log-probabilities computed) now. Also returns the time spent flushing the work to the device
/// (which waits for it while an earlier copy of `draws` is pending).
pub fn sample(
    logits: Tensor<2>,
    rows: &[SamplerRow<'_>],
    masks: TokenMasks,
    counters: &[u32],
    draws: &mut Tensor<1, Int>,
) -> Result<(Draws, Duration)> {
    let vocab = logits.dims()[1];
    sample_planned(
        logits,
        rows,
        SamplePlan::new(rows, masks, counters, vocab),
        draws,
        None,
    )
}

/// [`sample`] with the device part already planned (`plan`, of `rows`), over `logits` or, under
/// tensor parallelism (`shard`), this rank's columns of them: rank 0 of a tensor-parallel group
/// sends the plan to the other ranks, then samples with it itself.
pub fn sample_planned(
    logits: Tensor<2>,
    rows: &[SamplerRow<'_>],
    plan: SamplePlan,
    draws: &mut Tensor<1, Int>,
    shard: Option<&LogitsShard>,
) -> Result<(Draws, Duration)> {
    let n = rows.len();
    if n == 0 {
        return Ok((Draws::Ready(Vec::new()), Duration::ZERO));
    }
    let wanted: Vec<usize> = (0..n)
        .filter(|&r| rows[r].params.logprobs.is_some())
        .collect();
    let per_row = plan.logprobs_per_row;
    let whole = plan.enqueue(logits, draws, shard, !wanted.is_empty())?;
    let flush = Instant::now();
    let pending = cubecl_kernels::read_ints_async(&draws.clone().slice(0..n))
        .map_err(|e| EngineError::Device(format!("sampled ids: {e}")))?;
    let flush = flush.elapsed();
    let raw = match whole {
        Some(raw) if !wanted.is_empty() => raw,
        _ => return Ok((Draws::Copying(pending, n), flush)),
    };
    let mut out = Draws::Copying(pending, n).wait()?;
    let ids: Vec<u32> = out.iter().map(|s| s.token_id).collect();
    let all = if per_row {
        let mut all = Vec::with_capacity(wanted.len());
        for &r in &wanted {
            all.extend(logprobs(raw.clone(), &[r], rows, &ids)?);
        }
        all
    } else {
        logprobs(raw, &wanted, rows, &ids)?
    };
    for (r, lp) in wanted.into_iter().zip(all) {
        out[r].logprobs = Some(lp);
    }
    Ok((Draws::Ready(out), flush))
}

/// Log-softmax of the `wanted` rows of the raw logits: the sampled token's value and the top-n.
fn logprobs(
    raw: Tensor<2>,
    wanted: &[usize],
    rows: &[SamplerRow<'_>],
    ids: &[u32],
) -> Result<Vec<TokenLogprobs>> {
    let device = raw.device();
    let n = wanted.len();
    let sel = Tensor::<1, Int>::from_data(
        TensorData::new(wanted.iter().map(|&r| r as i64).collect::<Vec<_>>(), [n]),
        &device,
    );
    let lsm = log_softmax(raw.select(0, sel).cast(FloatDType::F32), 1);
    let picked = Tensor::<2, Int>::from_data(
        TensorData::new(
            wanted.iter().map(|&r| ids[r] as i64).collect::<Vec<_>>(),
            [n, 1],
        ),
        &device,
    );
    let err = |e: burn::tensor::DataError| EngineError::Device(format!("logprobs: {e:?}"));
    let to_vec = |t: Tensor<2>| -> Result<Vec<f32>> {
        read(t.try_into_data(), "logprobs")?
            .try_into_vec_as::<f32>()
            .map_err(err)
    };
    let sampled = to_vec(lsm.clone().gather(1, picked))?;
    let top_n = wanted
        .iter()
        .map(|&r| rows[r].params.logprobs.unwrap_or(0))
        .max()
        .unwrap_or(0);
    let (top_v, top_i) = if top_n > 0 {
        let (v, i) = lsm.topk_with_indices(top_n, 1);
        (
            to_vec(v)?,
            read(i.try_into_data(), "logprobs")?
                .try_into_vec_as::<i64>()
                .map_err(err)?,
        )
    } else {
        (Vec::new(), Vec::new())
    };
    Ok(wanted
        .iter()
        .enumerate()
        .map(|(k, &r)| {
            let want = rows[r].params.logprobs.unwrap_or(0);
            TokenLogprobs {
                token_id: ids[r],
                logprob: sampled[k],
                top: (0..want)
                    .map(|j| (top_i[k * top_n + j] as u32, top_v[k * top_n + j]))
                    .collect(),
            }
        })
        .collect())
}

/// A device read, its failure (an out-of-memory or a failed kernel of the step) as
/// [`EngineError::Device`] naming `what` was read, rather than a panic.
pub(crate) fn read(
    data: std::result::Result<TensorData, burn::backend::ExecutionError>,
    what: &str,
) -> Result<TensorData> {
    data.map_err(|e| EngineError::Device(format!("{what}: {e}")))
}
