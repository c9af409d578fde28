//! Prefill attention on tensor cores with registers managed by hand (`mma.sync.m16n8k16`, bf16 or
//! f16 inputs, f32 accumulators): the flash-attention-2 schedule, where scores, probabilities and
//! output accumulators never leave registers.
//!
//! Launch geometry: one cube of `P` planes (32 lanes each) per (`16·P`-query tile, query head);
//! plane `p` owns query rows `16p .. 16p + 16` of the tile. Lane `l` has `g = l / 4` and
//! `t = l % 4`; per the PTX fragment layouts it holds, of every 16×8 accumulator tile, rows `g`
//! and `g + 8` at columns `2t, 2t + 1`.
//! - Q: loaded once from global memory into A fragments (`D / 16` of them, 4 bf16 pairs each).
//! - Per stage of `block_k` keys, all units stage K and V (16-byte global loads, all issued before
//!   the first store) into shared memory as `[block_k][D + 8]`: 16-byte rows padded by one vector
//!   so that the 8 rows an `ldmatrix` phase reads fall in distinct banks.
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
    /// Planes per cube, each owning 16 query rows.
    pub planes: usize,
}

impl MmaPrefillConfig {
    /// Queries per cube.
    pub fn block_q(&self) -> usize {
        16 * self.planes
    }

    /// Units per cube.
    pub fn units(&self) -> usize {
        32 * self.planes
    }

    /// Shared memory of one cube in bytes, for elements of `elem_bytes`.
    pub fn shared_bytes(&self, elem_bytes: usize) -> usize {
        2 * elem_bytes * self.block_k * (self.head_dim + 8)
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
    let h = CUBE_POS_Y as usize;
    let tid = UNIT_POS_X as usize;
    let plane = PLANE_POS as usize;
    let lane = UNIT_POS_PLANE as usize;
    let g = lane / 4;
    let t = lane % 4;
    let bk = cfg.block_k;
    let units = comptime!(cfg.units());
    let nv = k_cache.vector_size();
    let dv = comptime!(cfg.head_dim / nv);
    let ksteps = comptime!(cfg.head_dim / 16); // k-steps of Q·Kᵀ
    let ntiles = comptime!(cfg.block_k / 8); // 8-key tiles of S
    let dtiles = comptime!(cfg.head_dim / 8); // 8-column tiles of O
    let rs = comptime!(cfg.head_dim / 8 + 1); // stage row stride in vectors
    let kvh = h / comptime!(cfg.heads / cfg.kv_heads);
    let seq = tiles[tile * 2] as usize;
    let q0 = tiles[tile * 2 + 1] as usize;
    let q_start = cu_seqlens_q[seq] as usize;
    let q_len = cu_seqlens_q[seq + 1] as usize - q_start;
    let ctx = context_lens[seq] as usize;
    let prefix = ctx - q_len;
    let rows = min(q_len - q0, comptime!(cfg.block_q()));
    let last_key = prefix + q0 + rows;
    let table_row = seq * block_tables.stride(0);

    // K and V stages, `[block_k][D / 8 + 1]` 16-byte vectors: one vector of padding per row.
    let stage_len = comptime!(cfg.block_k * (cfg.head_dim / 8 + 1));
    let mut k_s = Shared::<[Vector<F, NV>]>::new_aligned_slice(stage_len, 16usize);
    let mut v_s = Shared::<[Vector<F, NV>]>::new_aligned_slice(stage_len, 16usize);

    // This lane's rows of the tile, and their positions in the sequence.
    let row_a = plane * 16 + g;
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

    let mut k0 = 0usize;
    while k0 < last_key {
        sync_cube();
        // Stage keys and values (zeros past the tile's last key).
        #[unroll]
        for i in 0..comptime!(cfg.block_k * cfg.head_dim / nv / cfg.units()) {
            let idx = i * units + tid;
            let kk = idx / dv;
            let c = idx % dv;
            let key = k0 + kk;
            let mut kv = Vector::<F, NV>::new(F::new(0.0));
            let mut vv = Vector::<F, NV>::new(F::new(0.0));
            if key < last_key {
                let block = block_tables[table_row + key / block_size] as usize;
                let at = ((block * block_size + key % block_size) * cfg.kv_heads + kvh) * dv + c;
                kv = k_cache[at];
                vv = v_cache[at];
            }
            k_s[kk * rs + c] = kv;
            v_s[kk * rs + c] = vv;
        }
        sync_cube();

        // S = Q·Kᵀ, 8 keys per accumulator tile. One `ldmatrix.x4` gives the B fragments of two
        // k-steps: unit `l` addresses key row `l % 8` of the tile at column vector `2·s + l / 8`.
        #[unroll]
        for j in 0..ntiles {
            let mut c = Array::<Vector<f32, NP>>::new(2usize);
            c[0] = Vector::new(0.0);
            c[1] = Vector::new(0.0);
            #[unroll]
            for s2 in 0..comptime!(cfg.head_dim / 32) {
                let at = (j * 8 + lrow) * rs + 4 * s2 + lmat;
                let frags = def.load_matrix::<Vector<F, NV>, NP>(
                    &k_s[at..stage_len],
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
            if comptime!(cfg.head_dim % 32 != 0) {
                // The last k-step alone (D = 16 × odd): two matrices.
                let s = comptime!(cfg.head_dim / 16 - 1);
                let at = (j * 8 + lrow) * rs + 2 * s + lmat % 2;
                let frags = def.load_matrix::<Vector<F, NV>, NP>(
                    &k_s[at..stage_len],
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
                let at = key * rs + 2 * j2 + lmat / 2;
                let frags = def.load_matrix::<Vector<F, NV>, NP>(
                    &v_s[at..stage_len],
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
        k0 += bk;
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
