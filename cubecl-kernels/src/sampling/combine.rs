//! Device code that combines the sampler's partial draws (no host code here: see `launch.rs`):
//! the parts of a split row ([`sample_combine`]), and under tensor parallelism a vocabulary
//! shard's best written into its slot of the exchange buffer ([`sample_shard_combine`]) and
//! the winner of the group-summed buffer ([`pick_exchanged`]).
//!
//! Launch geometry: one unit per row, `COMBINE_UNITS` units per cube. Layouts: partials
//! `[B, P]` (scores f32, tokens u32); the exchange `[B, 2·S]` f32, scores in columns `0..S`,
//! tokens (exact in f32 below 2²⁴) in `S..2S`.

use cubecl::prelude::*;

use super::kernel::{beats, has_filter};

/// The best of `parts` (score, token) pairs of a split [`sample_rows`] row starting at `base`
/// (the lowest token among equal scores).
#[cube]
fn best_part(
    partial_v: &Tensor<f32>,
    partial_i: &Tensor<u32>,
    base: usize,
    parts: usize,
) -> (f32, u32) {
    let mut best_v = partial_v[base];
    let mut best_i = partial_i[base];
    for p in 1..parts {
        let v = partial_v[base + p];
        let i = partial_i[base + p];
        if beats(v, i, best_v, best_i) {
            best_v = v;
            best_i = i;
        }
    }
    (best_v, best_i)
}

/// The token of each row of a split [`sample_rows`]: the best of its parts' scores (the lowest
/// token among equal ones), one unit per row, into `tokens [B]`.
#[cube(launch_unchecked)]
pub fn sample_combine(
    partial_v: &Tensor<f32>,
    partial_i: &Tensor<u32>,
    params_f: &Tensor<f32>,
    params_u: &Tensor<u32>,
    tokens: &mut Tensor<i32>,
    vocab: usize,
) {
    let row = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    if row < partial_v.shape(0) {
        let parts = select(
            has_filter(params_f, params_u, row, vocab),
            1usize,
            partial_v.shape(1),
        );
        let (_, best_i) = best_part(partial_v, partial_i, row * partial_v.stride(0), parts);
        tokens[row] = best_i as i32;
    }
}

/// A vocabulary shard's best (score, global token) of each row of a shard-mode [`sample_rows`]
/// (no filters: every part counts), one unit per row, written into the row's slot of
/// `exchange [B, 2·S]` f32 (`S` slots: scores in columns `0..S`, tokens as f32 — exact below
/// 2²⁴ — in `S..2S`; slot `shard[1]`). The other slots are left as they are (zero), so that a
/// sum over the group's ranks is every shard's pair.
#[cube(launch_unchecked)]
pub fn sample_shard_combine(
    partial_v: &Tensor<f32>,
    partial_i: &Tensor<u32>,
    shard: &Tensor<u32>,
    exchange: &mut Tensor<f32>,
) {
    let row = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    if row < partial_v.shape(0) {
        let (best_v, best_i) = best_part(
            partial_v,
            partial_i,
            row * partial_v.stride(0),
            partial_v.shape(1),
        );
        let slots = exchange.shape(1) / 2;
        let at = row * exchange.stride(0) + shard[1] as usize;
        exchange[at] = best_v;
        exchange[at + slots] = f32::cast_from(best_i);
    }
}

/// The token of each row of a summed `exchange [B, 2·S]` (see [`sample_shard_combine`]): the
/// best of its `S` shards' pairs, the lowest token among equal scores (shards are ordered by
/// token, so this is the whole row's draw), into `tokens [B]`.
#[cube(launch_unchecked)]
pub fn pick_exchanged(exchange: &Tensor<f32>, tokens: &mut Tensor<i32>) {
    let row = (CUBE_POS_X * CUBE_DIM_X + UNIT_POS_X) as usize;
    if row < exchange.shape(0) {
        let slots = exchange.shape(1) / 2;
        let base = row * exchange.stride(0);
        let mut best_v = exchange[base];
        let mut best_i = u32::cast_from(exchange[base + slots]);
        for s in 1..slots {
            let v = exchange[base + s];
            let i = u32::cast_from(exchange[base + slots + s]);
            if beats(v, i, best_v, best_i) {
                best_v = v;
                best_i = i;
            }
        }
        tokens[row] = best_i as i32;
    }
}
