//! What the two manual-MMA attention kernels share ([`super::prefill`]'s `mma` and
//! [`super::decode`]'s `mma_group`): a 16-row query tile against stages of keys on tensor cores
//! with `mma.sync.m16n8k16` (bf16/f16 inputs, f32 accumulators), scores, probabilities and
//! output accumulators in registers (the flash-attention-2 schedule).
//!
//! Fragment layout (PTX): lane `l` has `g = l / 4` and `t = l % 4`; of every 16×8 accumulator
//! tile it holds rows `g` ("row a") and `g + 8` ("row b") at columns `2t, 2t + 1`.
//! - Q: loaded once from global memory into A fragments (`D / 16` k-steps of 4 pairs each).
//! - A stage of `keys` K and V rows sits in shared memory as rows of `D / 8 + 1` 16-byte vectors
//!   (one vector of padding, so that the 8 rows an `ldmatrix` phase reads fall in distinct
//!   banks); units fetch their share of the next stage into registers while the current one is
//!   computed on, then store it ([`fetch_kv`], [`put_kv`]).
//! - `S = Q·Kᵀ`: `keys / 8` accumulator tiles; B fragments of K by `ldmatrix.x4` (two k-steps
//!   per instruction).
//! - Online softmax on the accumulators: row maxima (of the raw scores; the scale rides in each
//!   exponent's FMA) and sums meet over the 4 lanes of a row through two xor shuffles; the
//!   output accumulators are rescaled in registers, only in stages where a row maximum of the
//!   plane grew.
//! - `O += P·V`: the probabilities are re-packed from the S accumulators into A fragments
//!   directly (the accumulator layout of two 16×8 tiles is the A layout of one 16×16 tile);
//!   B fragments of V by `ldmatrix.x4.trans` (two 8-column tiles per instruction).
//!
//! The softmax state of a lane's two rows is an `Array<f32>` of 4: `[m_a, m_b, l_a, l_b]`
//! (running maxima, and this lane's share of the running sums until [`finish_row_sums`]).
//! [`StageSoftmax`] says how the exponentials and the causal masks are computed.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;

use super::kv_cache::cache_row;
use super::kv_read::{KvRead, load_as};
use crate::fast_exp::{FAST_EXP_LOWERED, LOG2_E, exp2_approx};
use crate::knobs::Knobs;

/// How a stage's softmax is computed. Per score it costs the scale's FMA, the exponential, the
/// maximum and the sum, plus the causal mask's compare and select where one applies: at head
/// dim 64 that, not the two MMAs, bounds the kernels (an accurate `expf` is eight instructions).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StageSoftmax {
    /// Exponentials by PTX `ex2.approx` on log₂-scaled scores ([`crate::fast_exp`]) instead of
    /// libdevice's `expf`.
    pub fast_exp: bool,
    /// Masks applied only in stages that reach past some row's causal limit (a plane vote; the
    /// others hold only visible keys), instead of in every stage.
    pub masks_where_needed: bool,
}

impl StageSoftmax {
    /// The fast form where this build lowers it; `BURN_NANOVLLM_SOFTMAX_EXP=exact` and
    /// `BURN_NANOVLLM_SOFTMAX_MASK=all` pick the reference parts, for benchmarks.
    pub fn from_knobs() -> Self {
        let knobs = Knobs::get();
        Self {
            fast_exp: FAST_EXP_LOWERED && !knobs.softmax_exact_exp,
            masks_where_needed: !knobs.softmax_mask_all,
        }
    }
}

/// Shape of a K/V stage and of the units that fill it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvStage {
    /// Keys per stage, a multiple of 16.
    pub keys: usize,
    /// Units sharing the loads of a stage.
    pub units: usize,
    pub head_dim: usize,
    pub kv_heads: usize,
    /// How each stage's softmax is computed.
    pub softmax: StageSoftmax,
}

impl KvStage {
    /// Row stride of a stage in 16-byte vectors (one of padding).
    pub fn row_stride(&self) -> usize {
        self.head_dim / 8 + 1
    }

    /// One stage, in 16-byte vectors.
    pub fn len(&self) -> usize {
        self.keys * self.row_stride()
    }

    /// Vectors each unit loads per stage (and register slots for them).
    pub fn per_unit(&self) -> usize {
        (self.keys * self.head_dim / 8).div_ceil(self.units)
    }
}

