//! Paged decode attention: one query token per sequence over its cached context, with the
//! context split across cubes when the batch is small and the context long (flash-decoding).
//!
//! Memory layout: `q [B, heads, D]` row-major; caches `[num_blocks, kv_heads, block_size, D]`
//! contiguous; `block_tables [B, max_blocks]` i32; `context_lens [B]` i32.
//!
//! Two kernels, one per shape of the query group (`G = heads / kv_heads` heads per kv head),
//! both one cube per (kv head, sequence, split) reading each key and value once for the group:
//! - [`row_split`] for narrow groups (`G < 4`: Qwen3, Qwen2-1.5B): a key row is split over plane
//!   lanes holding query slices in registers, partial dots meet through shuffles, no cube-wide
//!   synchronisation while keys stream;
//! - [`mma_group`] for wide groups (Qwen2-0.5B's 7, up to 16) on CUDA in bf16/f16: the group's
//!   heads are the rows of a tensor-core tile (`mma.sync`), planes are independent key streams;
//! - [`wide_group`] for wide groups elsewhere: the group's queries in shared memory, one unit per
//!   key, cube reductions per chunk of keys.
//!
//! Context splits ([`split_keys`], the grid's z extent `S` is the most pieces of a sequence):
//! when batch × kv heads is too small to fill the device, each sequence's context is cut into
//! `n = clamp(ceil(ctx / min_keys), 1, S)` pieces of equal length (rounded up to the kernel's
//! key step) from its own context length on the device, so that one launch — and one captured
//! graph, sized for `max_model_len` — serves any context: cubes past a sequence's last piece
//! exit at once, and the combine reads only the pieces that exist (a batch-1 graph used to run
//! all 64 pieces of a 4k bound and combine them). A sequence in one piece is normalised and
//! written to `out [B, heads, D]` by its cube; otherwise each piece writes its unnormalised
//! accumulator, max and sum to a workspace and [`combine_splits`] merges them. A batch that
//! fills the device alone is not split: pieces of at least 1,024 keys for its long contexts
//! (`BURN_NANOVLLM_DECODE_SPLIT_KEYS`, so that one long sequence among short ones would not set
//! the launch's time) measured 1–2 % slower end to end and 5 % at 256 × 16k on the H100
//! (docs/BENCHMARKS.md). Batch-invariant launches (`ReductionOrder::BatchInvariant`, through
//! `paged_attention_ordered`) cut every context by its own length alone (pieces of 512 keys,
//! at most 16), so that a row's result does not depend on the batch it is in.

mod mma_group;
mod row_split;
mod wide_group;

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{ops::numeric::empty_device_dtype, tensor::CubeTensor};
use cubecl::prelude::*;

use super::mma_tile::StageSoftmax;
use crate::device_caps::DeviceCaps;

/// Groups of at least this many query heads per kv head take the wide-group kernel.
const WIDE_GROUP: usize = 4;

/// Planes (key streams) per cube of the tensor-core kernel.
const MMA_PLANES: usize = 4;

/// Keys per piece of a batch-invariant decode launch (rounded up to the kernel's key step):
/// a context is cut by its own length alone, into `clamp(ceil(ctx / keys), 1,
/// INVARIANT_MAX_SPLITS)` pieces.
const INVARIANT_SPLIT_KEYS: usize = 512;

/// Most pieces of a context in a batch-invariant decode launch (the grid's z extent).
const INVARIANT_MAX_SPLITS: usize = 16;

/// Most context splits of one (sequence, kv head); the combine walks them serially.
const MAX_SPLITS: usize = 64;

/// The keys of one cube's piece of its sequence's context: `start..end` of piece `split` of
/// `splits`, sequence `seq` (the grid's y).
#[derive(CubeType, Clone, Copy)]
pub(super) struct SplitKeys {
    pub seq: usize,
    pub split: usize,
    pub splits: usize,
    pub start: usize,
    pub end: usize,
}

/// Pieces of a context of `ctx` keys and their length: `(splits, len)` with `len` a multiple
/// of `step`, `splits · len ≥ ctx` and no empty piece (module doc).
#[cube]
pub(super) fn split_plan(
    ctx: usize,
    min_keys: usize,
    max_splits: usize,
    #[comptime] step: usize,
) -> (usize, usize) {
    let wanted = min(max(ctx.div_ceil(min_keys), 1usize), max_splits);
    let len = ctx.div_ceil(wanted).div_ceil(step) * step;
    (ctx.div_ceil(len), len)
}

