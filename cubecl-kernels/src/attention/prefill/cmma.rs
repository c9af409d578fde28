//! Prefill attention on tensor cores through CubeCL's portable cmma (bf16/f16, 32-lane planes,
//! `D % 16 == 0`): the path of tensor-core devices without manual MMA. Memory layout: see
//! [`super`].
//!
//! Launch geometry: one cube of `P` planes per (`16·P`-query tile, query head), each plane owning
//! 16 query rows. Per stage of `block_k` keys, staged in shared memory (in `F`, 16-byte global
//! loads all issued before the first use), each plane computes its rows of `S = Q·Kᵀ` with
//! 16×16×16 cmma (f32 into shared memory), does the online softmax two lanes per row (max and sum
//! combined by a lane shuffle), writes `P` as `F`, and accumulates `O += P·V` with cmma into f32
//! accumulators kept in shared memory between stages, rescaled there by each row's correction
//! when the plane's maxima moved. Lanes walk their half rows in a rotated order so that a plane's
//! accesses hit distinct banks. Shared memory per cube: [`CmmaPrefillConfig::shared_bytes`]; the
//! launcher picks the tile from the device's limit.

use cubecl::prelude::*;

use super::super::kv_cache::cache_row;
use super::super::kv_read::{KvRead, dequantise, head_scales};
use super::tile_and_group;

/// Comptime part of the tensor-core launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CmmaPrefillConfig {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Keys per stage, a multiple of 32.
    pub block_k: usize,
    /// 32-lane planes per cube, each owning 16 query rows.
    pub planes: usize,
}

impl CmmaPrefillConfig {
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
        let (bq, bk, d) = (self.block_q(), self.block_k, self.head_dim);
        elem_bytes * (bq * d + 2 * bk * d + bq * bk) + 4 * bq * (bk + d)
    }
}

