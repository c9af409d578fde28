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
//! Three kernels with the same arguments, chosen per device and dtype by [`paged_prefill`]:
//! - [`mma`]: CUDA with manual MMA (`mma.sync`), bf16/f16 — flash-attention-2 with S, P and O in
//!   registers and GQA heads sharing K/V stages;
//! - [`cmma`]: other tensor-core devices (CubeCL's portable 16×16×16 cmma), bf16/f16;
//! - [`fma`]: CPU runtimes and devices without tensor cores.

mod cmma;
mod fma;
mod mma;

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::{CubeCount, CubeDim};

use crate::device_caps::DeviceCaps;
use crate::knobs::Knobs;
use crate::ops::PrefillPlan;
use cmma::{CmmaPrefillConfig, paged_prefill_cmma};
use fma::{PrefillConfig, paged_prefill_fma};
use mma::{MmaPrefillConfig, paged_prefill_mma};

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
) -> Option<CmmaPrefillConfig> {
    let knobs = Knobs::get();
    if !caps.cmma_16x16x16(dtype) || !head_dim.is_multiple_of(16) || knobs.prefill_fma {
        return None;
    }
    let preferred = knobs
        .prefill_tile
        .unwrap_or((4, if head_dim <= 64 { 64 } else { 32 }));
    [preferred, (2, 32), (1, 32)]
        .into_iter()
        .map(|(planes, block_k)| CmmaPrefillConfig {
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
    // The three kernels take the same arguments; the function, grid, config and (for the
    // tensor-core ones, which read the caches in vectors) the vector width differ.
    macro_rules! launch {
        ($kernel:path, $heads:expr, $units:expr, $cfg:expr $(, vec = $vec:expr)?) => {
            $kernel(
                &q.client,
                CubeCount::Static(num_tiles as u32, $heads as u32, 1),
                CubeDim::new_1d($units as u32),
                super::address_type(&[&k_cache, &q]),
                $($vec,)?
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
                cfg,
                vec = kv_vec
            );
        }
        return out;
    }
    if let Some(cfg) = cmma {
        // SAFETY: as below; `cmma_config` checked the tile divisibility the unrolled staging
        // loops rely on and the shared-memory budget.
        unsafe {
            launch!(
                paged_prefill_cmma::launch_unchecked,
                heads,
                cfg.units(),
                cfg,
                vec = vec
            );
        }
        return out;
    }
    let cfg = PrefillConfig {
        heads,
        kv_heads,
        head_dim: d,
        block_q,
        block_k: 16,
    };
    // SAFETY: queries are read below each tile's row count, keys below the tile's causal bound
    // (within the context, through checked block tables); outputs only for valid rows.
    unsafe {
        launch!(paged_prefill_fma::launch_unchecked, heads, block_q, cfg);
    }
    out
}
