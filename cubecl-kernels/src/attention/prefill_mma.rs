//! Prefill attention on tensor cores with registers managed by hand (`mma.sync.m16n8k16`, bf16 or
//! f16 inputs, f32 accumulators): the flash-attention-2 schedule, where scores, probabilities and
//! output accumulators never leave registers.
//!
//! Launch geometry: one cube per (`16·R`-query tile, kv head, group of `H` of its query heads),
//! with `H × R` planes of 32 lanes; plane `p` owns query rows `16·(p % R) .. + 16` of head
//! `p / R`, so the `H` heads share every K/V stage (`H` = the whole GQA group up to 8). Lane `l`
//! has `g = l / 4` and `t = l % 4`; per the PTX fragment layouts it holds, of every 16×8
//! accumulator tile, rows `g` and `g + 8` at columns `2t, 2t + 1`.
//! - Q: loaded once from global memory into A fragments (`D / 16` of them, 4 bf16 pairs each).
//! - K/V stages of `block_k` keys, double-buffered in shared memory as `[block_k][D + 8]`
//!   (16-byte rows padded by one vector so that the 8 rows an `ldmatrix` phase reads fall in
//!   distinct banks): while a stage is computed on, every unit's 16-byte global loads of the next
//!   one are in flight in registers; they are stored after the compute, one barrier per stage.
//! - `S = Q·Kᵀ`: `block_k / 8` accumulator tiles per plane; B fragments of K by `ldmatrix.x4`
//!   (two k-steps per instruction).
//! - Online softmax on the accumulators: row maxima and sums meet over the 4 lanes of a row
//!   through two xor shuffles; the output accumulators are rescaled in registers.
//! - `O += P·V`: the probabilities are re-packed from the S accumulators into A fragments
//!   directly (the accumulator layout of two 16×8 tiles is the A layout of one 16×16 tile);
//!   B fragments of V by `ldmatrix.x4.trans` (two 8-column tiles per instruction).
//!
//! CUDA only (the fragment layout above is NVIDIA's): the launcher takes it where the device
//! offers manual 16×8×16 MMA for the dtype and planes of 32.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;

/// Comptime part of the launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmaPrefillConfig {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Keys per stage, a multiple of 16.
    pub block_k: usize,
    /// Query heads of one kv head that a cube serves (they share its K/V stages).
    pub heads_per_cube: usize,
    /// 16-row blocks of queries per head; planes = `heads_per_cube × row_blocks`.
    pub row_blocks: usize,
}

impl MmaPrefillConfig {
    /// Queries per cube and head.
    pub fn block_q(&self) -> usize {
        16 * self.row_blocks
    }

    /// Planes per cube.
    pub fn planes(&self) -> usize {
        self.heads_per_cube * self.row_blocks
    }

    /// Units per cube.
    pub fn units(&self) -> usize {
        32 * self.planes()
    }

    /// Cubes per (query tile, kv head).
    pub fn cubes_per_kv_head(&self) -> usize {
        self.heads / self.kv_heads / self.heads_per_cube
    }

    /// Shared memory of one cube in bytes (two K and two V stages), for elements of
    /// `elem_bytes`.
    pub fn shared_bytes(&self, elem_bytes: usize) -> usize {
        4 * elem_bytes * self.block_k * (self.head_dim + 8)
    }
}