/// Tensor-core variant, see the module documentation. `q`, caches and `out` are read and
/// written in vectors of `NV` elements (16 bytes).
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill_cmma<F: Float, KV: Float, NV: Size>(
    q: &Tensor<Vector<F, NV>>,
    k_cache: &Tensor<Vector<KV, NV>>,
    v_cache: &Tensor<Vector<KV, NV>>,
    kv_scales: &Tensor<f32>,
    block_tables: &Tensor<i32>,
    context_lens: &Tensor<i32>,
    cu_seqlens_q: &Tensor<i32>,
    tiles: &Tensor<i32>,
    out: &mut Tensor<Vector<F, NV>>,
    scale: f32,
    #[comptime] block_size: usize,
    #[comptime] cfg: CmmaPrefillConfig,
    #[comptime] kv_dtype: KvRead,
    #[define(F, KV)] _dtypes: [ElemType; 2],
) {
    let (tile, h) = tile_and_group(cfg.heads);
    let tid = UNIT_POS_X as usize;
    let plane = PLANE_POS as usize;
    let lane = UNIT_POS_PLANE as usize;
    let d = cfg.head_dim;
    let bk = cfg.block_k;
    let bq = comptime!(cfg.block_q());
    let units = comptime!(cfg.units());
    let nv = k_cache.vector_size();
    let dv = comptime!(cfg.head_dim / nv);
    let dfrags = comptime!(cfg.head_dim / 16);
    let kvh = h / comptime!(cfg.heads / cfg.kv_heads);
    let (ks, vs) = head_scales(kv_scales, kvh, cfg.kv_heads, comptime!(kv_dtype.is_fp8()));
    // A padding tile of a captured step (sequence −1): nothing to read or write.
    if tiles[tile * 2] < 0 {
        terminate!();
    }
    let seq = tiles[tile * 2] as usize;
    let q0 = tiles[tile * 2 + 1] as usize;
    let q_start = cu_seqlens_q[seq] as usize;
    let q_len = cu_seqlens_q[seq + 1] as usize - q_start;
    let ctx = context_lens[seq] as usize;
    let prefix = ctx - q_len;
    let rows = min(q_len - q0, bq);
    let last_key = prefix + q0 + rows;
    let table_row = seq * block_tables.stride(0);

    let q_elems = comptime!(cfg.block_q() * cfg.head_dim);
    let kv_elems = comptime!(cfg.block_k * cfg.head_dim);
    let o_elems = q_elems;
    let s_elems = comptime!(cfg.block_q() * cfg.block_k);
    let p_elems = s_elems;
    let mut q_s = Shared::<[F]>::new_slice(q_elems);
    let mut k_s = Shared::<[F]>::new_slice(kv_elems);
    let mut v_s = Shared::<[F]>::new_slice(kv_elems);
    let mut s_s = Shared::<[f32]>::new_slice(s_elems);
    let mut p_s = Shared::<[F]>::new_slice(p_elems);
    let mut o_s = Shared::<[f32]>::new_slice(o_elems);

    // Stage the tile's queries (rows past the sequence are zeros) and zero the outputs.
    let q_row = q.stride(0) / nv;
    let q_head = h * (q.stride(1) / nv);
    #[unroll]
    for i in 0..comptime!(cfg.block_q() * cfg.head_dim / nv / cfg.units()) {
        let idx = i * units + tid;
        let r = idx / dv;
        let c = idx % dv;
        let mut val = Vector::<F, NV>::new(F::new(0.0));
        if r < rows {
            val = q[(q_start + q0 + r) * q_row + q_head + c];
        }
        #[unroll]
        for e in 0..nv {
            q_s[r * d + c * nv + e] = val.extract(e);
        }
    }
    let mut e = tid;
    while e < o_elems {
        o_s[e] = 0.0;
        e += units;
    }

    // Two lanes per query row of this plane: row `lane / 2`, keys `half·bk/2 ..`.
    let my_row = plane * 16 + lane / 2;
    let half = lane % 2;
    let pos = prefix + q0 + my_row;
    let row_valid = my_row < rows;
    let mut m = f32::new(f32::NEG_INFINITY);
    let mut l = 0.0f32;
    let row0 = plane * 16;
    let hk = comptime!(cfg.block_k / 2);
    let hd = comptime!(cfg.head_dim / 2);
    // Rows are not padded (cmma loads and stores of padded rows went wrong on sm_90 beyond
    // the first plane); instead each lane walks its half row rotated by its row, so that the
    // 32 lanes of a plane hit distinct banks.
    let rot_k = if comptime!(cfg.block_k >= 64) {
        2 * (my_row % 16) + half
    } else {
        my_row % 16
    };
    let rot_d = 2 * (my_row % 16) + half;

    let mut k0 = 0usize;
    while k0 < last_key {
        sync_cube();
        // Stage keys and values, 16-byte loads all issued before any is used.
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
                let at = cache_row(block, key % block_size, kvh, cfg.kv_heads, block_size) * dv + c;
                kv = dequantise::<KV, F, NV>(k_cache[at], ks, kv_dtype);
                vv = dequantise::<KV, F, NV>(v_cache[at], vs, kv_dtype);
            }
            #[unroll]
            for e in 0..nv {
                k_s[kk * d + c * nv + e] = kv.extract(e);
                v_s[kk * d + c * nv + e] = vv.extract(e);
            }
        }
        sync_cube();

        // S = Q·Kᵀ for this plane's 16 rows, 16 keys at a time.
        #[unroll]
        for n in 0..comptime!(cfg.block_k / 16) {
            let s = cmma::Matrix::<f32>::from_value(
                cmma::MatrixIdent::Accumulator,
                16usize,
                16usize,
                16usize,
                cmma::MatrixLayout::Undefined,
                0.0,
            );
            accumulate(
                &s,
                &q_s,
                row0 * d,
                d,
                &k_s,
                n * 16 * d,
                16,
                d,
                cmma::MatrixLayout::ColMajor,
                dfrags,
            );
            cmma::store(
                &mut s_s[row0 * bk + n * 16..s_elems],
                &s,
                bk as u32,
                cmma::MatrixLayout::RowMajor,
            );
        }
        sync_plane();

        // Online softmax of this lane's half row; P goes to shared memory as `F`.
        let mut tile_max = f32::new(f32::NEG_INFINITY);
        #[unroll]
        for j in 0..hk {
            let c = half * hk + (j + rot_k) % hk;
            let key = k0 + c;
            let sv = s_s[my_row * bk + c] * scale;
            let masked = !row_valid || key > pos;
            tile_max = max(tile_max, select(masked, f32::new(f32::NEG_INFINITY), sv));
        }
        tile_max = max(tile_max, plane_shuffle_xor(tile_max, 1));
        let m_new = max(m, tile_max);
        let live = m_new != f32::new(f32::NEG_INFINITY);
        let corr = select(m == f32::new(f32::NEG_INFINITY), 0.0, f32::exp(m - m_new));
        let mut part = 0.0f32;
        #[unroll]
        for j in 0..hk {
            let c = half * hk + (j + rot_k) % hk;
            let key = k0 + c;
            let sv = s_s[my_row * bk + c] * scale;
            let masked = !row_valid || key > pos || !live;
            let p = select(masked, 0.0, f32::exp(sv - m_new));
            part += p;
            p_s[my_row * bk + c] = F::cast_from(p);
        }
        part += plane_shuffle_xor(part, 1);
        let corr = select(live, corr, 1.0);
        l = l * corr + part;
        m = select(live, m_new, m);
        // Rescale this lane's half of its output row, unless nothing changed for the plane.
        if plane_any(corr != 1.0) {
            #[unroll]
            for j in 0..hd {
                let at = my_row * d + half * hd + (j + rot_d) % hd;
                o_s[at] *= corr;
            }
        }
        sync_plane();

        // O += P·V for this plane's rows.
        #[unroll]
        for j in 0..dfrags {
            let o = cmma::Matrix::<f32>::from_slice(
                cmma::MatrixIdent::Accumulator,
                16usize,
                16usize,
                16usize,
                cmma::MatrixLayout::RowMajor,
                &o_s[row0 * d + j * 16..o_elems],
                d as u32,
            );
            accumulate(
                &o,
                &p_s,
                row0 * bk,
                bk,
                &v_s,
                j * 16,
                16 * d,
                d,
                cmma::MatrixLayout::RowMajor,
                comptime!(cfg.block_k / 16),
            );
            cmma::store(
                &mut o_s[row0 * d + j * 16..o_elems],
                &o,
                d as u32,
                cmma::MatrixLayout::RowMajor,
            );
        }
        sync_plane();
        k0 += bk;
    }

    // Normalise and write, 16-byte stores: lane pair (row, half) writes half a row.
    if row_valid {
        let out_row = (q_start + q0 + my_row) * (out.stride(0) / nv) + h * (out.stride(1) / nv);
        let inv = 1.0 / l;
        #[unroll]
        for c in 0..comptime!(cfg.head_dim / 2 / nv) {
            let cv = half * comptime!(cfg.head_dim / 2 / nv) + c;
            let mut val = Vector::<F, NV>::new(F::new(0.0));
            #[unroll]
            for e in 0..nv {
                val.insert(e, F::cast_from(o_s[my_row * d + cv * nv + e] * inv));
            }
            out[out_row + cv] = val;
        }
    }
}