/// Loads unit `unit`'s share of the K and V rows of keys `k0 .. k0 + keys` of kv head `kvh`
/// into registers, as stored (`KV`: FP8 stays 8 bits until [`put_kv`]): vector `unit +
/// units·i` of the stage goes to slot `i` of `kr`/`vr`; zeros for keys from `end` on.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn fetch_kv<KV: Float, NV: Size>(
    k_cache: &Tensor<Vector<KV, NV>>,
    v_cache: &Tensor<Vector<KV, NV>>,
    block_tables: &Tensor<i32>,
    table_row: usize,
    #[comptime] block_size: usize,
    kvh: usize,
    k0: usize,
    end: usize,
    unit: usize,
    kr: &mut Array<Vector<KV, NV>>,
    vr: &mut Array<Vector<KV, NV>>,
    #[comptime] st: KvStage,
) {
    let dv = comptime!(st.head_dim / 8);
    let total = comptime!(st.keys * st.head_dim / 8);
    // Every slot holds a vector of the stage: no bound to check.
    let exact = comptime!(total.is_multiple_of(st.units));
    let zero = Vector::<KV, NV>::cast_from(Vector::<f32, NV>::new(0.0));
    #[unroll]
    for i in 0..comptime!(st.per_unit()) {
        let idx = i * comptime!(st.units) + unit;
        let key = k0 + idx / dv;
        let mut kv = zero;
        let mut vv = zero;
        if key < end && (exact || idx < total) {
            let block = block_tables[table_row + key / block_size] as usize;
            let at =
                cache_row(block, key % block_size, kvh, st.kv_heads, block_size) * dv + idx % dv;
            kv = k_cache[at];
            vv = v_cache[at];
        }
        kr[i] = kv;
        vr[i] = vv;
    }
}

/// Stores what [`fetch_kv`] loaded into the stage at `offset` (in vectors) of `k_s` / `v_s`,
/// as `F` (an FP8 cache's values unscaled: the callers fold the scales into the scores' scale
/// and the output).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn put_kv<F: Float, KV: Float, NV: Size>(
    k_s: &mut Shared<[Vector<F, NV>]>,
    v_s: &mut Shared<[Vector<F, NV>]>,
    offset: usize,
    unit: usize,
    kr: &Array<Vector<KV, NV>>,
    vr: &Array<Vector<KV, NV>>,
    #[comptime] kv: KvRead,
    #[comptime] st: KvStage,
) {
    let dv = comptime!(st.head_dim / 8);
    let total = comptime!(st.keys * st.head_dim / 8);
    // Every slot holds a vector of the stage: no bound to check.
    let exact = comptime!(total.is_multiple_of(st.units));
    #[unroll]
    for i in 0..comptime!(st.per_unit()) {
        let idx = i * comptime!(st.units) + unit;
        if exact || idx < total {
            let at = offset + (idx / dv) * (dv + 1) + idx % dv;
            k_s[at] = load_as::<KV, F, NV>(kr[i], kv);
            v_s[at] = load_as::<KV, F, NV>(vr[i], kv);
        }
    }
}

