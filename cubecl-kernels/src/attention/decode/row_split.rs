//! Decode kernel for narrow query groups (Qwen3: 2 query heads per kv head, `head_dim` 128):
//! a key row is split over plane lanes, each holding its slice of the query in registers.
//!
//! Launch geometry: one cube per (kv head, sequence, piece of its context); unit
//! `tid = x + lanes·(y + G'·z)`.
//! - `x < lanes`: the units that share one key row, each holding `head_dim / lanes` of the
//!   query's elements in registers; their partial dot products meet through plane shuffles
//!   (xor butterfly), so no cube-wide synchronisation happens while keys stream.
//! - `y < G' = G / heads_per_unit`: the query heads sharing the kv head (`G = heads /
//!   kv_heads`); the `G'` units of a row read the same bytes, which the L1 cache serves once.
//! - `z < streams`: independent key streams; stream `z` takes keys `base + z·tile …` of each
//!   `tile × streams` step and keeps its own online-softmax state (max, sum, output slice).
//!
//! A stream loads `tile` keys and values (16-byte vectors) before it touches any of them, then
//! updates its softmax state once per tile. Every unit runs the same number of steps: keys past
//! the split's end are clamped to a valid slot for the load and masked to zero weight.
//! Without plane operations (CPU runtimes) `lanes = 1` and one unit scores all `G` heads over
//! whole rows. At the end the streams merge through shared memory.
//!
//! Memory layout: see [`super`].

use burn::tensor::DType;
use cubecl::prelude::*;

use super::super::kv_cache::cache_row;
use super::super::kv_read::{KvRead, head_scales, load_f32};
use super::{split_keys, write_merged};
use crate::device_caps::DeviceCaps;

/// Comptime part of the launch (see the module documentation for the unit layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RowSplitConfig {
    /// Query heads per kv head.
    pub group: usize,
    pub head_dim: usize,
    pub kv_heads: usize,
    /// Units sharing one key row (`x`), reduced with plane shuffles when above 1.
    pub lanes: usize,
    /// Query heads each unit scores (`group / heads_per_unit` units along `y`).
    pub heads_per_unit: usize,
    /// Key streams per cube (`z`).
    pub streams: usize,
    /// Consecutive keys a stream loads before it updates its softmax state.
    pub tile: usize,
    /// `block_size % tile == 0`: a stream's tile lies in one cache block.
    pub tile_in_block: bool,
    /// Unroll the per-head and per-slot loops (GPUs: the arrays stay in registers).
    pub unroll: bool,
}

impl RowSplitConfig {
    /// Units per cube.
    pub fn units(&self) -> usize {
        self.lanes * (self.group / self.heads_per_unit) * self.streams
    }
}