/// The prologue of every decode kernel: this cube's piece of its sequence's context. Padding
/// rows of a captured step (context 0) and cubes past the sequence's last piece exit here.
#[cube]
pub(super) fn split_keys(
    context_lens: &Tensor<i32>,
    min_keys: usize,
    #[comptime] step: usize,
) -> SplitKeys {
    let seq = CUBE_POS_Y as usize;
    let split = CUBE_POS_Z as usize;
    let ctx = context_lens[seq] as usize;
    if ctx == 0 {
        terminate!();
    }
    let (splits, len) = split_plan(ctx, min_keys, CUBE_COUNT_Z as usize, step);
    if split >= splits {
        terminate!();
    }
    let start = split * len;
    SplitKeys {
        seq,
        split,
        splits,
        start,
        end: min(ctx, start + len),
    }
}

/// Writes element `j` of head `h`'s result for piece `split` of `splits` of sequence `seq`
/// ([`SplitKeys`]): normalised into `out [B, heads, D]` when the sequence is one piece, else
/// the piece's partials `num`, `big` (max) and `den` (sum) for [`combine_splits`] (row
/// `(seq · heads + h) · S + split`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn write_piece<F: Float>(
    out: &mut Tensor<F>,
    part_acc: &mut Tensor<f32>,
    part_stats: &mut Tensor<f32>,
    seq: usize,
    split: usize,
    splits: usize,
    h: usize,
    j: usize,
    num: f32,
    big: f32,
    den: f32,
    #[comptime] heads: usize,
    #[comptime] head_dim: usize,
) {
    if splits == 1 {
        let at = seq * out.stride(0) + h * out.stride(1) + j;
        out[at] = F::cast_from(num / den);
    } else {
        let row = (seq * heads + h) * (CUBE_COUNT_Z as usize) + split;
        part_acc[row * head_dim + j] = num;
        if j == 0 {
            part_stats[row * 2] = big;
            part_stats[row * 2 + 1] = den;
        }
    }
}

/// Combines the pieces of the sequences split in more than one:
/// `out = Σ_s acc_s·e^(m_s − M) / Σ_s l_s·e^(m_s − M)`.
///
/// Grid: one cube per (head, sequence); units over `D`. `max_splits` (the attention grid's z
/// extent), `min_keys` and `step` give each sequence's pieces as [`split_plan`] does. Rows with
/// no context (padding) or in one piece (written by the attention kernel) are skipped.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn combine_splits<F: Float>(
    part_acc: &Tensor<f32>,
    part_stats: &Tensor<f32>,
    context_lens: &Tensor<i32>,
    out: &mut Tensor<F>,
    max_splits: usize,
    min_keys: usize,
    #[comptime] step: usize,
    #[comptime] heads: usize,
    #[comptime] head_dim: usize,
    #[define(F)] _dtype: ElemType,
) {
    let h = CUBE_POS_X as usize;
    let seq = CUBE_POS_Y as usize;
    let ctx = context_lens[seq] as usize;
    if ctx == 0 {
        terminate!();
    }
    let (splits, _len) = split_plan(ctx, min_keys, max_splits, step);
    if splits == 1 {
        terminate!();
    }
    let row0 = (seq * heads + h) * max_splits;
    let mut big = f32::new(f32::NEG_INFINITY);
    for s in 0..splits {
        big = max(big, part_stats[(row0 + s) * 2]);
    }
    let mut j = UNIT_POS_X as usize;
    while j < head_dim {
        let mut num = 0.0f32;
        let mut den = 0.0f32;
        for s in 0..splits {
            let m = part_stats[(row0 + s) * 2];
            let w = select(m == f32::new(f32::NEG_INFINITY), 0.0, f32::exp(m - big));
            num += part_acc[(row0 + s) * head_dim + j] * w;
            den += part_stats[(row0 + s) * 2 + 1] * w;
        }
        let at = seq * out.stride(0) + h * out.stride(1) + j;
        out[at] = F::cast_from(num / den);
        j += CUBE_DIM_X as usize;
    }
}

