//! Paged prefill attention over a variable-length batch: each sequence's new tokens attend
//! causally to its whole context in the paged cache (a cached prefix, earlier chunks and the new
//! tokens themselves, which the KV write stored first). Online softmax, flash-attention style:
//! no score matrix ever reaches global memory.
//!
//! Memory layout: `q`, `out` `[T, heads, D]` with tokens of sequence `s` at rows
//! `cu_seqlens_q[s]..cu_seqlens_q[s+1]`; caches `[num_blocks, block_size, kv_heads, D]`
//! contiguous; `block_tables [B, max_blocks]`, `context_lens [B]`, `cu_seqlens_q [B + 1]` i32;
//! `tiles [num_tiles, 2]` i32 = (sequence, first query of the tile), built on the host.
//!
//! Launch geometry: one cube per (query tile, query head); a tile is `CUBE_DIM` consecutive
//! queries of one sequence and unit `u` owns query `u` of it (its scores, running max/sum and
//! `D` f32 accumulators). The cube stages its queries (f32, rows padded against bank conflicts)
//! and, for each block of `block_k` keys up to the tile's last causal position, the keys and
//! values (f32) in shared memory; keys past a query's position are masked. This FMA kernel is
//! the path of CPU runtimes and of devices without tensor cores.
//!
//! On CUDA devices with manual MMA (`mma.sync`) and bf16/f16, the flash-attention-2 kernel of
//! [`super::prefill_mma`] runs instead (S, P and O in registers, GQA heads sharing K/V stages).
//!
//! Portable tensor-core variant (`paged_prefill_cmma`; bf16/f16, 32-lane planes, `D % 16 == 0`): one cube
//! of `P` planes per (`16·P`-query tile, query head), each plane owning 16 query rows. Per stage
//! of `block_k` keys, staged in shared memory (in `F`, 16-byte global loads all issued before the
//! first use), each plane computes its rows of `S = Q·Kᵀ` with 16×16×16 cmma (f32 into shared
//! memory), does the online softmax two lanes per row (max and sum combined by a lane shuffle),
//! writes `P` as `F`, and accumulates `O += P·V` with cmma into f32 accumulators kept in shared
//! memory between stages, rescaled there by each row's correction when the plane's maxima moved.
//! Lanes walk their half rows in a rotated order so that a plane's accesses hit distinct banks. Shared memory per cube:
//! see `CmmaPrefillConfig::shared_bytes`; the launcher picks the tile from the device's limit.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::{CubeCount, CubeDim};

use super::prefill_mma::{MmaPrefillConfig, paged_prefill_mma};
use crate::device_caps::DeviceCaps;
use crate::knobs::Knobs;
use crate::ops::PrefillPlan;

pub(crate) mod kernel {
    use cubecl::prelude::*;