/// See the module documentation.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_row_split<F: Float, KV: Float, NV: Size>(
    q: &Tensor<F>,
    k_cache: &Tensor<Vector<KV, NV>>,
    v_cache: &Tensor<Vector<KV, NV>>,
    kv_scales: &Tensor<f32>,
    block_tables: &Tensor<i32>,
    context_lens: &Tensor<i32>,
    out: &mut Tensor<F>,
    part_acc: &mut Tensor<f32>,
    part_stats: &mut Tensor<f32>,
    scale: f32,
    #[comptime] block_size: usize,
    min_keys: usize,
    #[comptime] cfg: RowSplitConfig,
    #[comptime] kv: KvRead,
    #[define(F, KV)] _dtypes: [ElemType; 2],
) {
    let kvh = CUBE_POS_X as usize;
    // An FP8 cache's key scale rides in the query's, its value scale in the output.
    let (ks, vs) = head_scales(kv_scales, kvh, cfg.kv_heads, comptime!(kv.is_fp8()));
    let q_scale = scale * ks;
    let keys = split_keys(context_lens, min_keys, comptime!(cfg.tile * cfg.streams));
    let (seq, start, end) = (keys.seq, keys.start, keys.end);
    let tid = UNIT_POS_X as usize;
    let d = cfg.head_dim;
    let nv = k_cache.vector_size();
    let dv = comptime!(cfg.head_dim / nv); // vectors per key row
    let lanes = cfg.lanes;
    let slots = comptime!(dv / cfg.lanes); // vectors of a key row per unit
    let hpu = cfg.heads_per_unit;
    let ygroups = comptime!(cfg.group / cfg.heads_per_unit);
    let tile = cfg.tile;
    let small = comptime!(cfg.unroll || cfg.heads_per_unit * slots <= 4);
    let x = tid % lanes;
    let y = (tid / lanes) % ygroups;
    let z = tid / (lanes * ygroups);
    let head0 = kvh * cfg.group + y * hpu;

    // This unit's slice of its heads' queries, f32, pre-scaled: [hpu][slots].
    let mut qr = Array::<Vector<f32, NV>>::new(comptime!(cfg.heads_per_unit * slots));
    let mut acc = Array::<Vector<f32, NV>>::new(comptime!(cfg.heads_per_unit * slots));
    let mut m = Array::<f32>::new(hpu);
    let mut l = Array::<f32>::new(hpu);
    #[unroll(small)]
    for hh in 0..hpu {
        m[hh] = f32::new(f32::NEG_INFINITY);
        l[hh] = 0.0;
        #[unroll(small)]
        for sl in 0..slots {
            let mut v = Vector::<f32, NV>::new(0.0);
            let at = seq * q.stride(0) + (head0 + hh) * q.stride(1) + (x + sl * lanes) * nv;
            #[unroll]
            for e in 0..nv {
                v.insert(e, f32::cast_from(q[at + e]) * q_scale);
            }
            qr[hh * slots + sl] = v;
            acc[hh * slots + sl] = Vector::new(0.0);
        }
    }

    let table_row = seq * block_tables.stride(0);
    let mut kr = Array::<Vector<KV, NV>>::new(comptime!(cfg.tile * slots));
    let mut vr = Array::<Vector<KV, NV>>::new(comptime!(cfg.tile * slots));
    let mut s = Array::<f32>::new(comptime!(cfg.heads_per_unit * cfg.tile));
    // Every unit runs the same number of iterations (shuffles need the whole plane);
    // keys past `end` are clamped to a valid one for the loads and masked in the softmax.
    let mut base = start;
    while base < end {
        let k0 = base + z * tile;
        // 1. Load the tile's keys and values (all loads issued before any use).
        let mut block = 0usize;
        if comptime!(cfg.tile_in_block) {
            block = block_tables[table_row + min(k0, end - 1) / block_size] as usize;
        }
        #[unroll]
        for t in 0..tile {
            let key = min(k0 + t, end - 1);
            if comptime!(!cfg.tile_in_block) {
                block = block_tables[table_row + key / block_size] as usize;
            }
            let row = cache_row(block, key % block_size, kvh, cfg.kv_heads, block_size) * dv;
            #[unroll(small)]
            for sl in 0..slots {
                kr[t * slots + sl] = k_cache[row + x + sl * lanes];
                vr[t * slots + sl] = v_cache[row + x + sl * lanes];
            }
        }
        // 2. Scores: partial dot products over this unit's slots, summed over the lanes.
        #[unroll(small)]
        for hh in 0..hpu {
            #[unroll]
            for t in 0..tile {
                let mut dot = Vector::<f32, NV>::new(0.0);
                #[unroll(small)]
                for sl in 0..slots {
                    dot += qr[hh * slots + sl] * load_f32(kr[t * slots + sl], kv);
                }
                let mut part = 0.0f32;
                #[unroll]
                for e in 0..nv {
                    part += dot.extract(e);
                }
                // Butterfly over the `lanes` units of the row (a power of two, aligned
                // within a plane).
                if comptime!(cfg.lanes >= 64) {
                    part += plane_shuffle_xor(part, 32u32);
                }
                if comptime!(cfg.lanes >= 32) {
                    part += plane_shuffle_xor(part, 16u32);
                }
                if comptime!(cfg.lanes >= 16) {
                    part += plane_shuffle_xor(part, 8u32);
                }
                if comptime!(cfg.lanes >= 8) {
                    part += plane_shuffle_xor(part, 4u32);
                }
                if comptime!(cfg.lanes >= 4) {
                    part += plane_shuffle_xor(part, 2u32);
                }
                if comptime!(cfg.lanes >= 2) {
                    part += plane_shuffle_xor(part, 1u32);
                }
                s[hh * tile + t] = select(k0 + t < end, part, f32::new(f32::NEG_INFINITY));
            }
        }
        // 3. Online softmax over the tile, then acc = acc·corr + Σ_t p_t·v_t.
        #[unroll(small)]
        for hh in 0..hpu {
            let mut m_new = m[hh];
            #[unroll]
            for t in 0..tile {
                m_new = max(m_new, s[hh * tile + t]);
            }
            let corr = select(
                m[hh] == f32::new(f32::NEG_INFINITY),
                0.0,
                f32::exp(m[hh] - m_new),
            );
            m[hh] = m_new;
            let mut lsum = l[hh] * corr;
            #[unroll(small)]
            for sl in 0..slots {
                acc[hh * slots + sl] *= Vector::new(corr);
            }
            #[unroll]
            for t in 0..tile {
                let p = select(k0 + t < end, f32::exp(s[hh * tile + t] - m_new), 0.0);
                lsum += p;
                #[unroll(small)]
                for sl in 0..slots {
                    acc[hh * slots + sl] += load_f32(vr[t * slots + sl], kv) * Vector::new(p);
                }
            }
            l[hh] = lsum;
        }
        base += comptime!(cfg.tile * cfg.streams);
    }

    // Merge the streams: [streams][group][D] accumulators and [streams][group] (m, l).
    let mut acc_s = Shared::<[f32]>::new_slice(comptime!(cfg.streams * cfg.group * cfg.head_dim));
    let mut m_s = Shared::<[f32]>::new_slice(comptime!(cfg.streams * cfg.group));
    let mut l_s = Shared::<[f32]>::new_slice(comptime!(cfg.streams * cfg.group));
    #[unroll(small)]
    for hh in 0..hpu {
        let g = y * hpu + hh;
        #[unroll(small)]
        for sl in 0..slots {
            let a = acc[hh * slots + sl] * Vector::new(vs);
            #[unroll]
            for e in 0..nv {
                acc_s[(z * cfg.group + g) * d + (x + sl * lanes) * nv + e] = a.extract(e);
            }
        }
        if x == 0 {
            m_s[z * cfg.group + g] = m[hh];
            l_s[z * cfg.group + g] = l[hh];
        }
    }
    sync_cube();
    write_merged(
        &acc_s,
        &m_s,
        &l_s,
        out,
        part_acc,
        part_stats,
        keys,
        cfg.streams,
        cfg.group,
        cfg.head_dim,
        cfg.kv_heads,
    );
}

