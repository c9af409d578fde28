//! Prefill attention on CUDA cores (f32 arithmetic): the path of CPU runtimes and of devices
//! without tensor cores. Memory layout: see [`super`].
//!
//! Launch geometry: one cube per (query tile, query head); a tile is `CUBE_DIM` consecutive
//! queries of one sequence and unit `u` owns query `u` of it (its scores, running max/sum and
//! `D` f32 accumulators). The cube stages its queries (f32, rows padded against bank conflicts)
//! and, for each block of `block_k` keys up to the tile's last causal position, the keys and
//! values (f32) in shared memory; keys past a query's position are masked.

use cubecl::prelude::*;

use super::super::kv_cache::cache_row;
use super::super::kv_read::{KvRead, head_scales};
use super::tile_and_group;

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
pub fn paged_prefill_fma<F: Float, KV: Float>(
    q: &Tensor<F>,
    k_cache: &Tensor<KV>,
    v_cache: &Tensor<KV>,
    kv_scales: &Tensor<f32>,
    block_tables: &Tensor<i32>,
    context_lens: &Tensor<i32>,
    cu_seqlens_q: &Tensor<i32>,
    tiles: &Tensor<i32>,
    out: &mut Tensor<F>,
    scale: f32,
    #[comptime] block_size: usize,
    #[comptime] cfg: PrefillConfig,
    #[comptime] kv_dtype: KvRead,
    #[define(F, KV)] _dtypes: [ElemType; 2],
) {
    let (tile, h) = tile_and_group(cfg.heads);
    let u = UNIT_POS_X as usize;
    let d = cfg.head_dim;
    let bk = cfg.block_k;
    let qpad = comptime!(cfg.head_dim + 1);
    let spad = comptime!(cfg.block_k + 1);
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
                let at = cache_row(block, key % block_size, kvh, cfg.kv_heads, block_size) * d + j;
                kv = f32::cast_from(k_cache[at]);
                vv = f32::cast_from(v_cache[at]);
                if comptime!(kv_dtype.is_fp8()) {
                    kv *= ks;
                    vv *= vs;
                }
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