    /// Comptime part of the launch.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct PrefillConfig {
        pub heads: usize,
        pub kv_heads: usize,
        pub head_dim: usize,
        pub block_q: usize,
        pub block_k: usize,
    }

    /// See the module documentation.
    #[cube(launch_unchecked, address_type = "dynamic")]
    #[allow(clippy::too_many_arguments)]
    pub fn paged_prefill<F: Float>(
        q: &Tensor<F>,
        k_cache: &Tensor<F>,
        v_cache: &Tensor<F>,
        block_tables: &Tensor<i32>,
        context_lens: &Tensor<i32>,
        cu_seqlens_q: &Tensor<i32>,
        tiles: &Tensor<i32>,
        out: &mut Tensor<F>,
        scale: f32,
        block_size: usize,
        #[comptime] cfg: PrefillConfig,
        #[define(F)] _dtype: ElemType,
    ) {
        let tile = CUBE_POS_X as usize;
        let h = CUBE_POS_Y as usize;
        let u = UNIT_POS_X as usize;
        let d = cfg.head_dim;
        let bk = cfg.block_k;
        let qpad = comptime!(cfg.head_dim + 1);
        let spad = comptime!(cfg.block_k + 1);
        let kvh = h / comptime!(cfg.heads / cfg.kv_heads);
        let seq = tiles[tile * 2] as usize;
        let q0 = tiles[tile * 2 + 1] as usize;
        let q_start = cu_seqlens_q[seq] as usize;
        let q_len = cu_seqlens_q[seq + 1] as usize - q_start;
        let ctx = context_lens[seq] as usize;
        let prefix = ctx - q_len;
        let rows = min(q_len - q0, cfg.block_q);
        let row_valid = u < rows;
        let pos = prefix + q0 + u;
        let last_key = prefix + q0 + rows; // exclusive bound of keys any row of the tile sees
        let table_row = seq * block_tables.stride(0);

        let mut q_s = Shared::<[f32]>::new_slice(comptime!(cfg.block_q * (cfg.head_dim + 1)));
        let mut k_s = Shared::<[f32]>::new_slice(comptime!(cfg.block_k * cfg.head_dim));
        let mut v_s = Shared::<[f32]>::new_slice(comptime!(cfg.block_k * cfg.head_dim));
        let mut s_s = Shared::<[f32]>::new_slice(comptime!(cfg.block_q * (cfg.block_k + 1)));

        let mut e = u;
        while e < comptime!(cfg.block_q * cfg.head_dim) {
            let r = e / d;
            let j = e % d;
            let mut val = 0.0f32;
            if r < rows {
                val = f32::cast_from(q[(q_start + q0 + r) * q.stride(0) + h * q.stride(1) + j]);
            }
            q_s[r * qpad + j] = val;
            e += CUBE_DIM_X as usize;
        }

        let mut acc = Array::<f32>::new(cfg.head_dim);
        #[unroll]
        for j in 0..cfg.head_dim {
            acc[j] = 0.0;
        }
        let mut m = f32::new(f32::NEG_INFINITY);
        let mut l = 0.0f32;

        let mut k0 = 0usize;
        while k0 < last_key {
            sync_cube();
            let mut e = u;
            while e < comptime!(cfg.block_k * cfg.head_dim) {
                let kk = e / d;
                let j = e % d;
                let key = k0 + kk;
                let mut kv = 0.0f32;
                let mut vv = 0.0f32;
                if key < last_key {
                    let block = block_tables[table_row + key / block_size] as usize;
                    let at = ((block * block_size + key % block_size) * cfg.kv_heads + kvh) * d + j;
                    kv = f32::cast_from(k_cache[at]);
                    vv = f32::cast_from(v_cache[at]);
                }
                k_s[e] = kv;
                v_s[e] = vv;
                e += CUBE_DIM_X as usize;
            }
            sync_cube();

            // Scores of this unit's query against the block (masked past its position).
            let mut tile_max = f32::new(f32::NEG_INFINITY);
            for kk in 0..bk {
                let key = k0 + kk;
                let mut s = f32::new(f32::NEG_INFINITY);
                if row_valid && key <= pos {
                    let mut dot = 0.0f32;
                    for j in 0..d {
                        dot += q_s[u * qpad + j] * k_s[kk * d + j];
                    }
                    s = dot * scale;
                }
                s_s[u * spad + kk] = s;
                tile_max = max(tile_max, s);
            }
            let m_new = max(m, tile_max);
            if m_new != f32::new(f32::NEG_INFINITY) {
                let corr = select(m == f32::new(f32::NEG_INFINITY), 0.0, f32::exp(m - m_new));
                l *= corr;
                #[unroll]
                for j in 0..cfg.head_dim {
                    acc[j] *= corr;
                }
                for kk in 0..bk {
                    let s = s_s[u * spad + kk];
                    if s != f32::new(f32::NEG_INFINITY) {
                        let p = f32::exp(s - m_new);
                        l += p;
                        #[unroll]
                        for j in 0..cfg.head_dim {
                            acc[j] += p * v_s[kk * d + j];
                        }
                    }
                }
                m = m_new;
            }
            k0 += bk;
        }

        if row_valid {
            let row = (q_start + q0 + u) * out.stride(0) + h * out.stride(1);
            #[unroll]
            for j in 0..cfg.head_dim {
                out[row + j] = F::cast_from(acc[j] / l);
            }
        }
    }
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
    pub fn paged_prefill_cmma<F: Float, NV: Size>(
        q: &Tensor<Vector<F, NV>>,
        k_cache: &Tensor<Vector<F, NV>>,
        v_cache: &Tensor<Vector<F, NV>>,
        block_tables: &Tensor<i32>,
        context_lens: &Tensor<i32>,
        cu_seqlens_q: &Tensor<i32>,
        tiles: &Tensor<i32>,
        out: &mut Tensor<Vector<F, NV>>,
        scale: f32,
        block_size: usize,
        #[comptime] cfg: CmmaPrefillConfig,
        #[define(F)] _dtype: ElemType,
    ) {
        let tile = CUBE_POS_X as usize;
        let h = CUBE_POS_Y as usize;
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
                    let at =
                        ((block * block_size + key % block_size) * cfg.kv_heads + kvh) * dv + c;
                    kv = k_cache[at];
                    vv = v_cache[at];
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
                #[unroll]
                for kk in 0..dfrags {
                    let a = cmma::Matrix::<F>::from_slice(
                        cmma::MatrixIdent::A,
                        16usize,
                        16usize,
                        16usize,
                        cmma::MatrixLayout::RowMajor,
                        &q_s[row0 * d + kk * 16..q_elems],
                        d as u32,
                    );
                    let b = cmma::Matrix::<F>::from_slice(
                        cmma::MatrixIdent::B,
                        16usize,
                        16usize,
                        16usize,
                        cmma::MatrixLayout::ColMajor,
                        &k_s[n * 16 * d + kk * 16..kv_elems],
                        d as u32,
                    );
                    cmma::execute(&a, &b, &s, &s);
                }
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
                #[unroll]
                for kk in 0..comptime!(cfg.block_k / 16) {
                    let a = cmma::Matrix::<F>::from_slice(
                        cmma::MatrixIdent::A,
                        16usize,
                        16usize,
                        16usize,
                        cmma::MatrixLayout::RowMajor,
                        &p_s[row0 * bk + kk * 16..p_elems],
                        bk as u32,
                    );
                    let b = cmma::Matrix::<F>::from_slice(
                        cmma::MatrixIdent::B,
                        16usize,
                        16usize,
                        16usize,
                        cmma::MatrixLayout::RowMajor,
                        &v_s[kk * 16 * d + j * 16..kv_elems],
                        d as u32,
                    );
                    cmma::execute(&a, &b, &o, &o);
                }
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
}

