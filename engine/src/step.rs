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
    /// All its tokens (the last one a placeholder when `pending_row` is set).
    pub token_ids: &'a [u32],
    /// Tokens already in the cache; this step computes the next `num_new_tokens`.
    pub num_computed_tokens: usize,
    /// Tokens computed in this step.
    pub num_new_tokens: usize,
    /// Its blocks (covering every token computed after this step).
    pub block_table: &'a [u32],
    /// The step samples its next token.
    pub samples: bool,
    /// Its last token is still on the device: row `r` of the previous step's draws.
    pub pending_row: Option<usize>,
}

impl StepSeq<'_> {
    /// The host token ids of its new tokens (0 for a token still on the device).
    pub fn new_ids(&self) -> impl Iterator<Item = u32> + '_ {
        let start = self.num_computed_tokens;
        let last = self.token_ids.len() - 1;
        (start..start + self.num_new_tokens).map(move |p| {
            if self.pending_row.is_some() && p == last {
                0
            } else {
                self.token_ids[p]
            }
        })
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