/// Merges the states of a cube's key streams — `acc_s [streams][group][D]` (unnormalised
/// outputs), `m_s`, `l_s [streams][group]` (running max and sum) — of one (kv head, piece)
/// and writes them ([`write_piece`]). Units over `group × D`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(super) fn write_merged<F: Float>(
    acc_s: &Shared<[f32]>,
    m_s: &Shared<[f32]>,
    l_s: &Shared<[f32]>,
    out: &mut Tensor<F>,
    part_acc: &mut Tensor<f32>,
    part_stats: &mut Tensor<f32>,
    keys: SplitKeys,
    #[comptime] streams: usize,
    #[comptime] group: usize,
    #[comptime] head_dim: usize,
    #[comptime] kv_heads: usize,
) {
    let kvh = CUBE_POS_X as usize;
    let (seq, split, splits) = (keys.seq, keys.split, keys.splits);
    let mut e = UNIT_POS_X as usize;
    while e < comptime!(group * head_dim) {
        let g = e / head_dim;
        let j = e % head_dim;
        let mut big = f32::new(f32::NEG_INFINITY);
        for zz in 0..streams {
            big = max(big, m_s[zz * group + g]);
        }
        let mut num = 0.0f32;
        let mut den = 0.0f32;
        for zz in 0..streams {
            let mz = m_s[zz * group + g];
            let w = select(mz == f32::new(f32::NEG_INFINITY), 0.0, f32::exp(mz - big));
            num += acc_s[(zz * group + g) * head_dim + j] * w;
            den += l_s[zz * group + g] * w;
        }
        write_piece(
            out,
            part_acc,
            part_stats,
            seq,
            split,
            splits,
            kvh * group + g,
            j,
            num,
            big,
            den,
            comptime!(group * kv_heads),
            head_dim,
        );
        e += CUBE_DIM_X as usize;
    }
}

