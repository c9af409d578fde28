//! What one step computes, as the model runner and the step graphs read it: each scheduled
//! sequence's new tokens and blocks, and where its token ids come from.
//!
//! With overlapped scheduling a decoding sequence's newest token may still be on the device
//! when the next step is built: the runner's standing buffer of draws (`[max_num_seqs]` i32,
//! written in place by the sampler) holds it at the sequence's row of the previous step. Such a
//! token row carries that row ([`StepSeq::pending_row`]); its host id is a placeholder, and
//! [`feed_draws`] puts the draw in its place on the device, inside the step's forward (and
//! inside a captured graph).

use burn::tensor::{Int, Tensor};

/// One sequence's part of a step, as the runner needs it.
#[derive(Clone, Copy, Debug)]
pub struct StepSeq<'a> {
    /// The tokens this step computes, from position `num_computed_tokens` (the last one a
    /// placeholder when `pending_row` is set).
    pub new_token_ids: &'a [u32],
    /// Tokens already in the cache.
    pub num_computed_tokens: usize,
    /// Its blocks (covering every token computed after this step).
    pub block_table: &'a [u32],
    /// The step samples its next token.
    pub samples: bool,
    /// Its last token is still on the device: row `r` of the previous step's draws.
    pub pending_row: Option<usize>,
}

impl StepSeq<'_> {
    /// Tokens computed in this step.
    pub fn num_new_tokens(&self) -> usize {
        self.new_token_ids.len()
    }

    /// The host token ids of its new tokens (0 for a token still on the device).
    pub fn new_ids(&self) -> impl Iterator<Item = u32> + '_ {
        let last = self.num_new_tokens() - 1;
        self.new_token_ids.iter().enumerate().map(move |(i, &t)| {
            if self.pending_row.is_some() && i == last {
                0
            } else {
                t
            }
        })
    }
}

/// A [`StepSeq`] that owns its parts: what a tensor-parallel worker receives.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct PlannedSeq {
    /// [`StepSeq::new_token_ids`].
    pub new_token_ids: Vec<u32>,
    /// [`StepSeq::num_computed_tokens`].
    pub num_computed_tokens: usize,
    /// [`StepSeq::block_table`] (the blocks up to the step's last token).
    pub block_table: Vec<u32>,
    /// [`StepSeq::samples`].
    pub samples: bool,
    /// [`StepSeq::pending_row`].
    pub pending_row: Option<usize>,
}

impl PlannedSeq {
    /// The owned copy of `s`.
    pub fn of(s: &StepSeq<'_>) -> Self {
        Self {
            new_token_ids: s.new_token_ids.to_vec(),
            num_computed_tokens: s.num_computed_tokens,
            block_table: s.block_table.to_vec(),
            samples: s.samples,
            pending_row: s.pending_row,
        }
    }

    /// The step's view of it.
    pub fn as_step(&self) -> StepSeq<'_> {
        StepSeq {
            new_token_ids: &self.new_token_ids,
            num_computed_tokens: self.num_computed_tokens,
            block_table: &self.block_table,
            samples: self.samples,
            pending_row: self.pending_row,
        }
    }
}

/// The step's token ids `[T]`: `host_ids [T]`, except at rows where `draw_rows [T]` (i32) is
/// `r ≥ 0`, which take `draws[r]` (`draws [max_num_seqs]` i32, the previous step's tokens).
pub fn feed_draws(
    host_ids: Tensor<1, Int>,
    draw_rows: Tensor<1, Int>,
    draws: Tensor<1, Int>,
) -> Tensor<1, Int> {
    let from_draws = draw_rows.clone().greater_equal_elem(0);
    let drawn = draws.select(0, draw_rows.clamp_min(0));
    host_ids.mask_where(from_draws, drawn)
}
