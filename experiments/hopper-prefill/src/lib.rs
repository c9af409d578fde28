//! Causal prefill attention on Hopper's warp-group MMA (`wgmma`), through CubeCL 0.12's LLVM
//! route: the first step of FlashAttention-3's design, to be measured beside FA3 and beside the
//! `mma.sync` kernel of `cubecl-kernels` before the workspace moves to CubeCL 0.12.
//!
//! Launch geometry: one cube of one warpgroup (128 units) per 64 query rows of one head
//! (`CUBE_POS_X`: the query tile, `CUBE_POS_Y`: the head). The cube stages its Q tile once, then
//! for each key tile of [`KEYS`] keys up to its causal limit stages K (K-major, as `B` of
//! `S = Q·Kᵀ`) and V (MN-major, as `B` of `O += P·V`) in shared memory with 128-byte swizzles,
//! computes `S` with `D / 16` MMAs (A and B from shared memory), takes the online softmax on the
//! accumulator's registers (each unit holds two rows' elements; a row's max and sum reduce over
//! the four lanes that share it), and adds `P·V` with `P` as register fragments (the
//! accumulator's layout of `S` is the fragments' layout, eight elements a 16-key step).
//!
//! With `p_shared`, P goes through a shared tile instead (K-major, 64 × [`KEYS`]) and `P·V`'s
//! MMAs read both operands from shared memory, issued together.
//!
//! Two loaders: [`prefill_wgmma`]'s units stage each tile element by element;
//! [`prefill_wgmma_tma`] loads each 128-byte panel of a tile with one TMA copy on an mbarrier.
//!
//! Not yet FA3: no producer warp, no ring of stages (each tile is loaded, then computed on), and
//! `P·V` goes to a fresh accumulator that is added to the running output (CubeCL 0.12's
//! accumulator cannot be rescaled in place).
//!
//! Layout: `q [heads, seq, D]`, `k` and `v` `[heads / group, seq, D]` contiguous (query head `h`
//! reads kv head `h / group`; each cube stages its own copy of K and V), `out [heads, seq, D]`
//! f32. Several sequences of one length are more heads.

use cubecl::prelude::barrier::Barrier;
use cubecl::prelude::*;
use cubecl::wgmma::{Accumulator, Fragment, Major, MatrixDescriptor, Swizzle, WgmmaTileLayout};

/// Query rows of a cube: one warpgroup MMA's M.
pub const QUERIES: usize = 64;

/// Keys a tile: the `n` of `S`'s MMAs and the K of `P·V`'s.
pub const KEYS: usize = 64;

/// Units of a cube: one warpgroup.
pub const UNITS: usize = 128;

/// The shared-memory layout of a tile of `rows` lines of `k` elements read as `A` or `B` with
/// K contiguous (Q, K).
pub fn k_major(rows: usize, k: usize) -> WgmmaTileLayout {
    WgmmaTileLayout {
        major: Major::K,
        swizzle: Swizzle::B128,
        rows,
        k,
    }
}

/// The layout of V `[keys, D]` read as `B` of `P·V` (`n = D`, K = the keys): MN-major.
pub fn mn_major(rows: usize, k: usize) -> WgmmaTileLayout {
    WgmmaTileLayout {
        major: Major::MN,
        swizzle: Swizzle::B128,
        rows,
        k,
    }
}

/// Writes `count` rows of `d` elements of `src` (row-major from `base`) into `tile`, zeros for
/// the rows past `count` up to `rows`; `transposed`: element `(r, c)` goes to the tile's
/// `(c, r)` (V as an MN-major `B`).
#[cube]
fn stage<E: Float>(
    src: &[E],
    base: usize,
    count: usize,
    tile: &mut [E],
    #[comptime] layout: WgmmaTileLayout,
    #[comptime] rows: usize,
    #[comptime] d: usize,
    #[comptime] transposed: bool,
) {
    let elem = E::size();
    let total = comptime![rows * d];
    let mut i = UNIT_POS as usize;
    while i < total {
        let r = i / d;
        let c = i % d;
        let mut value = E::from_int(0);
        if r < count {
            value = src[base + i];
        }
        if comptime![transposed] {
            tile[layout.offset(c, r, elem)] = value;
        } else {
            tile[layout.offset(r, c, elem)] = value;
        }
        i += comptime![UNITS];
    }
}