/// Host side of decode attention: rows `0..B` of `launch.q [T, heads, D]` (`B` =
/// `context_lens`' length, `B ≤ T`), one token per sequence, into the same rows of
/// `launch.out`. Rows of context 0 (a captured step's padding) are neither read nor written.
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_decode(
    launch: &super::AttentionLaunch,
    k_cache: CubeTensor,
    v_cache: CubeTensor,
    kv_scales: CubeTensor,
    block_tables: CubeTensor,
    context_lens: CubeTensor,
    max_context: usize,
    plan: &super::AttentionPlan,
) {
    let (scale, order, kv_dtype) = (plan.scale, plan.order, plan.kv_dtype);
    let caps = DeviceCaps::of(&launch.q.client);
    let kv_read = super::kv_read::KvRead::new(kv_dtype, &caps);
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
    let b = context_lens.meta.shape()[0];
    let dtype = q.dtype;
    if b == 0 {
        return;
    }
    let group = heads / kv_heads;
    let vec = crate::vector_size(dtype, &[d]);
    let mma = mma_group::MmaGroupConfig {
        group,
        head_dim: d,
        kv_heads,
        planes: crate::knobs::Knobs::get()
            .decode_mma_planes
            .unwrap_or(MMA_PLANES),
        softmax: StageSoftmax::from_knobs(),
        f16_stage: kv_read.ptx_cvt && !crate::knobs::Knobs::get().fp8_stage_bf16,
    };
    let kernel = if (WIDE_GROUP..=16).contains(&group)
        && mma.planes > 0
        && mma.units() <= caps.max_cube_units
        && mma.shared_bytes(dtype.size()) <= caps.shared_bytes
        && super::mma_fits(&caps, dtype, d, vec)
    {
        Kernel::Mma(mma)
    } else if group >= WIDE_GROUP {
        Kernel::WideGroup(wide_group::WideGroupConfig {
            group,
            head_dim: d,
            kv_heads,
            cube_dim: caps.cube_units,
            use_plane: caps.plane_ops,
        })
    } else {
        Kernel::RowSplit(row_split::row_split_config(
            &caps, dtype, group, d, kv_heads, block_size,
        ))
    };
    let (units, step) = match &kernel {
        Kernel::Mma(c) => (c.units(), c.step()),
        Kernel::WideGroup(c) => (c.cube_dim, c.cube_dim),
        Kernel::RowSplit(c) => (c.units(), c.tile * c.streams),
    };
    // Enough cubes to fill the device: split every context when batch × kv heads is small.
    let cubes = b * kv_heads;
    // Cubes per multiprocessor to aim for: the row-split kernel's small register-light cubes
    // stack (half the unit limit's worth); the wide-group kernel measured best at two (more
    // splits at batch 256 cost it 13 % on the H100).
    let resident = match &kernel {
        Kernel::RowSplit(_) if caps.plane_ops => (caps.max_cube_units / units).max(1),
        Kernel::Mma(_) => 4,
        _ => 2,
    };
    let target = resident * caps.multiprocessors;
    let chunks = max_context.div_ceil(step).max(1);
    let fill = target.div_ceil(cubes).min(chunks).clamp(1, MAX_SPLITS);
    let (splits, min_keys) = match crate::knobs::Knobs::get().decode_split_keys {
        // Pieces from each row's own context: the same whatever the batch and its bound.
        _ if order == crate::ReductionOrder::BatchInvariant => (
            INVARIANT_MAX_SPLITS,
            INVARIANT_SPLIT_KEYS.next_multiple_of(step),
        ),
        // The batch (nearly) fills the device alone: one piece per sequence, unless the knob
        // asks for pieces of at least `keys` (module doc).
        Some(keys) if fill <= 2 && keys > 0 => {
            let keys = keys.next_multiple_of(step);
            (max_context.div_ceil(keys).clamp(1, MAX_SPLITS), keys)
        }
        _ if fill <= 2 => (1, max_context.max(1)),
        _ => (fill, step),
    };
    let rows = if splits > 1 { b * heads * splits } else { 1 };
    let workspace = |n: usize| {
        empty_device_dtype(
            q.client.clone(),
            q.device.clone(),
            Shape::new([n]),
            DType::F32,
        )
    };
    let (part_acc, part_stats) = (workspace(rows * d), workspace(rows * 2));
    let count = CubeCount::Static(kv_heads as u32, b as u32, splits as u32);
    let address = super::address_type(&[&k_cache, q]);
    // SAFETY: keys are read only below each sequence's context length, through block-table
    // entries the metadata checked; rows below B ≤ T of q and out, B × heads × D elements.
    unsafe {
        // The three kernels take the same arguments; only the function, its config and its
        // element types differ.
        let dtypes = [dtype_to_storage_type(dtype), kv_dtype.storage(dtype)];
        macro_rules! launch {
            ($kernel:path, $cfg:expr, $dtypes:expr) => {
                $kernel(
                    &q.client,
                    count,
                    CubeDim::new_1d(units as u32),
                    address,
                    vec,
                    q.clone().into_tensor_arg(),
                    k_cache.into_tensor_arg(),
                    v_cache.into_tensor_arg(),
                    kv_scales.into_tensor_arg(),
                    block_tables.into_tensor_arg(),
                    context_lens.clone().into_tensor_arg(),
                    out.clone().into_tensor_arg(),
                    part_acc.clone().into_tensor_arg(),
                    part_stats.clone().into_tensor_arg(),
                    scale,
                    block_size,
                    min_keys,
                    $cfg,
                    kv_read,
                    $dtypes,
                )
            };
        }
        match kernel {
            Kernel::Mma(cfg) => {
                let mma = if cfg.f16_stage {
                    dtype_to_storage_type(DType::F16)
                } else {
                    dtypes[0]
                };
                let dtypes = [dtypes[0], dtypes[1], mma];
                launch!(mma_group::paged_decode_mma::launch_unchecked, cfg, dtypes)
            }
            Kernel::WideGroup(cfg) => {
                launch!(
                    wide_group::paged_decode_wide_group::launch_unchecked,
                    cfg,
                    dtypes
                )
            }
            Kernel::RowSplit(cfg) => {
                launch!(
                    row_split::paged_decode_row_split::launch_unchecked,
                    cfg,
                    dtypes
                )
            }
        }
        if splits > 1 {
            combine_splits::launch_unchecked(
                &q.client,
                CubeCount::Static(heads as u32, b as u32, 1),
                CubeDim::new_1d(caps.cube_units.min(d) as u32),
                part_acc.into_tensor_arg(),
                part_stats.into_tensor_arg(),
                context_lens.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                splits,
                min_keys,
                step,
                heads,
                d,
                dtype_to_storage_type(dtype),
            );
        }
    }
}

/// The kernel a launch takes, with its comptime configuration.
enum Kernel {
    Mma(mma_group::MmaGroupConfig),
    WideGroup(wide_group::WideGroupConfig),
    RowSplit(row_split::RowSplitConfig),
}