/// The double-buffered K/V stream of both kernels: stages of `st.keys` keys starting at
/// `first, first + stride, …` below `end`, attended to ([`attend_stage`]) in turn by the Q tile
/// `qa`, while unit `unit`'s share of the next stage is in flight in registers ([`fetch_kv`])
/// and stored after the compute ([`put_kv`]) into the other half of this stream's two stages at
/// vector `own` of the shared K/V slices (`shared_len` vectors each, allocated here for the
/// cube). An FP8 cache (`KV`) is stored in the stages as its unscaled values: the caller passes
/// the key scale inside `scale` and multiplies the output by the value scale. `plane_stream`: the stream belongs to one plane (its barriers are plane barriers;
/// decode, one stream per plane), else to the cube (prefill).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn attend_kv_stream<F: Float, KV: Float, NV: Size, NP: Size>(
    k_cache: &Tensor<Vector<KV, NV>>,
    v_cache: &Tensor<Vector<KV, NV>>,
    #[comptime] kv: KvRead,
    block_tables: &Tensor<i32>,
    table_row: usize,
    #[comptime] block_size: usize,
    kvh: usize,
    qa: &Array<Vector<F, NP>>,
    o: &mut Array<Vector<f32, NP>>,
    state: &mut Array<f32>,
    first: usize,
    end: usize,
    own: usize,
    unit: usize,
    limit_a: usize,
    limit_b: usize,
    scale: f32,
    #[comptime] st: KvStage,
    #[comptime] stride: usize,
    #[comptime] shared_len: usize,
    #[comptime] plane_stream: bool,
) {
    let stage_len = comptime!(st.len());
    let mut k_s = Shared::<[Vector<F, NV>]>::new_aligned_slice(shared_len, 16usize);
    let mut v_s = Shared::<[Vector<F, NV>]>::new_aligned_slice(shared_len, 16usize);
    let mut kr = Array::<Vector<KV, NV>>::new(comptime!(st.per_unit()));
    let mut vr = Array::<Vector<KV, NV>>::new(comptime!(st.per_unit()));
    fetch_kv(
        k_cache,
        v_cache,
        block_tables,
        table_row,
        block_size,
        kvh,
        first,
        end,
        unit,
        &mut kr,
        &mut vr,
        st,
    );
    put_kv::<F, KV, NV>(&mut k_s, &mut v_s, own, unit, &kr, &vr, kv, st);
    stream_barrier(plane_stream);
    let mut k0 = first;
    let mut buf = 0usize;
    while k0 < end {
        let next = k0 + stride;
        let has_next = next < end;
        if has_next {
            fetch_kv(
                k_cache,
                v_cache,
                block_tables,
                table_row,
                block_size,
                kvh,
                next,
                end,
                unit,
                &mut kr,
                &mut vr,
                st,
            );
        }
        attend_stage(
            &k_s,
            &v_s,
            own + buf * stage_len,
            qa,
            o,
            state,
            k0,
            limit_a,
            limit_b,
            scale,
            st.keys,
            st.head_dim,
            shared_len,
            st.softmax,
        );
        if has_next {
            put_kv::<F, KV, NV>(
                &mut k_s,
                &mut v_s,
                own + (1 - buf) * stage_len,
                unit,
                &kr,
                &vr,
                kv,
                st,
            );
        }
        stream_barrier(plane_stream);
        buf = 1 - buf;
        k0 = next;
    }
}

/// The barrier of a K/V stream's units: the plane's or the cube's.
#[cube]
fn stream_barrier(#[comptime] plane_stream: bool) {
    if comptime!(plane_stream) {
        sync_plane();
    } else {
        sync_cube();
    }
}

/// Loads this lane's A fragments of Q as `M` (the MMA's input type; `q`'s own `F` or f16):
/// rows a and b start at `at_a` / `at_b` in `q` (zeros for an invalid row); pair `e` of k-step
/// `s` is at columns `16s + 2t + 8·(e / 2)` of row a (`e` even) or b (`e` odd). `qa` has
/// `4·D / 16` slots.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn load_q_fragments<F: Float, M: Float, NP: Size>(
    q: &Tensor<F>,
    at_a: usize,
    at_b: usize,
    valid_a: bool,
    valid_b: bool,
    qa: &mut Array<Vector<M, NP>>,
    #[comptime] head_dim: usize,
) {
    let t = UNIT_POS_PLANE as usize % 4;
    #[unroll]
    for s in 0..comptime!(head_dim / 16) {
        #[unroll]
        for e in 0..4usize {
            let col = s * 16 + 2 * t + 8 * (e / 2);
            let mut pair = Vector::<M, NP>::new(M::new(0.0));
            if e % 2 == 0 {
                if valid_a {
                    pair.insert(0usize, M::cast_from(q[at_a + col]));
                    pair.insert(1usize, M::cast_from(q[at_a + col + 1]));
                }
            } else if valid_b {
                pair.insert(0usize, M::cast_from(q[at_b + col]));
                pair.insert(1usize, M::cast_from(q[at_b + col + 1]));
            }
            qa[s * 4 + e] = pair;
        }
    }
}

/// Zeroes the output accumulators (`2·D / 8` slots: tile `j`'s row a at `2j`, row b at
/// `2j + 1`) and starts the softmax state `[m_a, m_b, l_a, l_b]` at `[-∞, -∞, 0, 0]`.
#[cube]
pub fn start_rows<NP: Size>(
    o: &mut Array<Vector<f32, NP>>,
    state: &mut Array<f32>,
    #[comptime] head_dim: usize,
) {
    #[unroll]
    for i in 0..comptime!(2 * head_dim / 8) {
        o[i] = Vector::new(0.0);
    }
    state[0] = f32::new(f32::NEG_INFINITY);
    state[1] = f32::new(f32::NEG_INFINITY);
    state[2] = 0.0;
    state[3] = 0.0;
}

