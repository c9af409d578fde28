//! A step's sampling as plain data ([`SamplePlan`]), which every tensor-parallel rank
//! enqueues over its own logits, and the token masks of structured outputs it carries.

use std::ops::Range;

use burn::tensor::{Int, Tensor, TensorData};
use cubecl_kernels::{SamplingRow, VocabShard};
use model_qwen2::{Parallel, Qwen2Model};

use super::penalties::Penalties;
use super::rows::SamplerRow;
use crate::error::{EngineError, Result};
use crate::knobs::Knobs;

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
    /// Log-probabilities computed one row at a time, so that a row's do not depend on how many
    /// rows ask for them (Burn's reductions pick their strategy by the number of rows; set for
    /// `EngineConfig::batch_invariant`).
    pub logprobs_per_row: bool,
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
            logprobs_per_row: false,
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
            Some(s) if self.whole_rows || Knobs::get().gather_logits => {
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
        let exchange = s.parallel.all_reduce.sum_outside_graphs(exchange);
        cubecl_kernels::pick_exchanged_into(exchange, draws)?;
        Ok(())
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