/// The `(row, col)` of the `nth` element a unit holds of a warpgroup accumulator (runs of two
/// columns; rows `lane / 4` and `lane / 4 + 8` of its plane's 16).
#[cube]
fn position(nth: usize) -> (usize, usize) {
    let unit = UNIT_POS as usize;
    let plane = unit / 32;
    let lane = unit % 32;
    let chunk = nth / 2;
    let row = plane * 16 + lane / 4 + (chunk % 2) * 8;
    let col = (chunk / 2) * 8 + (lane % 4) * 2 + nth % 2;
    (row, col)
}

/// The largest of `x` over the four lanes that hold a row.
#[cube]
fn quad_max(x: f32) -> f32 {
    let a = max(x, plane_shuffle_xor(x, 1u32));
    max(a, plane_shuffle_xor(a, 2u32))
}

/// The sum of `x` over the four lanes that hold a row.
#[cube]
fn quad_sum(x: f32) -> f32 {
    let a = x + plane_shuffle_xor(x, 1u32);
    a + plane_shuffle_xor(a, 2u32)
}

/// `eˣ` for the softmax: libdevice's `expf` (`libdevice`: on the GPU machine, whose CUDA
/// toolkit has it), or, without it, `2^(x·log₂ e)` as a power of two times a degree-7 Taylor
/// polynomial of `2^frac` (relative error ~1e-6; what compiles where no toolkit is, and the
/// form to compare against). CubeCL 0.12's LLVM route has no fast `ex2` and does not lower
/// inline PTX yet (our 0.11 patch of cubecl-llvm does: `vendor/README.md`).
#[cube]
fn exp_of(x: f32, #[comptime] libdevice: bool) -> f32 {
    if comptime![libdevice] {
        f32::exp(x)
    } else {
        let t = clamp(x * core::f32::consts::LOG2_E, -126.0f32, 126.0f32);
        let whole = f32::floor(t);
        let f = (t - whole) * core::f32::consts::LN_2;
        // 1/7!, 1/6!, …, 1/1!, 1/0!
        let mut p = 1.984_127e-4f32;
        p = p * f + 1.388_888_9e-3f32;
        p = p * f + 8.333_333e-3f32;
        p = p * f + 4.166_666_8e-2f32;
        p = p * f + 0.166_666_67f32;
        p = p * f + 0.5f32;
        p = p * f + 1.0f32;
        p = p * f + 1.0f32;
        let bits = u32::cast_from(i32::cast_from(whole) + 127) << 23u32;
        p * f32::reinterpret(bits)
    }
}

