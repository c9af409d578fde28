//! Turning a step's logits into next tokens on the device: penalties, `logit_bias`, and the
//! bans of `min_tokens` and `bad_words` as one gather/scatter over the affected logits, then the sampling kernel
//! ([`cubecl_kernels::sample`]: greedy, or a seeded min-p/top-k/top-p draw per row), and
//! log-probabilities for the rows that ask. Only the sampled ids (and requested log-probs)
//! come back to the host; the `[rows, V]` logits never do. The ids land in the runner's
//! standing buffer of draws (the next step's forward reads them there) and come back
//! asynchronously ([`Draws`]): the engine enqueues the next step before it waits for them.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use burn::tensor::{
    DType, FloatDType, IndexingUpdateOp, Int, Tensor, TensorData, activation::log_softmax,
};
use cubecl_kernels::{SamplingRow, VocabShard};
use model_qwen2::{Parallel, Qwen2Model};

use crate::error::{EngineError, Result};
use crate::sampling_params::SamplingParams;

/// What the sampler needs of one row's request.
#[derive(Clone, Debug)]
pub struct SamplerRow<'a> {
    /// The request's parameters.
    pub params: &'a SamplingParams,
    /// The request's seed.
    pub seed: u64,
    /// Prompt tokens (repetition penalty).
    pub prompt: &'a [u32],
    /// Generated tokens so far (penalties).
    pub output: &'a [u32],
    /// Tokens that may not be drawn now (end-of-sequence and stop tokens before `min_tokens`).
    pub banned: Vec<u32>,
}

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

/// The penalty applied to one logit.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Adjustment {
    /// Repetition penalty factor (1 = none).
    repetition: f32,
    /// Subtracted: `frequency · count + presence · [count > 0] − logit_bias`.
    subtract: f32,
    /// Forced to −∞.
    banned: bool,
}

/// The logits a row's penalties and bans touch, by token id.
fn adjustments(row: &SamplerRow<'_>) -> BTreeMap<u32, Adjustment> {
    let p = row.params;
    let mut out: BTreeMap<u32, Adjustment> = BTreeMap::new();
    let none = Adjustment {
        repetition: 1.0,
        subtract: 0.0,
        banned: false,
    };
    if p.repetition_penalty != 1.0 {
        for &t in row.prompt.iter().chain(row.output) {
            out.entry(t).or_insert(none).repetition = p.repetition_penalty;
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let mut counts: BTreeMap<u32, u32> = BTreeMap::new();
        for &t in row.output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            out.entry(t).or_insert(none).subtract =
                p.frequency_penalty * c as f32 + p.presence_penalty;
        }
    }
    // `logit_bias`: added after the penalties (as vLLM's logits processor does).
    for &(t, b) in &p.logit_bias {
        out.entry(t).or_insert(none).subtract -= b;
    }
    for &t in &row.banned {
        out.entry(t).or_insert(none).banned = true;
    }
    out
}

fn adjust(x: f32, a: &Adjustment) -> f32 {
    if a.banned {
        return f32::NEG_INFINITY;
    }
    let x = if x > 0.0 {
        x / a.repetition
    } else {
        x * a.repetition
    };
    x - a.subtract
}

