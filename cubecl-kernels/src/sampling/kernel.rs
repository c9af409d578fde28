//! Device code of the sampler (no host code here: see `launch.rs`).
//!
//! Launch geometry: cubes `(row, part)` over `logits [B, V]` (f32, f16 or bf16 — the model's
//! dtype, read as they are and widened to f32 in registers; unit inner stride, any row pitch);
//! `units` units stride over the cube's slice of the vocabulary, so every pass over a row is
//! coalesced. With `P > 1` parts (few rows: a row's draw would otherwise run on one
//! multiprocessor) each part draws over its `⌈V/P⌉` tokens and writes its best score and token
//! to `partial [B, P]`, and [`super::combine::sample_combine`] keeps the best of each row; a row with a filter
//! (whose threshold needs the whole row) runs on part 0 alone. The best score and the lowest id
//! among equal scores do not depend on the split, so neither does the token. Per row:
//! - greedy (`temperature ≤ 0`; the host sends 0 for any below `GREEDY_BELOW`): one pass,
//!   the argmax (lowest id among equal maxima);
//! - otherwise a Gumbel-max draw, `argmax_i (x_i / T + g_i)` over the kept tokens, with
//!   `g_i = −ln(−ln u_i)` and `u_i` a counter-based hash of (seed, counter, i): one pass when no
//!   filter is set. The draw depends only on the row's own seed and counter, never on the batch.
//!   Each unit loads its tokens `LOADS` at a time before it uses them, and a token whose score
//!   cannot reach the best of its unit or plane under a bound on its noise ([`may_win`]) skips
//!   the logarithms: the same token wins.
//! - filters, each on what the previous kept, as a threshold on the logit: min-p
//!   (`x ≥ max + T·ln(min_p)`, one max pass), top-k (the k-th largest key), top-p (the largest
//!   key whose upper set holds `top_p` of the kept probability mass). Top-k and top-p find their
//!   threshold by radix selection over the order-preserving u32 key of each logit: four passes
//!   of 8-bit digits with a 256-bin histogram in shared memory (counts, or masses in 2⁻³²
//!   fixed point, so the sums do not depend on the order of the atomic adds).
//!
//! Under tensor parallelism with the vocabulary split over the ranks, each rank draws over its
//! shard (`cfg.shard`: global ids for the hash and the result), `combine.rs` writes its best
//! (score, token) into its slot of a zeroed exchange buffer, the ranks sum the buffers, and
//! keeps the best pair: the whole row's token (filters need the whole row
//! and are not drawn this way).
//!
//! Shared memory: 256 u64 bins, `2·units` reduction slots, a few words of state.

use cubecl::prelude::*;

/// Comptime part of the launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SampleConfig {
    /// Units per cube (a power of two).
    pub units: usize,
    /// Reduce through plane operations (else shared memory only).
    pub use_plane: bool,
    /// The logits are one vocabulary shard of a tensor-parallel group (`shard [2]` =
    /// (first token id, slot)): ids are global (hash and result), and every row writes its
    /// part's best to the partials, even with one part (see
    /// [`super::combine::sample_shard_combine`]).
    pub shard: bool,
}

/// Histogram bins of one radix digit.
const BINS: usize = 256;

/// A 32-bit integer hash with full avalanche (Wellons' `lowbias32`); identical on the host
/// (`super::reference::mix32`).
#[cube]
pub fn mix32(x: u32) -> u32 {
    let mut h = x ^ (x >> 16u32);
    h *= 0x7feb_352du32;
    h ^= h >> 15u32;
    h *= 0x846c_a68bu32;
    h ^ (h >> 16u32)
}

/// Order-preserving key of a float: `a < b ⇔ key(a) < key(b)` for non-NaN values.
#[cube]
pub fn order_key(x: f32) -> u32 {
    let b = u32::reinterpret(x);
    select(b >= 0x8000_0000u32, b ^ 0xffff_ffffu32, b | 0x8000_0000u32)
}

