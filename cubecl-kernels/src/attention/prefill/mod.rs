//! Paged prefill attention over a variable-length batch: each sequence's new tokens attend
//! causally to its whole context in the paged cache (a cached prefix, earlier chunks and the new
//! tokens themselves, which the KV write stored first). Online softmax, flash-attention style:
//! no score matrix ever reaches global memory.
//!
//! Memory layout: `q`, `out` `[T, heads, D]` with tokens of sequence `s` at rows
//! `cu_seqlens_q[s]..cu_seqlens_q[s+1]`; caches `[num_blocks, kv_heads, block_size, D]`
//! contiguous; `block_tables [B, max_blocks]`, `context_lens [B]`, `cu_seqlens_q [B + 1]` i32
//! (row offsets into `q`: the prefill rows follow a step's decode rows); `tiles [num_tiles, 2]`
//! i32 = (sequence, first query of the tile), built on the host ([`tile_rows`] queries each,
//! heaviest first: [`crate::prefill_tiles`]); a tile of sequence −1 is padding (a captured
//! step's grid covers its most tiles).
//!
//! Launch geometry (all three kernels): a one-dimensional grid of `num_tiles × G` cubes, cube
//! `c` serving tile `c / G` and head group `c % G` (`G` = query heads, or kv heads × cubes per
//! kv head): the device deals cubes out in this order, so every head group of the heaviest
//! tile starts first and the causal triangle's short tiles fill the last wave.
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
use cubecl::prelude::*;

use super::mma_tile::StageSoftmax;
use crate::ReductionOrder;
use crate::device_caps::DeviceCaps;
use crate::knobs::Knobs;
use cmma::{CmmaPrefillConfig, paged_prefill_cmma};
use fma::{PrefillConfig, paged_prefill_fma};
use mma::{MmaPrefillConfig, paged_prefill_mma};

/// This cube's (tile, head group) in the tile-major grid of `groups` head groups per tile.
#[cube]
fn tile_and_group(#[comptime] groups: usize) -> (usize, usize) {
    let cube = CUBE_POS_X as usize;
    (cube / groups, cube % groups)
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

/// The manual-MMA launch for this device and shape, if any: four 16-row query blocks per head;
/// narrow GQA groups (`G ≤ 2`) put the whole group in one cube, sharing its K/V stages of 64
/// keys (8 planes for Qwen3; at base clocks 2–6 % faster than 32-key stages on the H100 at
/// Qwen3-0.6B's heads, docs/BENCHMARKS.md), wider ones one head per cube with 32-key stages
/// (sharing across Qwen2-0.5B's 7 heads measured 10–40 % slower,
/// docs/results/h100-prefill-mma-layouts.txt; 64-key stages 1–12 % slower).
///
/// Batch-invariant steps send decode rows through this kernel too (one query per tile), so
/// there the tile is shaped for them (a row's arithmetic depends only on the stage length, so
/// prefill and decode rows still meet the same reduction order): narrow groups (`G ≤ 2`) one
/// 16-row block per head, the group's heads sharing 32-key stages (bench.py's cost on the H100
/// from −38 % to −5 % at Qwen3-0.6B against the four-block tile; 64-key stages, 16-key and two
/// blocks were slower); wider ones (up to 16) packed, the group's heads in each plane's rows (a
/// decode row's heads in one MMA), 64-key stages over at least two planes, enough to load a
/// stage in at most 16 vectors a lane (Qwen2-0.5B's bench.py cost −15 %, against −20 % with
/// 32-key stages on two planes, −22 % on one, −29 % with 64 keys on one; docs/BENCHMARKS.md,
/// "Batch invariance").
/// `BURN_NANOVLLM_PREFILL_MMA=heads_per_cube,row_blocks,block_k` picks another tile and
/// `BURN_NANOVLLM_PREFILL_PACKED=0|1` its packing, for benchmarks.
fn mma_config(
    caps: &DeviceCaps,
    dtype: DType,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    vec: usize,
    order: ReductionOrder,
) -> Option<MmaPrefillConfig> {
    let knobs = Knobs::get();
    if !super::mma_fits(caps, dtype, head_dim, vec) || knobs.prefill_fma || knobs.prefill_cmma {
        return None;
    }
    let group = heads / kv_heads;
    let (default, packed) = match order {
        ReductionOrder::BatchInvariant if (3..=16).contains(&group) => {
            // 64-key stages; K and V of a stage over at least two planes' lanes, at most 16
            // vectors of 8 each.
            let planes = (2 * 64 * head_dim).div_ceil(8 * 16 * 32).max(2);
            ((group, planes, 64), true)
        }
        ReductionOrder::BatchInvariant => {
            let shared = (1..=group.min(8))
                .rev()
                .find(|h| group.is_multiple_of(*h))
                .unwrap_or(1);
            ((shared, 1, 32), false)
        }
        ReductionOrder::Fastest if group <= 2 => ((group, 4, 64), false),
        ReductionOrder::Fastest => ((1, 4, 32), false),
    };
    let packed = knobs.prefill_packed.unwrap_or(packed);
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
        packed,
        softmax: StageSoftmax::from_knobs(),
    };
    (cfg.block_k.is_multiple_of(16)
        && (!cfg.packed || cfg.heads_per_cube <= 16)
        && cfg.units() <= caps.max_cube_units
        && cfg.shared_bytes(dtype.size()) <= caps.shared_bytes)
        .then_some(cfg)
}