/// Keys a stream loads per softmax update (8 measured better than 4 or 16 on the H100).
const TILE_KEYS: usize = 8;

/// The unit layout for `group` query heads per kv head of width `head_dim`.
///
/// With plane shuffles, a key row of `head_dim / vector` 16-byte vectors is read by `lanes`
/// units (a power of two within a plane, one vector each where it fits), each scoring all of the
/// group's heads (measured on the H100 at `G = 2`: better than one head per unit, whose units
/// re-read and re-convert the same row), and cubes of the device's usual size (128 units on
/// CUDA) hold several key streams: at Qwen3-0.6B's heads on the H100, 128-unit cubes (8
/// streams) against 256: bench.py 19,720 against 19,060 out tok/s, ±90 % lengths +5 %, equal
/// +3 %; uniform contexts of 4k–16k keys at 64–256 rows 4–5 % slower (docs/BENCHMARKS.md);
/// 64, 96 and 192 units measured between. Without planes (CPU runtimes) one unit scores whole
/// rows.
/// `BURN_NANOVLLM_DECODE_UNITS=units` aims at another cube size, for benchmarks.
pub(super) fn row_split_config(
    caps: &DeviceCaps,
    dtype: DType,
    group: usize,
    head_dim: usize,
    kv_heads: usize,
    block_size: usize,
) -> RowSplitConfig {
    let dv = head_dim / crate::vector_size(dtype, &[head_dim]);
    let (mut lanes, wanted) = if caps.plane_ops {
        let mut lanes = 1;
        while lanes * 2 <= caps.plane_size.min(dv) && dv.is_multiple_of(lanes * 2) {
            lanes *= 2;
        }
        let units = crate::knobs::Knobs::get().decode_units;
        (lanes, units.unwrap_or(caps.cube_units))
    } else {
        (1, caps.cube_units)
    };
    let mut heads_per_unit = group;
    let mut tile = TILE_KEYS;
    if let Some((l, h, t)) = crate::knobs::Knobs::get()
        .decode_layout
        .filter(|_| caps.plane_ops)
    {
        if l.is_power_of_two() && l <= caps.plane_size && dv.is_multiple_of(l) {
            lanes = l;
        }
        if h > 0 && group.is_multiple_of(h) {
            heads_per_unit = h;
        }
        tile = t.max(1);
    }
    // Fit one stream into a cube: more heads per unit for very wide groups.
    while lanes * group / heads_per_unit > caps.max_cube_units
        || !group.is_multiple_of(heads_per_unit)
    {
        heads_per_unit += 1;
    }
    let row_units = lanes * group / heads_per_unit;
    let streams = (wanted / row_units).clamp(1, caps.max_cube_units / row_units);
    RowSplitConfig {
        group,
        head_dim,
        kv_heads,
        lanes,
        heads_per_unit,
        streams,
        tile,
        tile_in_block: block_size.is_multiple_of(tile),
        unroll: caps.plane_ops,
    }
}