/// The B fragments of key tile `j` (8 keys) for the `kx4` pairs of full k-steps of `Q·Kᵀ`, by
/// `ldmatrix.x4` from `k_lane`, this lane's row of the stage (rows of `rs` vectors): pair `s2`'s
/// four registers at `kf[4·s2 ..]`. The offsets from the lane's row are constants, so they fold
/// into the instruction's address.
#[cube]
fn load_k_tile<F: Float, NV: Size, NP: Size>(
    k_lane: &[Vector<F, NV>],
    #[comptime] j: usize,
    #[comptime] rs: usize,
    kf: &mut Array<Vector<F, NP>>,
    #[comptime] kx4: usize,
) {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    #[unroll]
    for s2 in 0..kx4 {
        let frags = def.load_matrix::<Vector<F, NV>, NP>(
            &k_lane[j * 8 * rs + 4 * s2..],
            MatrixIdent::B,
            4usize,
            false,
        );
        #[unroll]
        for e in 0..4usize {
            kf[4 * s2 + e] = frags[e];
        }
    }
}

/// One stage: keys `k0 .. k0 + keys`, at vector `off` of `k_s` / `v_s` (slices of `len`
/// vectors), against the Q tile `qa`. Scores are scaled by `scale`; keys at or past `limit_a`
/// (row a) or `limit_b` (row b) are masked (0 masks a padding row). Updates the softmax state
/// (maxima of scaled scores) and the output accumulators `o`; `softmax` picks the form.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn attend_stage<F: Float, NV: Size, NP: Size>(
    k_s: &Shared<[Vector<F, NV>]>,
    v_s: &Shared<[Vector<F, NV>]>,
    off: usize,
    qa: &Array<Vector<F, NP>>,
    o: &mut Array<Vector<f32, NP>>,
    state: &mut Array<f32>,
    k0: usize,
    limit_a: usize,
    limit_b: usize,
    scale: f32,
    #[comptime] keys: usize,
    #[comptime] head_dim: usize,
    #[comptime] len: usize,
    #[comptime] softmax: StageSoftmax,
) {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let lane = UNIT_POS_PLANE as usize;
    let t = lane % 4;
    let lrow = lane % 8; // ldmatrix: the row this lane addresses
    let lmat = lane / 8; // and of which matrix
    let rs = comptime!(head_dim / 8 + 1);
    let ntiles = comptime!(keys / 8);
    let neg_inf = f32::new(f32::NEG_INFINITY);
    let mut s_acc = Array::<Vector<f32, NP>>::new(comptime!(2 * keys / 8));

    // S = Q·Kᵀ, 8 keys per accumulator tile. One `ldmatrix.x4` gives the B fragments of two
    // k-steps: lane `l` addresses key row `l % 8` of the tile at column vector `2·s + l / 8`.
    // Tile `j + 1`'s fragments are loaded before tile `j`'s products, so that the products do
    // not wait on shared memory (measured stalled on it at head dim 128, two planes per
    // scheduler).
    let kx4 = comptime!(head_dim / 32);
    // This lane's `ldmatrix` row of the stage: key row `l % 8` of a tile, column vector `l / 8`.
    let k_lane = &k_s[off + lrow * rs + lmat..len];
    let mut kf = Array::<Vector<F, NP>>::new(comptime!(4 * kx4.max(1)));
    load_k_tile::<F, NV, NP>(k_lane, 0usize, rs, &mut kf, kx4);
    #[unroll]
    for j in 0..ntiles {
        let mut kn = Array::<Vector<F, NP>>::new(comptime!(4 * kx4.max(1)));
        if j + 1 < ntiles {
            load_k_tile::<F, NV, NP>(k_lane, j + 1, rs, &mut kn, kx4);
        }
        let mut c = Array::<Vector<f32, NP>>::new(2usize);
        c[0] = Vector::new(0.0);
        c[1] = Vector::new(0.0);
        #[unroll]
        for s2 in 0..kx4 {
            #[unroll]
            for h2 in 0..2usize {
                let s = 2 * s2 + h2;
                let mut a = Array::<Vector<F, NP>>::new(4usize);
                #[unroll]
                for e in 0..4usize {
                    a[e] = qa[s * 4 + e];
                }
                let mut b = Array::<Vector<F, NP>>::new(2usize);
                b[0] = kf[4 * s2 + 2 * h2];
                b[1] = kf[4 * s2 + 2 * h2 + 1];
                def.execute_inplace(&a, &b, &mut c);
            }
        }
        if comptime!(!head_dim.is_multiple_of(32)) {
            // The last k-step alone (D = 16 × odd): two matrices.
            let s = comptime!(head_dim / 16 - 1);
            let at = off + (j * 8 + lrow) * rs + 2 * s + lmat % 2;
            let frags =
                def.load_matrix::<Vector<F, NV>, NP>(&k_s[at..len], MatrixIdent::B, 2usize, false);
            let mut a = Array::<Vector<F, NP>>::new(4usize);
            #[unroll]
            for e in 0..4usize {
                a[e] = qa[s * 4 + e];
            }
            let mut b = Array::<Vector<F, NP>>::new(2usize);
            b[0] = frags[0];
            b[1] = frags[1];
            def.execute_inplace(&a, &b, &mut c);
        }
        s_acc[2 * j] = c[0];
        s_acc[2 * j + 1] = c[1];
        if j + 1 < ntiles {
            #[unroll]
            for i in 0..comptime!(4 * kx4) {
                kf[i] = kn[i];
            }
        }
    }

    // Online softmax on the raw scores (the scale is positive, so it keeps their order): mask
    // (only in a stage that reaches past some row's limit, where `masks_where_needed`), row
    // maxima over the 4 lanes of a row; the scale enters once per row maximum and in each
    // exponent's FMA, `exp(s·scale − m)` (as `2^(s·scale·log₂e − m·log₂e)` with `fast_exp`).
    let stage_end = k0 + keys;
    let visible = stage_end <= limit_a && stage_end <= limit_b;
    if !comptime!(softmax.masks_where_needed) || !plane_all(visible) {
        #[unroll]
        for j in 0..ntiles {
            let mut va = s_acc[2 * j];
            let mut vb = s_acc[2 * j + 1];
            #[unroll]
            for e in 0..2usize {
                let key = k0 + j * 8 + 2 * t + e;
                va.insert(e, select(key >= limit_a, neg_inf, va.extract(e)));
                vb.insert(e, select(key >= limit_b, neg_inf, vb.extract(e)));
            }
            s_acc[2 * j] = va;
            s_acc[2 * j + 1] = vb;
        }
    }
    let mut mx_a = neg_inf;
    let mut mx_b = neg_inf;
    #[unroll]
    for j in 0..ntiles {
        let va = s_acc[2 * j];
        let vb = s_acc[2 * j + 1];
        #[unroll]
        for e in 0..2usize {
            mx_a = max(mx_a, va.extract(e));
            mx_b = max(mx_b, vb.extract(e));
        }
    }
    mx_a = max(mx_a, plane_shuffle_xor(mx_a, 1u32));
    mx_a = max(mx_a, plane_shuffle_xor(mx_a, 2u32));
    mx_b = max(mx_b, plane_shuffle_xor(mx_b, 1u32));
    mx_b = max(mx_b, plane_shuffle_xor(mx_b, 2u32));
    let (m_a, m_b) = (state[0], state[1]);
    let new_a = max(m_a, mx_a * scale);
    let new_b = max(m_b, mx_b * scale);
    // A row with no key yet (maximum −∞) has only masked scores: offset 0 keeps their
    // exponents at −∞ (probability 0) instead of −∞ + ∞.
    // In log₂ units with `fast_exp` (one FMA and one `ex2` a score).
    let unit = comptime!(if softmax.fast_exp { LOG2_E } else { 1.0 });
    let exp_scale = scale * unit;
    let off_a = select(new_a == neg_inf, 0.0, -new_a * unit);
    let off_b = select(new_b == neg_inf, 0.0, -new_b * unit);
    let mut sum_a = 0.0f32;
    let mut sum_b = 0.0f32;
    #[unroll]
    for j in 0..ntiles {
        let mut va = s_acc[2 * j];
        let mut vb = s_acc[2 * j + 1];
        #[unroll]
        for e in 0..2usize {
            let pa = stage_exp(fma(va.extract(e), exp_scale, off_a), softmax);
            let pb = stage_exp(fma(vb.extract(e), exp_scale, off_b), softmax);
            sum_a += pa;
            sum_b += pb;
            va.insert(e, pa);
            vb.insert(e, pb);
        }
        s_acc[2 * j] = va;
        s_acc[2 * j + 1] = vb;
    }
    // Rescale the running sums and outputs only when a row maximum of the plane grew: the
    // factor of an unchanged row is exp(0) = 1, so skipping it changes nothing, and after the
    // first stages most maxima stay put (64 multiplies and two exponentials a stage at
    // head dim 128).
    if plane_any(new_a > m_a || new_b > m_b) {
        let corr_a = select(
            m_a == neg_inf,
            0.0,
            stage_exp((m_a - new_a) * unit, softmax),
        );
        let corr_b = select(
            m_b == neg_inf,
            0.0,
            stage_exp((m_b - new_b) * unit, softmax),
        );
        state[2] *= corr_a;
        state[3] *= corr_b;
        #[unroll]
        for j in 0..comptime!(head_dim / 8) {
            o[2 * j] *= Vector::new(corr_a);
            o[2 * j + 1] *= Vector::new(corr_b);
        }
    }
    state[0] = new_a;
    state[1] = new_b;
    // This lane's columns; summed over the row's lanes by `finish_row_sums`.
    state[2] += sum_a;
    state[3] += sum_b;

    // O += P·V, 16 keys per k-step; P's A fragment is two S tiles re-packed. One
    // `ldmatrix.x4.trans` gives the B fragments of two 8-column tiles: lane `l` addresses key
    // row `16·s + 8·(l / 8 % 2) + l % 8` at column vector `2·j2 + l / 16`; the next pair's are
    // loaded before this pair's products (as for `Q·Kᵀ`).
    let vx4 = comptime!(head_dim / 16);
    // This lane's row of the V stage (offsets from it are constants, as for K).
    let v_lane = &v_s[off + ((lmat % 2) * 8 + lrow) * rs + lmat / 2..len];
    #[unroll]
    for s in 0..comptime!(keys / 16) {
        let mut a = Array::<Vector<F, NP>>::new(4usize);
        #[unroll]
        for e in 0..4usize {
            a[e] = Vector::<F, NP>::cast_from(s_acc[4 * s + e]);
        }
        let row = s * 16 * rs;
        let mut vf =
            def.load_matrix::<Vector<F, NV>, NP>(&v_lane[row..], MatrixIdent::B, 4usize, true);
        #[unroll]
        for j2 in 0..vx4 {
            let mut vn = Array::<Vector<F, NP>>::new(4usize);
            if j2 + 1 < vx4 {
                let next = def.load_matrix::<Vector<F, NV>, NP>(
                    &v_lane[row + 2 * (j2 + 1)..],
                    MatrixIdent::B,
                    4usize,
                    true,
                );
                #[unroll]
                for e in 0..4usize {
                    vn[e] = next[e];
                }
            }
            #[unroll]
            for h2 in 0..2usize {
                let j = 2 * j2 + h2;
                let mut b = Array::<Vector<F, NP>>::new(2usize);
                b[0] = vf[2 * h2];
                b[1] = vf[2 * h2 + 1];
                let mut c = Array::<Vector<f32, NP>>::new(2usize);
                c[0] = o[2 * j];
                c[1] = o[2 * j + 1];
                def.execute_inplace(&a, &b, &mut c);
                o[2 * j] = c[0];
                o[2 * j + 1] = c[1];
            }
            if j2 + 1 < vx4 {
                #[unroll]
                for e in 0..4usize {
                    vf[e] = vn[e];
                }
            }
        }
    }
}

/// The softmax's exponential: `2ˣ` with `fast_exp` (the caller scaled by log₂ e), else `eˣ`.
#[cube]
fn stage_exp(x: f32, #[comptime] softmax: StageSoftmax) -> f32 {
    if comptime!(softmax.fast_exp) {
        exp2_approx(x)
    } else {
        f32::exp(x)
    }
}

/// Sums each row's running sum (`state[2]`, `state[3]`) over the 4 lanes of the row.
#[cube]
pub fn finish_row_sums(state: &mut Array<f32>) {
    #[unroll]
    for r in 2..4usize {
        let mut l = state[r];
        l += plane_shuffle_xor(l, 1u32);
        l += plane_shuffle_xor(l, 2u32);
        state[r] = l;
    }
}