/// Loads this unit's share of the K and V rows of keys `k0 .. k0 + block_k` into registers
/// (16-byte vectors; zeros past `last_key`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_stage<F: Float, NV: Size>(
    k_cache: &Tensor<Vector<F, NV>>,
    v_cache: &Tensor<Vector<F, NV>>,
    block_tables: &Tensor<i32>,
    table_row: usize,
    block_size: usize,
    kvh: usize,
    k0: usize,
    last_key: usize,
    kr: &mut Array<Vector<F, NV>>,
    vr: &mut Array<Vector<F, NV>>,
    #[comptime] cfg: MmaPrefillConfig,
) {
    let dv = comptime!(cfg.head_dim / 8);
    let total = comptime!(cfg.block_k * cfg.head_dim / 8);
    #[unroll]
    for i in 0..comptime!(total.div_ceil(cfg.units())) {
        let idx = i * comptime!(cfg.units()) + UNIT_POS_X as usize;
        let key = k0 + idx / dv;
        let mut kv = Vector::<F, NV>::new(F::new(0.0));
        let mut vv = Vector::<F, NV>::new(F::new(0.0));
        if key < last_key && idx < total {
            let block = block_tables[table_row + key / block_size] as usize;
            let at = ((block * block_size + key % block_size) * cfg.kv_heads + kvh) * dv + idx % dv;
            kv = k_cache[at];
            vv = v_cache[at];
        }
        kr[i] = kv;
        vr[i] = vv;
    }
}

/// Stores what [`fetch_stage`] loaded into the stage at `offset` (rows of `D / 8 + 1` vectors).
#[cube]
fn put_stage<F: Float, NV: Size>(
    k_s: &mut Shared<[Vector<F, NV>]>,
    v_s: &mut Shared<[Vector<F, NV>]>,
    offset: usize,
    kr: &Array<Vector<F, NV>>,
    vr: &Array<Vector<F, NV>>,
    #[comptime] cfg: MmaPrefillConfig,
) {
    let dv = comptime!(cfg.head_dim / 8);
    let total = comptime!(cfg.block_k * cfg.head_dim / 8);
    #[unroll]
    for i in 0..comptime!(total.div_ceil(cfg.units())) {
        let idx = i * comptime!(cfg.units()) + UNIT_POS_X as usize;
        if idx < total {
            let at = offset + (idx / dv) * (dv + 1) + idx % dv;
            k_s[at] = kr[i];
            v_s[at] = vr[i];
        }
    }
}