/// The tensor-core launch for this device and shape, if any: four planes (64 queries) per cube,
/// 64 keys per stage at `D ≤ 64` and 32 above (64 and 76 KiB of shared memory at `D` = 64 and
/// 128), falling back to fewer planes where shared memory or the vector tiling do not fit.
/// `BURN_NANOVLLM_PREFILL_TILE=planes,block_k` picks another tile, for benchmarks.
fn cmma_config(
    caps: &DeviceCaps,
    dtype: DType,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vec: usize,
) -> Option<kernel::CmmaPrefillConfig> {
    let knobs = Knobs::get();
    if !caps.cmma_16x16x16(dtype) || !head_dim.is_multiple_of(16) || knobs.prefill_fma {
        return None;
    }
    let preferred = knobs
        .prefill_tile
        .unwrap_or((4, if head_dim <= 64 { 64 } else { 32 }));
    [preferred, (2, 32), (1, 32)]
        .into_iter()
        .map(|(planes, block_k)| kernel::CmmaPrefillConfig {
            heads,
            kv_heads,
            head_dim,
            block_k,
            planes,
        })
        .find(|c| {
            c.block_k.is_multiple_of(32)
                && (c.block_q() * head_dim / vec).is_multiple_of(c.units())
                && (c.block_k * head_dim / vec).is_multiple_of(c.units())
                && c.shared_bytes(dtype.size()) <= caps.shared_bytes
        })
}

/// The manual-MMA launch for this device and shape, if any: four 16-row query blocks per head
/// and 32 keys per stage; narrow GQA groups (`G ≤ 2`) put the whole group in one cube, sharing
/// its K/V stages (8 planes for Qwen3), wider ones one head per cube (sharing across Qwen2-0.5B's
/// 7 heads measured 10–40 % slower on the H100: docs/results/h100-prefill-mma-layouts.txt).
/// `BURN_NANOVLLM_PREFILL_MMA=heads_per_cube,row_blocks,block_k` picks another, for benchmarks.
fn mma_config(
    caps: &DeviceCaps,
    dtype: DType,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vec: usize,
) -> Option<MmaPrefillConfig> {
    let knobs = Knobs::get();
    if !super::mma_fits(caps, dtype, head_dim, vec) || knobs.prefill_fma || knobs.prefill_cmma {
        return None;
    }
    let group = heads / kv_heads;
    let default = (if group <= 2 { group } else { 1 }, 4, 32);
    let (heads_per_cube, row_blocks, block_k) = knobs
        .prefill_mma
        .filter(|(h, r, _)| *h > 0 && *r > 0 && group.is_multiple_of(*h))
        .unwrap_or(default);
    let cfg = MmaPrefillConfig {
        heads,
        kv_heads,
        head_dim,
        block_k,
        heads_per_cube,
        row_blocks,
    };
    (cfg.block_k.is_multiple_of(16)
        && cfg.units() <= caps.max_cube_units
        && cfg.shared_bytes(dtype.size()) <= caps.shared_bytes)
        .then_some(cfg)
}