/// See the module documentation. `group`: query heads per kv head; `scale`: the softmax scale
/// (`1 / √D`).
#[cube(launch_unchecked)]
pub fn prefill_wgmma<E: Float>(
    q: &[E],
    k: &[E],
    v: &[E],
    out: &mut [f32],
    seq: usize,
    group: usize,
    scale: f32,
    #[comptime] d: usize,
    #[comptime] libdevice: bool,
    #[comptime] p_shared: bool,
) {
    let head = CUBE_POS_Y as usize;
    let q0 = CUBE_POS_X as usize * comptime![QUERIES];
    let base = head * seq * d;
    let kv_base = (head / group) * seq * d;
    let q_layout = comptime![k_major(QUERIES, d)];
    let k_layout = comptime![k_major(KEYS, d)];
    let v_layout = comptime![mn_major(d, KEYS)];

    let mut smem_q = Shared::new_aligned_slice(comptime![QUERIES * d], q_layout.alignment());
    let mut smem_k = Shared::new_aligned_slice(comptime![KEYS * d], k_layout.alignment());
    let mut smem_v = Shared::new_aligned_slice(comptime![KEYS * d], v_layout.alignment());
    let q_count = min(comptime![QUERIES], seq - q0);
    stage::<E>(
        q,
        base + q0 * d,
        q_count,
        &mut smem_q,
        q_layout,
        QUERIES,
        d,
        false,
    );

    // Per unit: its two rows' running max and sum, and its share of their outputs.
    let mut state = Array::<f32>::new(4usize);
    let mut o = Array::<f32>::new(comptime![d / 2]);
    start_rows(&mut state, &mut o, d);

    let end = min(q0 + comptime![QUERIES], seq);
    let tiles = end.div_ceil(comptime![KEYS]);
    for t in 0..tiles {
        let k0 = t * comptime![KEYS];
        // Every MMA of the previous tile has read K and V (each unit waited on its own).
        sync_cube();
        let k_count = min(comptime![KEYS], seq - k0);
        stage::<E>(
            k,
            kv_base + k0 * d,
            k_count,
            &mut smem_k,
            k_layout,
            KEYS,
            d,
            false,
        );
        stage::<E>(
            v,
            kv_base + k0 * d,
            k_count,
            &mut smem_v,
            v_layout,
            KEYS,
            d,
            true,
        );
        // The units wrote through the generic proxy; the MMAs read through the async one.
        sync_async_proxy_shared();
        sync_cube();

        attend_tile::<E>(
            &smem_q, &smem_k, &smem_v, q0, k0, seq, scale, &mut state, &mut o, d, libdevice,
            p_shared,
        );
    }

    write_rows(&state, &o, out, base, q0, seq, d);
}

/// Zeroes a unit's outputs and sets its rows' running max to −∞ and sums to 0 (`state`: max of
/// its two rows, then their sums).
#[cube]
fn start_rows(state: &mut Array<f32>, o: &mut Array<f32>, #[comptime] d: usize) {
    state[0] = f32::new(f64::NEG_INFINITY);
    state[1] = f32::new(f64::NEG_INFINITY);
    state[2] = 0.0;
    state[3] = 0.0;
    #[unroll]
    for i in 0..comptime![d / 2] {
        o[i] = 0.0;
    }
}

