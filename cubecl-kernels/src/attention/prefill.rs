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
//! values (f32) in shared memory; keys past a query's position are masked.

use std::sync::Arc;

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::Shape;
use burn_cubecl::{ops::numeric::empty_device_dtype, tensor::CubeTensor};
use cubecl::prelude::{CubeCount, CubeDim};

use crate::device_caps::DeviceCaps;

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
}

/// Host side of prefill attention. `q [T, heads, D]`; `query_lens` are the host copies of each
/// sequence's new-token count (they define the tiles). Returns `[T, heads, D]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_prefill(
    q: CubeTensor,
    k_cache: CubeTensor,
    v_cache: CubeTensor,
    block_tables: CubeTensor,
    context_lens: CubeTensor,
    cu_seqlens_q: CubeTensor,
    query_lens: Arc<Vec<usize>>,
    scale: f32,
) -> CubeTensor {
    let caps = DeviceCaps::of(&q.client);
    let q = crate::unit_inner_stride(q);
    let (t, heads, d) = {
        let s = q.meta.shape();
        (s[0], s[1], s[2])
    };
    let cache_shape = k_cache.meta.shape();
    let (block_size, kv_heads) = (cache_shape[1], cache_shape[2]);
    let dtype = q.dtype;
    let out = empty_device_dtype(
        q.client.clone(),
        q.device.clone(),
        Shape::new([t, heads, d]),
        dtype,
    );
    let block_q = caps.cube_units.min(32);
    let mut tiles = Vec::new();
    for (s, &len) in query_lens.iter().enumerate() {
        for q0 in (0..len).step_by(block_q) {
            tiles.extend([s as i32, q0 as i32]);
        }
    }
    let num_tiles = tiles.len() / 2;
    if num_tiles == 0 {
        return out;
    }
    let tiles = super::upload_i32(&q, &tiles, [num_tiles, 2]);
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