/// A uniform draw in (0, 1) for vocabulary entry `i` of a row keyed `row_key`: the hash's top
/// 23 bits `b`, as `(b + ½)·2⁻²³`, every value exact in f32, the largest `1 − 2⁻²⁴`. (With 24
/// bits the largest, `2²⁴ − ½`, rounded to `2²⁴`: u = 1, Gumbel noise +∞, and about one row in
/// 110 over a 151,936-token vocabulary drew a uniformly random token.)
#[cube]
pub fn uniform(row_key: u32, i: u32) -> f32 {
    let h = mix32(row_key ^ mix32(i));
    (f32::cast_from(h >> 9u32) + 0.5) * 1.192_092_9e-7f32
}

/// Largest of `value` over the cube, returned to every unit (`scratch`: one slot per unit).
#[cube]
pub(crate) fn cube_max(
    value: f32,
    scratch: &mut Shared<[f32]>,
    #[comptime] use_plane: bool,
) -> f32 {
    let parts = if comptime!(use_plane) {
        CUBE_DIM_X / PLANE_DIM
    } else {
        CUBE_DIM_X
    };
    if comptime!(use_plane) {
        let m = plane_max(value);
        if UNIT_POS_PLANE == 0 {
            scratch[PLANE_POS as usize] = m;
        }
    } else {
        scratch[UNIT_POS_X as usize] = value;
    }
    sync_cube();
    let mut best = scratch[0];
    for p in 1..parts {
        best = max(best, scratch[p as usize]);
    }
    sync_cube();
    best
}

/// The largest `value` over the cube and its index (lowest index among equals), to every unit.
#[cube]
fn cube_argmax(
    value: f32,
    index: u32,
    scratch_v: &mut Shared<[f32]>,
    scratch_i: &mut Shared<[u32]>,
    #[comptime] use_plane: bool,
) -> (f32, u32) {
    let parts = if comptime!(use_plane) {
        CUBE_DIM_X / PLANE_DIM
    } else {
        CUBE_DIM_X
    };
    if comptime!(use_plane) {
        let m = plane_max(value);
        let i = plane_min(select(value == m, index, u32::MAX));
        if UNIT_POS_PLANE == 0 {
            scratch_v[PLANE_POS as usize] = m;
            scratch_i[PLANE_POS as usize] = i;
        }
    } else {
        scratch_v[UNIT_POS_X as usize] = value;
        scratch_i[UNIT_POS_X as usize] = index;
    }
    sync_cube();
    let mut best_v = scratch_v[0];
    let mut best_i = scratch_i[0];
    for p in 1..parts {
        let v = scratch_v[p as usize];
        let i = scratch_i[p as usize];
        if beats(v, i, best_v, best_i) {
            best_v = v;
            best_i = i;
        }
    }
    sync_cube();
    (best_v, best_i)
}

/// Whether score `v` of token `i` beats the best so far: a larger score, or an equal one of a
/// lower token (the rule that makes a draw independent of how its row was split).
#[cube]
pub(crate) fn beats(v: f32, i: u32, best_v: f32, best_i: u32) -> bool {
    v > best_v || (v == best_v && i < best_i)
}

/// Logits a unit loads before it uses the first of them: a unit's tokens are `units` apart, so
/// one at a time its loop waited on each load (measured latency-bound: 195 µs for 247 rows of
/// 151,936 bf16 logits on the H100).
const LOADS: usize = 8;

/// Logits `at, at + stride, …` (`LOADS` of them), widened to f32, all loads issued first.
#[cube]
fn load_strided<F: Float>(logits: &Tensor<F>, at: usize, stride: usize) -> Array<f32> {
    let mut xs = Array::<f32>::new(LOADS);
    #[unroll]
    for k in 0..LOADS {
        xs[k] = f32::cast_from(logits[at + k * stride]);
    }
    xs
}