/// See the module documentation. `k_cache`, `v_cache` are read in vectors of `NV` elements.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill_mma<F: Float, NV: Size>(
    q: &Tensor<F>,
    k_cache: &Tensor<Vector<F, NV>>,
    v_cache: &Tensor<Vector<F, NV>>,
    block_tables: &Tensor<i32>,
    context_lens: &Tensor<i32>,
    cu_seqlens_q: &Tensor<i32>,
    tiles: &Tensor<i32>,
    out: &mut Tensor<F>,
    scale: f32,
    block_size: usize,
    #[comptime] cfg: MmaPrefillConfig,
    #[define(F)] _dtype: ElemType,
) {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let size!(NP) = def.vector_size(MatrixIdent::A);
    let tile = CUBE_POS_X as usize;
    let plane = PLANE_POS as usize;
    let hgroups = comptime!(cfg.cubes_per_kv_head());
    let kvh = CUBE_POS_Y as usize / hgroups;
    let h = kvh * comptime!(cfg.heads / cfg.kv_heads)
        + (CUBE_POS_Y as usize % hgroups) * cfg.heads_per_cube
        + plane / cfg.row_blocks;
    let lane = UNIT_POS_PLANE as usize;
    let g = lane / 4;
    let t = lane % 4;
    let bk = cfg.block_k;
    let ksteps = comptime!(cfg.head_dim / 16); // k-steps of Q·Kᵀ
    let ntiles = comptime!(cfg.block_k / 8); // 8-key tiles of S
    let dtiles = comptime!(cfg.head_dim / 8); // 8-column tiles of O
    let rs = comptime!(cfg.head_dim / 8 + 1); // stage row stride in vectors
    let seq = tiles[tile * 2] as usize;
    let q0 = tiles[tile * 2 + 1] as usize;
    let q_start = cu_seqlens_q[seq] as usize;
    let q_len = cu_seqlens_q[seq + 1] as usize - q_start;
    let ctx = context_lens[seq] as usize;
    let prefix = ctx - q_len;
    let rows = min(q_len - q0, comptime!(cfg.block_q()));
    let last_key = prefix + q0 + rows;
    let table_row = seq * block_tables.stride(0);

    // Two K and two V stages, each `[block_k][D / 8 + 1]` 16-byte vectors (one vector of padding
    // per row): stage `i + 1` is fetched while stage `i` is computed on.
    let stage_len = comptime!(cfg.block_k * (cfg.head_dim / 8 + 1));
    let mut k_s = Shared::<[Vector<F, NV>]>::new_aligned_slice(comptime!(2 * stage_len), 16usize);
    let mut v_s = Shared::<[Vector<F, NV>]>::new_aligned_slice(comptime!(2 * stage_len), 16usize);
    let per_unit = comptime!((cfg.block_k * cfg.head_dim / 8).div_ceil(cfg.units()));
    let mut kr = Array::<Vector<F, NV>>::new(per_unit);
    let mut vr = Array::<Vector<F, NV>>::new(per_unit);

    // This lane's rows of the tile, and their positions in the sequence.
    let row_a = (plane % cfg.row_blocks) * 16 + g;
    let row_b = row_a + 8;
    let pos_a = prefix + q0 + row_a;
    let pos_b = prefix + q0 + row_b;
    let valid_a = row_a < rows;
    let valid_b = row_b < rows;

    // Q as A fragments: pair e of k-step s at (row g + 8·(e % 2), cols 16s + 2t + 8·(e / 2)).
    let mut qa = Array::<Vector<F, NP>>::new(comptime!(4 * cfg.head_dim / 16));
    let at_a = (q_start + q0 + row_a) * q.stride(0) + h * q.stride(1);
    let at_b = (q_start + q0 + row_b) * q.stride(0) + h * q.stride(1);
    #[unroll]
    for s in 0..ksteps {
        #[unroll]
        for e in 0..4usize {
            let col = s * 16 + 2 * t + 8 * (e / 2);
            let mut pair = Vector::<F, NP>::new(F::new(0.0));
            if e % 2 == 0 {
                if valid_a {
                    pair.insert(0usize, q[at_a + col]);
                    pair.insert(1usize, q[at_a + col + 1]);
                }
            } else if valid_b {
                pair.insert(0usize, q[at_b + col]);
                pair.insert(1usize, q[at_b + col + 1]);
            }
            qa[s * 4 + e] = pair;
        }
    }

    // Output accumulators: tile j's pair 0 is row g, pair 1 row g + 8 (columns 8j + 2t, +1).
    let mut o = Array::<Vector<f32, NP>>::new(comptime!(2 * cfg.head_dim / 8));
    #[unroll]
    for i in 0..comptime!(2 * cfg.head_dim / 8) {
        o[i] = Vector::new(0.0);
    }
    let mut s_acc = Array::<Vector<f32, NP>>::new(comptime!(2 * cfg.block_k / 8));
    let mut m_a = f32::new(f32::NEG_INFINITY);
    let mut m_b = f32::new(f32::NEG_INFINITY);
    let mut l_a = 0.0f32;
    let mut l_b = 0.0f32;
    let neg_inf = f32::new(f32::NEG_INFINITY);
    let lrow = lane % 8; // ldmatrix: the row this unit addresses
    let lmat = lane / 8; // and of which matrix

    fetch_stage(
        k_cache,
        v_cache,
        block_tables,
        table_row,
        block_size,
        kvh,
        0,
        last_key,
        &mut kr,
        &mut vr,
        cfg,
    );
    put_stage(&mut k_s, &mut v_s, 0, &kr, &vr, cfg);
    sync_cube();
    let mut k0 = 0usize;
    let mut buf = 0usize;
    while k0 < last_key {
        let next = k0 + bk;
        let has_next = next < last_key;
        if has_next {
            fetch_stage(
                k_cache,
                v_cache,
                block_tables,
                table_row,
                block_size,
                kvh,
                next,
                last_key,
                &mut kr,
                &mut vr,
                cfg,
            );
        }
        let off = buf * stage_len;

        // S = Q·Kᵀ, 8 keys per accumulator tile. One `ldmatrix.x4` gives the B fragments of two
        // k-steps: unit `l` addresses key row `l % 8` of the tile at column vector `2·s + l / 8`.
        #[unroll]
        for j in 0..ntiles {
            let mut c = Array::<Vector<f32, NP>>::new(2usize);
            c[0] = Vector::new(0.0);
            c[1] = Vector::new(0.0);
            #[unroll]
            for s2 in 0..comptime!(cfg.head_dim / 32) {
                let at = off + (j * 8 + lrow) * rs + 4 * s2 + lmat;
                let frags = def.load_matrix::<Vector<F, NV>, NP>(
                    &k_s[at..comptime!(2 * stage_len)],
                    MatrixIdent::B,
                    4usize,
                    false,
                );
                #[unroll]
                for h2 in 0..2usize {
                    let s = 2 * s2 + h2;
                    let mut a = Array::<Vector<F, NP>>::new(4usize);
                    #[unroll]
                    for e in 0..4usize {
                        a[e] = qa[s * 4 + e];
                    }
                    let mut b = Array::<Vector<F, NP>>::new(2usize);
                    b[0] = frags[2 * h2];
                    b[1] = frags[2 * h2 + 1];
                    def.execute_inplace(&a, &b, &mut c);
                }
            }
            if comptime!(!cfg.head_dim.is_multiple_of(32)) {
                // The last k-step alone (D = 16 × odd): two matrices.
                let s = comptime!(cfg.head_dim / 16 - 1);
                let at = off + (j * 8 + lrow) * rs + 2 * s + lmat % 2;
                let frags = def.load_matrix::<Vector<F, NV>, NP>(
                    &k_s[at..comptime!(2 * stage_len)],
                    MatrixIdent::B,
                    2usize,
                    false,
                );
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
        }

        // Online softmax: mask, row maxima over the 4 lanes of a row.
        let mut mx_a = neg_inf;
        let mut mx_b = neg_inf;
        #[unroll]
        for j in 0..ntiles {
            let mut va = s_acc[2 * j];
            let mut vb = s_acc[2 * j + 1];
            #[unroll]
            for e in 0..2usize {
                let key = k0 + j * 8 + 2 * t + e;
                let sa = select(key > pos_a || !valid_a, neg_inf, va.extract(e) * scale);
                let sb = select(key > pos_b || !valid_b, neg_inf, vb.extract(e) * scale);
                va.insert(e, sa);
                vb.insert(e, sb);
                mx_a = max(mx_a, sa);
                mx_b = max(mx_b, sb);
            }
            s_acc[2 * j] = va;
            s_acc[2 * j + 1] = vb;
        }
        mx_a = max(mx_a, plane_shuffle_xor(mx_a, 1u32));
        mx_a = max(mx_a, plane_shuffle_xor(mx_a, 2u32));
        mx_b = max(mx_b, plane_shuffle_xor(mx_b, 1u32));
        mx_b = max(mx_b, plane_shuffle_xor(mx_b, 2u32));
        let new_a = max(m_a, mx_a);
        let new_b = max(m_b, mx_b);
        let live_a = new_a != neg_inf;
        let live_b = new_b != neg_inf;
        let corr_a = select(m_a == neg_inf, 0.0, f32::exp(m_a - new_a));
        let corr_b = select(m_b == neg_inf, 0.0, f32::exp(m_b - new_b));
        m_a = new_a;
        m_b = new_b;
        let mut sum_a = 0.0f32;
        let mut sum_b = 0.0f32;
        #[unroll]
        for j in 0..ntiles {
            let mut va = s_acc[2 * j];
            let mut vb = s_acc[2 * j + 1];
            #[unroll]
            for e in 0..2usize {
                let pa = select(live_a, f32::exp(va.extract(e) - new_a), 0.0);
                let pb = select(live_b, f32::exp(vb.extract(e) - new_b), 0.0);
                sum_a += pa;
                sum_b += pb;
                va.insert(e, pa);
                vb.insert(e, pb);
            }
            s_acc[2 * j] = va;
            s_acc[2 * j + 1] = vb;
        }
        l_a = l_a * corr_a + sum_a; // this lane's columns; summed over the row's lanes at the end
        l_b = l_b * corr_b + sum_b;
        #[unroll]
        for j in 0..dtiles {
            o[2 * j] *= Vector::new(corr_a);
            o[2 * j + 1] *= Vector::new(corr_b);
        }

        // O += P·V, 16 keys per k-step; P's A fragment is two S tiles re-packed.
        #[unroll]
        for s in 0..comptime!(cfg.block_k / 16) {
            let mut a = Array::<Vector<F, NP>>::new(4usize);
            a[0] = Vector::<F, NP>::cast_from(s_acc[4 * s]);
            a[1] = Vector::<F, NP>::cast_from(s_acc[4 * s + 1]);
            a[2] = Vector::<F, NP>::cast_from(s_acc[4 * s + 2]);
            a[3] = Vector::<F, NP>::cast_from(s_acc[4 * s + 3]);
            // One `ldmatrix.x4.trans` gives the B fragments of two 8-column tiles: unit `l`
            // addresses key row `16·s + 8·(l / 8 % 2) + l % 8` at column vector `2·j2 + l / 16`.
            let key = s * 16 + (lmat % 2) * 8 + lrow;
            #[unroll]
            for j2 in 0..comptime!(cfg.head_dim / 16) {
                let at = off + key * rs + 2 * j2 + lmat / 2;
                let frags = def.load_matrix::<Vector<F, NV>, NP>(
                    &v_s[at..comptime!(2 * stage_len)],
                    MatrixIdent::B,
                    4usize,
                    true,
                );
                #[unroll]
                for h2 in 0..2usize {
                    let j = 2 * j2 + h2;
                    let mut b = Array::<Vector<F, NP>>::new(2usize);
                    b[0] = frags[2 * h2];
                    b[1] = frags[2 * h2 + 1];
                    let mut c = Array::<Vector<f32, NP>>::new(2usize);
                    c[0] = o[2 * j];
                    c[1] = o[2 * j + 1];
                    def.execute_inplace(&a, &b, &mut c);
                    o[2 * j] = c[0];
                    o[2 * j + 1] = c[1];
                }
            }
        }
        if has_next {
            put_stage(&mut k_s, &mut v_s, (1 - buf) * stage_len, &kr, &vr, cfg);
        }
        sync_cube();
        buf = 1 - buf;
        k0 = next;
    }

    // Row sums over the 4 lanes of each row, then normalise and write.
    l_a += plane_shuffle_xor(l_a, 1u32);
    l_a += plane_shuffle_xor(l_a, 2u32);
    l_b += plane_shuffle_xor(l_b, 1u32);
    l_b += plane_shuffle_xor(l_b, 2u32);
    let out_a = (q_start + q0 + row_a) * out.stride(0) + h * out.stride(1);
    let out_b = (q_start + q0 + row_b) * out.stride(0) + h * out.stride(1);
    #[unroll]
    for j in 0..dtiles {
        #[unroll]
        for e in 0..2usize {
            let col = j * 8 + 2 * t + e;
            if valid_a {
                out[out_a + col] = F::cast_from(o[2 * j].extract(e) / l_a);
            }
            if valid_b {
                out[out_b + col] = F::cast_from(o[2 * j + 1].extract(e) / l_b);
            }
        }
    }
}