/// Attends the cube's query tile (`smem_q`, from row `q0`) to the key tile staged in `smem_k`
/// and `smem_v` (from key `k0`): `S`, the online softmax into `state` and `o`, and `P·V` (see
/// the module documentation).
#[cube]
#[allow(clippy::too_many_arguments)]
fn attend_tile<E: Float>(
    smem_q: &[E],
    smem_k: &[E],
    smem_v: &[E],
    q0: usize,
    k0: usize,
    seq: usize,
    scale: f32,
    state: &mut Array<f32>,
    o: &mut Array<f32>,
    #[comptime] d: usize,
    #[comptime] libdevice: bool,
    #[comptime] p_shared: bool,
) {
    let q_layout = comptime![k_major(QUERIES, d)];
    let k_layout = comptime![k_major(KEYS, d)];
    let v_layout = comptime![mn_major(d, KEYS)];
    let p_layout = comptime![k_major(QUERIES, KEYS)];
    let k_step = comptime![WgmmaTileLayout::k_step(2)];
    // P's tile, with `p_shared` (one element otherwise).
    let p_len = comptime![if p_shared { QUERIES * KEYS } else { 1 }];
    let mut smem_p = Shared::<[E]>::new_aligned_slice(p_len, p_layout.alignment());
    let qd = MatrixDescriptor::new(smem_q, q_layout);
    let kd = MatrixDescriptor::new(smem_k, k_layout);
    let mut s = Accumulator::<f32>::new(comptime![KEYS]).start();
    #[unroll]
    for step in 0..comptime![d / k_step] {
        s.execute(&qd.at(0usize, step * k_step), &kd.at(0usize, step * k_step));
    }
    let s = s.wait();

    // Scores, causally masked, and each row's largest.
    let scores = comptime![KEYS / 2];
    let mut p = Array::<f32>::new(scores);
    let mut tile_max = Array::<f32>::new(2usize);
    tile_max[0] = f32::new(f64::NEG_INFINITY);
    tile_max[1] = f32::new(f64::NEG_INFINITY);
    #[unroll]
    for nth in 0..scores {
        let (row, col) = position(nth);
        let key = k0 + col;
        let mut x = s.get(nth) * scale;
        if key > q0 + row || key >= seq {
            x = f32::new(f64::NEG_INFINITY);
        }
        p[nth] = x;
        let half = (nth / 2) % 2;
        tile_max[half] = max(tile_max[half], x);
    }
    let mut correction = Array::<f32>::new(2usize);
    #[unroll]
    for half in 0..2usize {
        let m = max(state[half], quad_max(tile_max[half]));
        correction[half] = exp_of(state[half] - m, libdevice);
        state[half] = m;
    }
    let mut tile_sum = Array::<f32>::new(2usize);
    tile_sum[0] = 0.0;
    tile_sum[1] = 0.0;
    #[unroll]
    for nth in 0..scores {
        let half = (nth / 2) % 2;
        let e = exp_of(p[nth] - state[half], libdevice);
        p[nth] = e;
        tile_sum[half] += e;
    }
    #[unroll]
    for half in 0..2usize {
        state[2 + half] = state[2 + half] * correction[half] + quad_sum(tile_sum[half]);
    }

    // P·V, P from registers (the scores of each 16-key step are one fragment, in the
    // accumulator's order; one MMA at a time, since the next step's fragment may take the
    // same registers) or, with `p_shared`, from a shared tile (all four MMAs, one wait).
    let vd = MatrixDescriptor::new(smem_v, v_layout);
    let mut pv = Accumulator::<f32>::new(d).start();
    if comptime![p_shared] {
        let elem = E::size();
        #[unroll]
        for nth in 0..scores {
            let (row, col) = position(nth);
            smem_p[p_layout.offset(row, col, elem)] = E::cast_from(p[nth]);
        }
        sync_async_proxy_shared();
        sync_cube();
        let pd = MatrixDescriptor::new(&smem_p, p_layout);
        #[unroll]
        for step in 0..comptime![KEYS / k_step] {
            pv.execute(&pd.at(0usize, step * k_step), &vd.at(0usize, step * k_step));
        }
    } else {
        #[unroll]
        for step in 0..comptime![KEYS / k_step] {
            let mut fragment = Fragment::<E>::new();
            #[unroll]
            for f in 0..8usize {
                fragment.set(f, E::cast_from(p[step * 8 + f]));
            }
            pv.execute_registers(&fragment, &vd.at(0usize, step * k_step));
            pv.commit().wait();
        }
    }
    let pv = pv.wait();
    #[unroll]
    for nth in 0..comptime![d / 2] {
        let half = (nth / 2) % 2;
        o[nth] = o[nth] * correction[half] + pv.get(nth);
    }
}

/// Writes a unit's share of its rows' outputs, `o / sum`, to `out` (rows below `seq` only).
#[cube]
fn write_rows(
    state: &Array<f32>,
    o: &Array<f32>,
    out: &mut [f32],
    base: usize,
    q0: usize,
    seq: usize,
    #[comptime] d: usize,
) {
    #[unroll]
    for nth in 0..comptime![d / 2] {
        let (row, col) = position(nth);
        if q0 + row < seq {
            let half = (nth / 2) % 2;
            out[base + (q0 + row) * d + col] = o[nth] / state[2 + half];
        }
    }
}

/// Elements of a 128-byte panel of bf16/f16: the inner dimension of each TMA box.
pub const PANEL: usize = 64;