/// Applies the rows' penalties and bans to host logits (`rows.len()` rows of `vocab`): the
/// reference of the device path.
pub fn apply_penalties_host(logits: &mut [f32], vocab: usize, rows: &[SamplerRow<'_>]) {
    for (r, row) in rows.iter().enumerate() {
        for (t, a) in adjustments(row) {
            let x = &mut logits[r * vocab + t as usize];
            *x = adjust(*x, &a);
        }
    }
}

/// Applies the rows' penalties and bans to `logits [rows, V]` on its device; returns them as
/// they came when no row has any, else in f32.
pub fn apply_penalties(logits: Tensor<2>, rows: &[SamplerRow<'_>]) -> Tensor<2> {
    let v = logits.dims()[1];
    Penalties::new(rows, v).apply(logits)
}

/// The logits a step's penalties and bans touch, flattened (`row · V + token`), with their
/// adjustments: the host's part of [`apply_penalties`].
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Penalties {
    index: Vec<i64>,
    repetition: Vec<f32>,
    subtract: Vec<f32>,
    banned: Vec<bool>,
}

impl Penalties {
    /// Of `rows` over a `vocab`-token vocabulary.
    pub fn new(rows: &[SamplerRow<'_>], vocab: usize) -> Self {
        let mut p = Self::default();
        for (r, row) in rows.iter().enumerate() {
            for (t, a) in adjustments(row) {
                p.index.push((r * vocab + t as usize) as i64);
                p.repetition.push(a.repetition);
                p.subtract.push(a.subtract);
                p.banned.push(a.banned);
            }
        }
        p
    }

    /// Those of the tokens `tokens` of a `vocab`-token vocabulary, indexed into a shard of
    /// the logits (`row · V_shard + token − tokens.start`).
    pub fn shard(&self, vocab: usize, tokens: &Range<usize>) -> Self {
        let mut p = Self::default();
        for (k, &at) in self.index.iter().enumerate() {
            let (row, token) = (at as usize / vocab, at as usize % vocab);
            if tokens.contains(&token) {
                p.index
                    .push((row * tokens.len() + token - tokens.start) as i64);
                p.repetition.push(self.repetition[k]);
                p.subtract.push(self.subtract[k]);
                p.banned.push(self.banned[k]);
            }
        }
        p
    }

    /// Applies them to `logits [rows, V]` on its device (as they came when there are none,
    /// else in f32).
    pub fn apply(&self, logits: Tensor<2>) -> Tensor<2> {
        if self.index.is_empty() {
            return logits;
        }
        let [s, v] = logits.dims();
        let device = logits.device();
        let n = self.index.len();
        let index = Tensor::<1, Int>::from_data(TensorData::new(self.index.clone(), [n]), &device);
        let repetition = Tensor::<1>::from_data(
            TensorData::new(self.repetition.clone(), [n]),
            (&device, DType::F32),
        );
        let subtract = Tensor::<1>::from_data(
            TensorData::new(self.subtract.clone(), [n]),
            (&device, DType::F32),
        );
        let banned = Tensor::<1, burn::tensor::Bool>::from_data(
            TensorData::new(self.banned.clone(), [n]),
            &device,
        );
        let flat = logits.cast(FloatDType::F32).reshape([s * v]);
        let x = flat.clone().select(0, index.clone());
        let positive = x.clone().greater_elem(0.0);
        let scaled = (x.clone() * repetition.clone()).mask_where(positive, x / repetition);
        let adjusted = (scaled - subtract).mask_fill(banned, f32::NEG_INFINITY);
        flat.select_assign(0, index, adjusted, IndexingUpdateOp::Assign)
            .reshape([s, v])
    }
}

/// The device part of a step's sampling as plain data: penalties and bans, token masks and
/// each row's draw. Rank 0 builds it from its requests; every tensor-parallel rank enqueues it
/// over its own shard of the logits, so every rank writes the same tokens into its draws.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplePlan {
    /// Penalties and bans.
    pub penalties: Penalties,
    /// Token masks of the constrained rows.
    pub masks: TokenMasks,
    /// Each row's draw.
    pub rows: Vec<SamplingRow>,
    /// The whole vocabulary's size.
    pub vocab: usize,
    /// Some row needs its whole row of logits (a filter, or log-probabilities): under tensor
    /// parallelism the ranks gather the logits instead of exchanging each shard's draw.
    pub whole_rows: bool,
}

/// A tensor-parallel rank's columns of the logits and its group: how [`SamplePlan::enqueue`]
/// draws from a shard.
#[derive(Clone, Debug)]
pub struct LogitsShard {
    /// The rank's place and collective.
    pub parallel: Parallel,
    /// The rank's tokens (its columns of the logits).
    pub tokens: Range<usize>,
}

impl LogitsShard {
    /// The shard `model`'s LM head computes (`None` when it computes the whole vocabulary).
    pub fn of(model: &Qwen2Model) -> Option<Self> {
        model.vocab_split().map(|parallel| Self {
            parallel: parallel.clone(),
            tokens: model.vocab.clone(),
        })
    }
}

/// `BURN_NANOVLLM_TP_LOGITS=gather` (benchmarks): tensor-parallel ranks gather every step's
/// logits instead of exchanging each shard's draw.
fn always_gather() -> bool {
    static GATHER: OnceLock<bool> = OnceLock::new();
    *GATHER.get_or_init(|| std::env::var("BURN_NANOVLLM_TP_LOGITS").is_ok_and(|v| v == "gather"))
}

impl SamplePlan {
    /// The plan of `rows` (constrained rows under `masks`; `counters[r]`: the position of the
    /// token row `r` draws) over a `vocab`-token vocabulary.
    pub fn new(rows: &[SamplerRow<'_>], masks: TokenMasks, counters: &[u32], vocab: usize) -> Self {
        let draws: Vec<SamplingRow> = rows
            .iter()
            .zip(counters)
            .map(|(r, &counter)| SamplingRow {
                temperature: r.params.temperature,
                top_k: r.params.top_k,
                top_p: r.params.top_p,
                min_p: r.params.min_p,
                seed: r.seed,
                counter,
            })
            .collect();
        Self {
            penalties: Penalties::new(rows, vocab),
            masks,
            whole_rows: rows.iter().any(|r| r.params.logprobs.is_some())
                || draws.iter().any(|d| d.needs_whole_row(vocab)),
            rows: draws,
            vocab,
        }
    }

    /// Enqueues it over `logits [rows, V]`, or under tensor parallelism (`shard`) over this
    /// rank's columns `[rows, V_shard]` — a collective: every rank of the group calls it with
    /// the same plan. There, each rank draws each row over its own tokens and the ranks sum
    /// every rank's (score, token) pairs (`cubecl_kernels::sample_shard`), or, when the plan
    /// needs whole rows, gather the logits first. The tokens land in `draws[..rows]` in place;
    /// the masks are uploaded as they are (pinned upload memory stays uncopied). With
    /// `keep_whole` (log-probabilities; such a plan needs whole rows) it returns the whole
    /// logits as they came, before penalties (held, they cost the in-place masks a copy).
    pub fn enqueue(
        self,
        logits: Tensor<2>,
        draws: &mut Tensor<1, Int>,
        shard: Option<&LogitsShard>,
        keep_whole: bool,
    ) -> Result<Option<Tensor<2>>> {
        let whole = match shard {
            None => logits,
            Some(s) if self.whole_rows || always_gather() => {
                s.parallel.gather_vocab(logits, s.tokens.start, self.vocab)
            }
            Some(s) => {
                self.enqueue_shard(logits, draws, s)?;
                return Ok(None);
            }
        };
        let raw = keep_whole.then(|| whole.clone());
        let logits = self.penalties.apply(whole);
        let logits = cubecl_kernels::mask_logits(logits, self.masks.allowed, &self.masks.rows)?;
        cubecl_kernels::sample_into(logits, &self.rows, draws)?;
        Ok(raw)
    }

    /// [`Self::enqueue`] over a shard, by exchange.
    fn enqueue_shard(
        self,
        logits: Tensor<2>,
        draws: &mut Tensor<1, Int>,
        s: &LogitsShard,
    ) -> Result<()> {
        let logits = self.penalties.shard(self.vocab, &s.tokens).apply(logits);
        let allowed = self.masks.shard(&s.tokens)?;
        let logits = cubecl_kernels::mask_logits(logits, allowed, &self.masks.rows)?;
        let shard = VocabShard {
            first: s.tokens.start,
            slot: s.parallel.rank.rank,
            slots: s.parallel.rank.size,
        };
        let exchange = cubecl_kernels::sample_shard(logits, &self.rows, shard, self.vocab)?;
        let exchange = s.parallel.all_reduce.sum(exchange);
        cubecl_kernels::pick_exchanged_into(exchange, draws)?;
        Ok(())
    }
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

/// Structured outputs' token bitmasks of some of a step's rows (see
/// [`cubecl_kernels::mask_logits`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TokenMasks {
    /// `[rows.len(), ⌈V/32⌉]` u32 words (bit set = token allowed).
    pub allowed: TensorData,
    /// The row of each mask.
    pub rows: Vec<u32>,
}

impl TokenMasks {
    /// The masks' bits of the tokens `tokens` (a vocabulary shard): `[rows, ⌈V_shard/32⌉]`.
    pub fn shard(&self, tokens: &Range<usize>) -> Result<TensorData> {
        let m = self.rows.len();
        let words = self.allowed.shape().as_slice()[1];
        let allowed = self
            .allowed
            .as_slice::<u32>()
            .map_err(|e| EngineError::Device(format!("token masks: {e:?}")))?;
        let out_words = cubecl_kernels::mask_words(tokens.len());
        let (skip, shift) = (tokens.start / 32, tokens.start % 32);
        let mut out = vec![0u32; m * out_words];
        for r in 0..m {
            let row = &allowed[r * words..(r + 1) * words];
            for (j, w) in out[r * out_words..(r + 1) * out_words]
                .iter_mut()
                .enumerate()
            {
                let lo = row.get(skip + j).copied().unwrap_or(0);
                let hi = row.get(skip + j + 1).copied().unwrap_or(0);
                *w = if shift == 0 {
                    lo
                } else {
                    (lo >> shift) | (hi << (32 - shift))
                };
            }
        }
        Ok(TensorData::new(out, [m, out_words]))
    }

    /// No masks, for a `vocab_size`-token vocabulary.
    pub fn none(vocab_size: usize) -> Self {
        Self {
            allowed: TensorData::new(
                Vec::<u32>::new(),
                [0, cubecl_kernels::mask_words(vocab_size)],
            ),
            rows: Vec::new(),
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
    let all = logprobs(raw, &wanted, rows, &ids)?;
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

/// A device read, its failure (an out-of-memory or a failed kernel of the step) as an engine
/// error rather than a panic.
/// A device read, its failure as [`EngineError::Device`] naming `what` was read.
pub(crate) fn read(
    data: std::result::Result<TensorData, burn::backend::ExecutionError>,
    what: &str,
) -> Result<TensorData> {
    data.map_err(|e| EngineError::Device(format!("{what}: {e}")))
}