/// The kernel a prefill launch takes on this device, with its configuration. The query tile
/// height follows from it, so the host builds the tile list ([`tile_rows`]) for the launch
/// before it happens; both take this one choice.
#[derive(Clone, Copy, Debug)]
enum Launch {
    Mma(MmaPrefillConfig),
    Cmma(CmmaPrefillConfig),
    Fma(PrefillConfig),
}

/// The launch for `q [·, heads, D]` of `dtype` over caches of `kv_heads` heads, reducing in
/// `order`. Queries are read in the caches' vector width (the launcher makes them so).
fn choose(
    caps: &DeviceCaps,
    dtype: DType,
    heads: usize,
    kv_heads: usize,
    d: usize,
    order: ReductionOrder,
) -> Launch {
    let vec = crate::vector_size(dtype, &[d]);
    if let Some(cfg) = mma_config(caps, dtype, heads, kv_heads, d, vec, order) {
        return Launch::Mma(cfg);
    }
    if let Some(cfg) = cmma_config(caps, dtype, heads, kv_heads, d, vec) {
        return Launch::Cmma(cfg);
    }
    Launch::Fma(PrefillConfig {
        heads,
        kv_heads,
        head_dim: d,
        block_q: caps.cube_units.min(32),
        block_k: 16,
    })
}

impl Launch {
    fn block_q(&self) -> usize {
        match self {
            Launch::Mma(c) => c.block_q(),
            Launch::Cmma(c) => c.block_q(),
            Launch::Fma(c) => c.block_q,
        }
    }
}

/// Queries per tile of the prefill launch on `client`'s device for this shape and reduction
/// order: the tile list `[num_tiles, 2]` = (sequence, first query) that [`paged_prefill`] takes
/// steps by it.
pub(crate) fn tile_rows(
    client: &cubecl::client::Client,
    dtype: DType,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    order: ReductionOrder,
) -> usize {
    choose(
        &DeviceCaps::of(client),
        dtype,
        heads,
        kv_heads,
        head_dim,
        order,
    )
    .block_q()
}