/// One token's part of the Gumbel-max draw: token id `i` with logit `x` (kept if its order key is at
/// least `floor`) against this unit's best score and token so far; returns the new best.
/// Tokens that cannot reach `bar` (a score some token of the row has: this unit's best or its
/// plane's) even with the largest noise their draw allows skip the logarithms (and, under the
/// noise of any draw, the hash): they cannot win, so the same token does.
#[cube]
#[allow(clippy::too_many_arguments)]
fn draw(
    x: f32,
    i: u32,
    inv_t: f32,
    floor: u32,
    row_key: u32,
    bar: f32,
    best: f32,
    best_i: u32,
) -> (f32, u32) {
    let mut b = best;
    let mut bi = best_i;
    let s0 = x * inv_t;
    if order_key(x) >= floor && may_win(s0, 16.7f32, bar) {
        let u = uniform(row_key, i);
        if u > 0.99f32 || may_win(s0, 4.61f32, bar) {
            let score = s0 - f32::ln(-f32::ln(u));
            if score > best {
                b = score;
                bi = i;
            }
        }
    }
    (b, bi)
}

/// Whether a token whose scaled logit is `s0` may still beat `best` when its Gumbel noise is
/// at most `bound` (16.7 for any draw: `u ≤ 1 − 2⁻²⁴` gives at most `−ln(2⁻²⁴)` = 16.64; 4.61
/// for `u ≤ 0.99`: `−ln(−ln 0.99)` = 4.6002): `s0 + bound`, widened by 2⁻²⁰ of `|s0|` for the
/// score's rounding, is not below `best`. False for a NaN or −∞ logit, which never wins either.
#[cube]
fn may_win(s0: f32, bound: f32, best: f32) -> bool {
    s0 + fma(s0.abs(), 9.536_743e-7f32, bound) >= best
}

/// Whether row `row`'s draw has a filter (min-p, a binding top-k, top-p), whose threshold
/// needs the whole row in one cube.
#[cube]
pub(crate) fn has_filter(
    params_f: &Tensor<f32>,
    params_u: &Tensor<u32>,
    row: usize,
    vocab: usize,
) -> bool {
    let pf = row * params_f.stride(0);
    let top_k = params_u[row * params_u.stride(0)];
    params_f[pf] > 0.0
        && (params_f[pf + 1] < 1.0
            || params_f[pf + 2] > 0.0
            || (top_k > 0 && (top_k as usize) < vocab))
}

/// The largest key `K ≥ floor` whose upper set `{keys ≥ K} ∩ {keys ≥ floor}` holds at least
/// `need` of the row's weight (a count, or with `by_mass` the 2⁻³²-fixed-point mass
/// `exp((x − m)·inv_t)`; then `need` is the fraction `top_p` of the kept mass). Returns `floor`
/// when the kept tokens hold less than `need`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn radix_select<F: Float>(
    logits: &Tensor<F>,
    base: usize,
    vocab: usize,
    floor: u32,
    need_count: u64,
    top_p: f32,
    by_mass: bool,
    m: f32,
    inv_t: f32,
    hist: &Shared<[Atomic<u64>]>,
    state: &mut Shared<[u32]>,
    need_s: &mut Shared<[u64]>,
    #[comptime] units: usize,
) -> u32 {
    let tid = UNIT_POS_X as usize;
    if tid == 0 {
        state[0] = 0u32; // prefix of the key so far
        state[1] = 0u32; // mask of the fixed bits
        state[2] = 0u32; // 1 once the threshold is known not to bind
        need_s[0] = need_count;
    }
    sync_cube();
    #[unroll]
    for pass in 0..4u32 {
        let shift = 24u32 - 8u32 * pass;
        let mut b = tid;
        while b < BINS {
            hist[b].store(0u64);
            b += units;
        }
        sync_cube();
        let prefix = state[0];
        let mask = state[1];
        let skip = state[2];
        if skip == 0 {
            let mut i = tid;
            while i < vocab {
                let x = f32::cast_from(logits[base + i]);
                let key = order_key(x);
                if key >= floor && (key & mask) == prefix {
                    let weight = if by_mass {
                        u64::cast_from(f32::exp((x - m) * inv_t) * 4_294_967_296.0)
                    } else {
                        1u64
                    };
                    hist[((key >> shift) & 255u32) as usize].fetch_add(weight);
                }
                i += units;
            }
        }
        sync_cube();
        if tid == 0 && skip == 0 {
            let mut need = need_s[0];
            if pass == 0 && by_mass {
                let mut total = 0u64;
                for d in 0..BINS {
                    total += hist[d].load();
                }
                need = max(u64::cast_from(f32::cast_from(total) * top_p), 1u64);
            }
            let mut acc = 0u64;
            let mut chosen = 0u32;
            let mut found = false;
            for step in 0..BINS {
                let d = BINS - 1 - step;
                let c = hist[d].load();
                if !found {
                    if acc + c >= need {
                        chosen = d as u32;
                        found = true;
                    } else {
                        acc += c;
                    }
                }
            }
            if found {
                need_s[0] = need - acc;
                state[0] = prefix | (chosen << shift);
                state[1] = mask | (255u32 << shift);
            } else {
                state[2] = 1u32;
            }
        }
        sync_cube();
    }
    let key = select(state[2] == 1u32, floor, state[0]);
    sync_cube();
    max(key, floor)
}