/// Host side of prefill attention. `q [T, heads, D]`; `plan.query_lens` are the host copies of
/// each sequence's new-token count (they define the tiles, built once per step and cached in
/// `plan.tiles`). Returns `[T, heads, D]`.
pub(crate) fn paged_prefill(
    q: CubeTensor,
    k_cache: CubeTensor,
    v_cache: CubeTensor,
    block_tables: CubeTensor,
    context_lens: CubeTensor,
    cu_seqlens_q: CubeTensor,
    plan: PrefillPlan,
) -> CubeTensor {
    let scale = plan.scale;
    let caps = DeviceCaps::of(&q.client);
    let super::AttentionLaunch {
        q,
        out,
        heads,
        head_dim: d,
        block_size,
        kv_heads,
        ..
    } = super::AttentionLaunch::new(q, &k_cache);
    let dtype = q.dtype;
    let vec = crate::vector_size(dtype, &[d, q.meta.strides()[0], q.meta.strides()[1]]);
    let kv_vec = crate::vector_size(dtype, &[d]);
    let mma = mma_config(&caps, dtype, heads, kv_heads, d, kv_vec);
    let cmma = cmma_config(&caps, dtype, heads, kv_heads, d, vec).filter(|_| mma.is_none());
    let block_q = match (mma, cmma) {
        (Some(cfg), _) => cfg.block_q(),
        (None, Some(cfg)) => cfg.block_q(),
        (None, None) => caps.cube_units.min(32),
    };
    let tiles = {
        let mut cached = plan.tiles.0.lock().expect("tile cache");
        match &*cached {
            Some((rows, tiles)) if *rows == block_q => tiles.clone(),
            _ => {
                let mut list = Vec::new();
                for (s, &len) in plan.query_lens.iter().enumerate() {
                    for q0 in (0..len).step_by(block_q) {
                        list.extend([s as i32, q0 as i32]);
                    }
                }
                let tiles = super::upload_i32(&q, &list, [list.len() / 2, 2]);
                *cached = Some((block_q, tiles.clone()));
                tiles
            }
        }
    };
    let num_tiles = tiles.meta.shape()[0];
    if num_tiles == 0 {
        return out;
    }
    // The tensor-core kernels take the same arguments; the function, grid, vector width and
    // config differ.
    macro_rules! launch {
        ($kernel:path, $heads:expr, $units:expr, $vec:expr, $cfg:expr) => {
            $kernel(
                &q.client,
                CubeCount::Static(num_tiles as u32, $heads as u32, 1),
                CubeDim::new_1d($units as u32),
                super::address_type(&[&k_cache, &q]),
                $vec,
                q.clone().into_tensor_arg(),
                k_cache.into_tensor_arg(),
                v_cache.into_tensor_arg(),
                block_tables.into_tensor_arg(),
                context_lens.into_tensor_arg(),
                cu_seqlens_q.into_tensor_arg(),
                tiles.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                scale,
                block_size,
                $cfg,
                dtype_to_storage_type(dtype),
            )
        };
    }
    if let Some(cfg) = mma {
        // SAFETY: as below; `mma_config` checked the shared-memory budget (its staging loop
        // guards a partial last round).
        unsafe {
            launch!(
                paged_prefill_mma::launch_unchecked,
                kv_heads * cfg.cubes_per_kv_head(),
                cfg.units(),
                kv_vec,
                cfg
            );
        }
        return out;
    }
    if let Some(cfg) = cmma {
        // SAFETY: as below; `cmma_config` checked the tile divisibility the unrolled staging
        // loops rely on and the shared-memory budget.
        unsafe {
            launch!(
                kernel::paged_prefill_cmma::launch_unchecked,
                heads,
                cfg.units(),
                vec,
                cfg
            );
        }
        return out;
    }
    let cfg = kernel::PrefillConfig {
        heads,
        kv_heads,
        head_dim: d,
        block_q,
        block_k: 16,
    };
    // SAFETY: queries are read below each tile's row count, keys below the tile's causal bound
    // (within the context, through checked block tables); outputs only for valid rows.
    unsafe {
        kernel::paged_prefill::launch_unchecked(
            &q.client,
            CubeCount::Static(num_tiles as u32, heads as u32, 1),
            CubeDim::new_1d(block_q as u32),
            super::address_type(&[&k_cache, &q]),
            q.clone().into_tensor_arg(),
            k_cache.into_tensor_arg(),
            v_cache.into_tensor_arg(),
            block_tables.into_tensor_arg(),
            context_lens.into_tensor_arg(),
            cu_seqlens_q.into_tensor_arg(),
            tiles.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            scale,
            block_size,
            cfg,
            dtype_to_storage_type(dtype),
        );
    }
    out
}