/// [`prefill_wgmma`] with its tiles loaded by TMA: `q`, `k` and `v` are tensor maps over
/// `[heads · seq, D]` (`k`, `v`: `[heads / group · seq, D]`) with boxes of 64 rows × [`PANEL`]
/// elements and the 128-byte swizzle, so that each box is one panel of a tile as the MMAs read it
/// (Q and K K-major; V's rows are keys with D contiguous: an MN-major `B` for `P·V`). Unit 0
/// issues the copies, the cube waits on one shared barrier (a phase per tile). Rows past a head's
/// end read the next head's (masked as keys, not written as queries) or TMA's zeros.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn prefill_wgmma_tma<E: Float>(
    q: &TensorMap<E, Tiled>,
    k: &TensorMap<E, Tiled>,
    v: &TensorMap<E, Tiled>,
    out: &mut [f32],
    seq: usize,
    group: usize,
    scale: f32,
    #[comptime] d: usize,
    #[comptime] libdevice: bool,
    #[comptime] p_shared: bool,
) {
    let head = CUBE_POS_Y as usize;
    let q0 = CUBE_POS_X as usize * comptime![QUERIES];
    let q_row = head * seq + q0;
    let kv_row = (head / group) * seq;
    let q_layout = comptime![k_major(QUERIES, d)];
    let k_layout = comptime![k_major(KEYS, d)];
    let v_layout = comptime![mn_major(d, KEYS)];
    let panels = comptime![d / PANEL];

    let barrier = Barrier::shared(CUBE_DIM, UNIT_POS == 0);
    sync_async_proxy_shared();
    let mut smem_q = Shared::new_aligned_slice(comptime![QUERIES * d], q_layout.alignment());
    let mut smem_k = Shared::new_aligned_slice(comptime![KEYS * d], k_layout.alignment());
    let mut smem_v = Shared::new_aligned_slice(comptime![KEYS * d], v_layout.alignment());

    let q_box = comptime![QUERIES * PANEL];
    if UNIT_POS == 0 {
        #[unroll]
        for p in 0..panels {
            barrier.tma_load_2d(
                q,
                smem_q.slice_mut(p * q_box, (p + 1) * q_box),
                q_row as i32,
                (p * comptime![PANEL]) as i32,
            );
        }
    }
    let q_bytes = comptime![(QUERIES * d * 2) as u32];
    let token = barrier.arrive_and_expect_tx(1, select(UNIT_POS == 0, q_bytes, 0));
    barrier.wait(token);

    let mut state = Array::<f32>::new(4usize);
    let mut o = Array::<f32>::new(comptime![d / 2]);
    start_rows(&mut state, &mut o, d);

    let kv_box = comptime![KEYS * PANEL];
    let kv_bytes = comptime![(2 * KEYS * d * 2) as u32];
    let end = min(q0 + comptime![QUERIES], seq);
    let tiles = end.div_ceil(comptime![KEYS]);
    for t in 0..tiles {
        let k0 = t * comptime![KEYS];
        // Every MMA of the previous tile has read K and V (each unit waited on its own).
        sync_cube();
        if UNIT_POS == 0 {
            #[unroll]
            for p in 0..panels {
                let col = (p * comptime![PANEL]) as i32;
                barrier.tma_load_2d(
                    k,
                    smem_k.slice_mut(p * kv_box, (p + 1) * kv_box),
                    (kv_row + k0) as i32,
                    col,
                );
                barrier.tma_load_2d(
                    v,
                    smem_v.slice_mut(p * kv_box, (p + 1) * kv_box),
                    (kv_row + k0) as i32,
                    col,
                );
            }
        }
        let token = barrier.arrive_and_expect_tx(1, select(UNIT_POS == 0, kv_bytes, 0));
        barrier.wait(token);
        attend_tile::<E>(
            &smem_q, &smem_k, &smem_v, q0, k0, seq, scale, &mut state, &mut o, d, libdevice,
            p_shared,
        );
    }
    write_rows(&state, &o, out, head * seq * d, q0, seq, d);
}