/// Host side of prefill attention: the query tiles `tiles [num_tiles, 2]` (sequence, first
/// query; tiles of sequence −1 are padding, skipped) of `block_q` rows each, over rows
/// `cu_seqlens_q[s]..cu_seqlens_q[s + 1]` of `launch.q [T, heads, D]`, into the same rows of
/// `launch.out`. `block_q` must be [`tile_rows`]' answer for `order` (checked).
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_prefill(
    launch: &super::AttentionLaunch,
    k_cache: CubeTensor,
    v_cache: CubeTensor,
    kv_scales: CubeTensor,
    block_tables: CubeTensor,
    context_lens: CubeTensor,
    cu_seqlens_q: CubeTensor,
    tiles: CubeTensor,
    block_q: usize,
    plan: &super::AttentionPlan,
) {
    let (scale, order, kv_dtype) = (plan.scale, plan.order, plan.kv_dtype);
    let super::AttentionLaunch {
        q,
        out,
        heads,
        head_dim: d,
        block_size,
        kv_heads,
        ..
    } = launch;
    let (heads, d, block_size, kv_heads) = (*heads, *d, *block_size, *kv_heads);
    let dtype = q.dtype;
    let caps = DeviceCaps::of(&q.client);
    let kv_read = super::kv_read::KvRead::new(kv_dtype, &caps);
    let chosen = choose(&caps, dtype, heads, kv_heads, d, order);
    assert_eq!(
        chosen.block_q(),
        block_q,
        "paged prefill: the tile list was built for {block_q}-query tiles, the launch takes {}",
        chosen.block_q()
    );
    let num_tiles = tiles.meta.shape()[0];
    if num_tiles == 0 {
        return;
    }
    let grid = |tiles: usize, groups: usize| {
        u32::try_from(tiles * groups)
            .ok()
            .filter(|&n| n < 1 << 31)
            .unwrap_or_else(|| {
                panic!("paged prefill: {tiles} tiles × {groups} head groups exceed a grid")
            })
    };
    // The kernels read the tile list flat, `[num_tiles, 2]` row-major without a pitch (a
    // contiguous list is passed through as it is).
    let tiles = burn_cubecl::kernel::into_contiguous(tiles);
    let kv_vec = crate::vector_size(dtype, &[d]);
    // The tensor-core kernels read q in the caches' vector width.
    let q = if crate::vector_size(dtype, &[d, q.meta.strides()[0], q.meta.strides()[1]]) == kv_vec {
        q.clone()
    } else {
        burn_cubecl::kernel::into_contiguous(q.clone())
    };
    // The three kernels take the same arguments; the function, grid, config and (for the
    // tensor-core ones, which read in vectors) the vector width differ.
    macro_rules! launch {
        ($kernel:path, $heads:expr, $units:expr, $cfg:expr $(, vec = $vec:expr)?) => {
            $kernel(
                &q.client,
                CubeCount::Static(grid(num_tiles, $heads), 1, 1),
                CubeDim::new_1d($units as u32),
                super::address_type(&[&k_cache, &q]),
                $($vec,)?
                q.clone().into_tensor_arg(),
                k_cache.into_tensor_arg(),
                v_cache.into_tensor_arg(),
                kv_scales.into_tensor_arg(),
                block_tables.into_tensor_arg(),
                context_lens.into_tensor_arg(),
                cu_seqlens_q.into_tensor_arg(),
                tiles.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                scale,
                block_size,
                $cfg,
                kv_read,
                [dtype_to_storage_type(dtype), kv_dtype.storage(dtype)],
            )
        };
    }
    // SAFETY: queries are read below each tile's row count, keys below the tile's causal bound
    // (within the context, through checked block tables), outputs only for valid rows;
    // `mma_config` / `cmma_config` checked the shared-memory budget and the tile divisibility
    // the unrolled staging loops rely on.
    unsafe {
        match chosen {
            Launch::Mma(cfg) => launch!(
                paged_prefill_mma::launch_unchecked,
                kv_heads * cfg.cubes_per_kv_head(),
                cfg.units(),
                cfg,
                vec = kv_vec
            ),
            Launch::Cmma(cfg) => launch!(
                paged_prefill_cmma::launch_unchecked,
                heads,
                cfg.units(),
                cfg,
                vec = kv_vec
            ),
            Launch::Fma(cfg) => {
                launch!(paged_prefill_fma::launch_unchecked, heads, cfg.block_q, cfg)
            }
        }
    }
}