/// `acc += Σ_{s < steps} A_s · B_s` over 16×16×16 fragments in shared memory: `A_s` starts at
/// `a[a_at + 16·s]` (row-major, row pitch `lda`), `B_s` at `b[b_at + s·b_step]` (pitch `ldb`,
/// layout `b_layout`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn accumulate<F: Float>(
    acc: &cmma::Matrix<f32>,
    a: &Shared<[F]>,
    a_at: usize,
    lda: usize,
    b: &Shared<[F]>,
    b_at: usize,
    b_step: usize,
    ldb: usize,
    #[comptime] b_layout: cmma::MatrixLayout,
    #[comptime] steps: usize,
) {
    #[unroll]
    for s in 0..steps {
        let a_frag = cmma::Matrix::<F>::from_slice(
            cmma::MatrixIdent::A,
            16usize,
            16usize,
            16usize,
            cmma::MatrixLayout::RowMajor,
            &a[a_at + s * 16..a.len()],
            lda as u32,
        );
        let b_frag = cmma::Matrix::<F>::from_slice(
            cmma::MatrixIdent::B,
            16usize,
            16usize,
            16usize,
            b_layout,
            &b[b_at + s * b_step..b.len()],
            ldb as u32,
        );
        cmma::execute(&a_frag, &b_frag, acc, acc);
    }
}