/// See the module documentation. `params_f [B, 4]` = (temperature, top_p, min_p, −),
/// `params_u [B, 4]` = (top_k, seed_lo, seed_hi, counter); `tokens [B]` when the launch has
/// one part per row, else `partial_v`, `partial_i [B, P]` (each part's best score and token).
/// The part count is the grid's, not compiled in: one kernel serves every batch size.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn sample_rows<F: Float>(
    logits: &Tensor<F>,
    params_f: &Tensor<f32>,
    params_u: &Tensor<u32>,
    tokens: &mut Tensor<i32>,
    partial_v: &mut Tensor<f32>,
    partial_i: &mut Tensor<u32>,
    shard: &Tensor<u32>,
    #[comptime] cfg: SampleConfig,
    #[define(F)] _dtype: ElemType,
) {
    let row = CUBE_POS_X as usize;
    let mut offset = 0u32;
    if comptime!(cfg.shard) {
        offset = shard[0];
    }
    let part = CUBE_POS_Y as usize;
    let tid = UNIT_POS_X as usize;
    let units = cfg.units;
    let vocab = logits.shape(1);
    let filtered = has_filter(params_f, params_u, row, vocab);
    let parts = select(filtered, 1usize, CUBE_COUNT_Y as usize);
    if part >= parts {
        terminate!();
    }
    let chunk = vocab.div_ceil(parts);
    let first = part * chunk;
    let end = min(vocab, first + chunk);
    let base = row * logits.stride(0);
    let pf = row * params_f.stride(0);
    let pu = row * params_u.stride(0);
    let temperature = params_f[pf];
    let mut scratch_v = Shared::<[f32]>::new_slice(units);
    let mut scratch_i = Shared::<[u32]>::new_slice(units);
    let hist = Shared::<[Atomic<u64>]>::new_slice(BINS);
    let mut state = Shared::<[u32]>::new_slice(4usize);
    let mut need_s = Shared::<[u64]>::new_slice(1usize);

    // Every unit starts from a token of the vocabulary (its part's first; parts past the end
    // take the last token), so the row's winner is one even when no score beats −∞ (a row
    // masked whole, NaN logits): the sampler never returns an id outside `0..V`.
    let mut best = f32::new(f32::NEG_INFINITY);
    let mut best_i = min(first, vocab - 1) as u32 + offset;
    if temperature <= 0.0 {
        let mut i = first + tid;
        while i + comptime!((LOADS - 1) * units) < end {
            let xs = load_strided(logits, base + i, units);
            #[unroll]
            for k in 0..LOADS {
                let x = xs[k];
                if x > best {
                    best = x;
                    best_i = (i + k * units) as u32 + offset;
                }
            }
            i += comptime!(LOADS * units);
        }
        while i < end {
            let x = f32::cast_from(logits[base + i]);
            if x > best {
                best = x;
                best_i = i as u32 + offset;
            }
            i += units;
        }
    } else {
        let inv_t = 1.0 / temperature;
        let top_p = params_f[pf + 1];
        let min_p = params_f[pf + 2];
        let top_k = params_u[pu];
        let row_key = mix32(
            params_u[pu + 1] ^ mix32(params_u[pu + 2] ^ mix32(params_u[pu + 3] ^ 0x9e37_79b9u32)),
        );
        let topk_binds = top_k > 0 && (top_k as usize) < vocab;
        let mut floor = 0u32;
        if filtered {
            let mut local = f32::new(f32::NEG_INFINITY);
            let mut i = tid;
            while i < vocab {
                local = max(local, f32::cast_from(logits[base + i]));
                i += units;
            }
            let m = cube_max(local, &mut scratch_v, cfg.use_plane);
            if min_p > 0.0 {
                floor = order_key(m + temperature * f32::ln(min_p));
            }
            if topk_binds {
                floor = radix_select(
                    logits,
                    base,
                    vocab,
                    floor,
                    u64::cast_from(top_k),
                    1.0,
                    false,
                    m,
                    inv_t,
                    &hist,
                    &mut state,
                    &mut need_s,
                    units,
                );
            }
            if top_p < 1.0 {
                floor = radix_select(
                    logits,
                    base,
                    vocab,
                    floor,
                    1u64,
                    top_p,
                    true,
                    m,
                    inv_t,
                    &hist,
                    &mut state,
                    &mut need_s,
                    units,
                );
            }
        }
        // Batches of `LOADS` tokens a unit while the plane's last unit has a full one (a
        // condition the whole plane shares, so that it can share its best score: the bar a
        // token must be able to reach), then the rest one at a time.
        let mut i = first + tid;
        let mut lead = i;
        if comptime!(cfg.use_plane) {
            lead = i - UNIT_POS_PLANE as usize + PLANE_DIM as usize - 1;
        }
        while lead + comptime!((LOADS - 1) * units) < end {
            let xs = load_strided(logits, base + i, units);
            let mut bar = best;
            if comptime!(cfg.use_plane) {
                bar = plane_max(best);
            }
            #[unroll]
            for k in 0..LOADS {
                let (b, bi) = draw(
                    xs[k],
                    (i + k * units) as u32 + offset,
                    inv_t,
                    floor,
                    row_key,
                    max(bar, best),
                    best,
                    best_i,
                );
                best = b;
                best_i = bi;
            }
            i += comptime!(LOADS * units);
            lead += comptime!(LOADS * units);
        }
        while i < end {
            let x = f32::cast_from(logits[base + i]);
            let (b, bi) = draw(
                x,
                i as u32 + offset,
                inv_t,
                floor,
                row_key,
                best,
                best,
                best_i,
            );
            best = b;
            best_i = bi;
            i += units;
        }
    }
    let (score, token) = cube_argmax(best, best_i, &mut scratch_v, &mut scratch_i, cfg.use_plane);
    if tid == 0 {
        if CUBE_COUNT_Y > 1 || comptime!(cfg.shard) {
            let at = row * partial_v.stride(0) + part;
            partial_v[at] = score;
            partial_i[at] = token;
        } else {
            tokens[row] = token as i32;
        }
    }
}

/// Structured outputs' token masks: cube `(c, r)` covers tokens `c·CUBE_DIM_X..` of
/// `logits [B, V]` row `rows[r]`, one unit per token: bit `t mod 32` of word `t / 32` of
/// `allowed [M, ⌈V/32⌉]` clear sets `logits[rows[r], t]` to −∞ (in place; f32, f16 or bf16).
#[cube(launch_unchecked)]
pub fn mask_disallowed<F: Float>(
    logits: &mut Tensor<F>,
    allowed: &Tensor<u32>,
    rows: &Tensor<u32>,
    #[define(F)] _dtype: ElemType,
) {
    let r = CUBE_POS_Y as usize;
    let t = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    if t < logits.shape(1) {
        let word = allowed[r * allowed.stride(0) + t / 32];
        if (word >> (t % 32) as u32) & 1u32 == 0u32 {
            let at = rows[r] as usize * logits.stride(0) + t;
            logits[at] = F::cast_from(f32::NEG_INFINITY);
        }
    }
}
