//! Decode kernel for wide query groups (Qwen2-0.5B: 7 query heads per kv head, `head_dim` 64):
//! the group's queries live in shared memory and one unit scores a whole key against all of them.
//!
//! Launch geometry: one cube of `cube_dim` units per (kv head, sequence, piece of its context). The cube walks its
//! split in chunks of `cube_dim` keys:
//! 1. unit `u` scores key `chunk + u` against the `G` queries (queries broadcast from shared
//!    memory as f32, the key read as 16-byte vectors; scores → shared memory);
//! 2. per-head chunk maxima are cube reductions (plane reductions where available); the running
//!    max/sum/rescale of the online softmax are kept redundantly by every unit;
//! 3. the output elements `(g, d)` are spread over the units, which accumulate `p · v` reading
//!    `v` rows coalesced along `d`.
//!
//! Memory layout: see [`super`]. Measured on the H100 (docs/BENCHMARKS.md) this beats the
//! row-split kernel at `G = 7`, where the row split's per-head shuffles and exponentials cost
//! more than the shared-memory broadcast of the queries.

use cubecl::prelude::*;

use super::super::kv_cache::cache_row;
use super::super::kv_read::{KvRead, head_scales, load_f32};
use super::{split_keys, write_piece};

/// Comptime part of the launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WideGroupConfig {
    pub group: usize,
    pub head_dim: usize,
    pub kv_heads: usize,
    pub cube_dim: usize,
    pub use_plane: bool,
}

/// How the PV phase spreads a cube over keys: `lanes` units share one value row of `dv`
/// vectors (`slots` each), `kgroups` keys are in flight, each unit walks `keys_per_group` of a
/// chunk's keys. `lanes` divides `dv`; when it does not divide the cube, the last
/// `units − kgroups·lanes` units sit the PV phase out (D = 40 in f32: 10 vectors a row, 25 key
/// groups of a 256-unit cube).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PvSplit {
    pub lanes: usize,
    pub slots: usize,
    pub kgroups: usize,
    pub keys_per_group: usize,
}

impl PvSplit {
    /// The split of a `units`-wide cube over rows of `dv` vectors.
    pub fn new(dv: usize, units: usize) -> Self {
        let mut lanes = dv.min(units).max(1);
        while !dv.is_multiple_of(lanes) {
            lanes -= 1;
        }
        let kgroups = units / lanes;
        Self {
            lanes,
            slots: dv / lanes,
            kgroups,
            keys_per_group: units.div_ceil(kgroups),
        }
    }
}

/// Per-head reduction over the cube: `values[g]` of every unit → totals (max or sum) in
/// `out[g]`, visible to all units. `scratch`: `group × CUBE_DIM` slots.
#[cube]
fn group_reduce(
    values: &Array<f32>,
    out: &mut Array<f32>,
    scratch: &mut Shared<[f32]>,
    #[comptime] group: usize,
    #[comptime] cube_dim: usize,
    #[comptime] is_max: bool,
    #[comptime] use_plane: bool,
) {
    let parts = if comptime!(use_plane) {
        CUBE_DIM_X / PLANE_DIM
    } else {
        CUBE_DIM_X
    };
    let slot = if comptime!(use_plane) {
        PLANE_POS as usize
    } else {
        UNIT_POS_X as usize
    };
    #[unroll]
    for g in 0..group {
        let mut v = values[g];
        if comptime!(use_plane) {
            v = if comptime!(is_max) {
                plane_max(v)
            } else {
                plane_sum(v)
            };
            if UNIT_POS_PLANE == 0 {
                scratch[g * cube_dim + slot] = v;
            }
        } else {
            scratch[g * cube_dim + slot] = v;
        }
    }
    sync_cube();
    #[unroll]
    for g in 0..group {
        let mut acc = if comptime!(is_max) {
            f32::new(f32::NEG_INFINITY)
        } else {
            f32::new(0.0)
        };
        for p in 0..parts {
            let v = scratch[g * cube_dim + p as usize];
            acc = if comptime!(is_max) {
                max(acc, v)
            } else {
                acc + v
            };
        }
        out[g] = acc;
    }
    sync_cube();
}

/// See the module documentation.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_wide_group<F: Float, KV: Float, NV: Size>(
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
    #[comptime] cfg: WideGroupConfig,
    #[comptime] kv: KvRead,
    #[define(F, KV)] _dtypes: [ElemType; 2],
) {
    let kvh = CUBE_POS_X as usize;
    // An FP8 cache's key scale rides in the scores' scale, its value scale in the output.
    let (ks, vs) = head_scales(kv_scales, kvh, cfg.kv_heads, comptime!(kv.is_fp8()));
    let score_scale = scale * ks;
    let keys = split_keys(context_lens, min_keys, cfg.cube_dim);
    let (seq, split, splits) = (keys.seq, keys.split, keys.splits);
    let (start, end) = (keys.start, keys.end);
    let tid = UNIT_POS_X as usize;
    let d = cfg.head_dim;
    let group = cfg.group;
    let units = cfg.cube_dim;
    let nv = k_cache.vector_size();
    let dv = comptime!(cfg.head_dim / nv); // vectors per key row
    let lanes = comptime!(PvSplit::new(dv, units).lanes); // units per key in the PV phase
    let kgroups = comptime!(PvSplit::new(dv, units).kgroups); // keys in flight in the PV phase
    let slots = comptime!(PvSplit::new(dv, units).slots); // vectors of a key row per unit
    let keys_per_group = comptime!(PvSplit::new(dv, units).keys_per_group);
    let heads = comptime!(cfg.group * cfg.kv_heads);

    // The group's queries, f32, [group][D].
    let mut q_s = Shared::<[f32]>::new_slice(comptime!(cfg.group * cfg.head_dim));
    let mut e = tid;
    while e < comptime!(cfg.group * cfg.head_dim) {
        let h = kvh * group + e / d;
        q_s[e] = f32::cast_from(q[seq * q.stride(0) + h * q.stride(1) + e % d]);
        e += CUBE_DIM_X as usize;
    }
    let mut p_s = Shared::<[f32]>::new_slice(comptime!(cfg.group * cfg.cube_dim));
    let mut base_s = Shared::<[u32]>::new_slice(cfg.cube_dim);
    let mut scratch = Shared::<[f32]>::new_slice(comptime!(cfg.group * cfg.cube_dim));
    sync_cube();

    let mut m = Array::<f32>::new(group);
    let mut l = Array::<f32>::new(group);
    let mut s = Array::<f32>::new(group);
    let mut tot = Array::<f32>::new(group);
    let mut acc = Array::<Vector<f32, NV>>::new(comptime!(cfg.group * slots));
    #[unroll]
    for g in 0..group {
        m[g] = f32::new(f32::NEG_INFINITY);
        l[g] = 0.0;
    }
    #[unroll]
    for i in 0..comptime!(cfg.group * slots) {
        acc[i] = Vector::new(0.0);
    }
    let table_row = seq * block_tables.stride(0);
    let lane = tid % lanes;
    let kgroup = tid / lanes;

    let mut chunk = start;
    while chunk < end {
        // 1. Unit `tid` scores key `chunk + tid` against the group's queries (16-byte loads).
        let key = chunk + tid;
        let valid = key < end;
        let mut base = 0usize;
        if valid {
            let block = block_tables[table_row + key / block_size] as usize;
            base = cache_row(block, key % block_size, kvh, cfg.kv_heads, block_size) * dv;
        }
        base_s[tid] = base as u32;
        #[unroll]
        for g in 0..group {
            s[g] = f32::new(f32::NEG_INFINITY);
        }
        if valid {
            let mut dots = Array::<f32>::new(group);
            #[unroll]
            for g in 0..group {
                dots[g] = 0.0;
            }
            #[unroll]
            for j in 0..dv {
                let kf = load_f32(k_cache[base + j], kv);
                #[unroll]
                for e in 0..nv {
                    let kval = kf.extract(e);
                    #[unroll]
                    for g in 0..group {
                        dots[g] += q_s[g * d + j * nv + e] * kval;
                    }
                }
            }
            #[unroll]
            for g in 0..group {
                s[g] = dots[g] * score_scale;
            }
        }
        // 2. Online softmax: new running max (a cube reduction), this key's probability.
        group_reduce(
            &s,
            &mut tot,
            &mut scratch,
            group,
            cfg.cube_dim,
            true,
            cfg.use_plane,
        );
        #[unroll]
        for g in 0..group {
            let m_new = max(m[g], tot[g]);
            let p = select(valid, f32::exp(s[g] - m_new), 0.0);
            let corr = select(
                m[g] == f32::new(f32::NEG_INFINITY),
                0.0,
                f32::exp(m[g] - m_new),
            );
            p_s[g * cfg.cube_dim + tid] = p;
            l[g] = l[g] * corr + p; // this unit's keys; summed over units at the end
            tot[g] = corr;
            m[g] = m_new;
        }
        sync_cube();
        // 3. acc(g, ·) = acc·corr + Σ_keys p·v, `kgroups` keys in flight, 16-byte loads of v.
        #[unroll]
        for g in 0..group {
            #[unroll]
            for sl in 0..slots {
                acc[g * slots + sl] *= Vector::new(tot[g]);
            }
        }
        let n_keys = min(end - chunk, CUBE_DIM_X as usize);
        #[unroll]
        for i in 0..keys_per_group {
            let kk = kgroup + i * kgroups;
            if kgroup < kgroups && kk < n_keys {
                let vbase = base_s[kk] as usize;
                #[unroll]
                for sl in 0..slots {
                    let vv = load_f32(v_cache[vbase + lane + sl * lanes], kv);
                    #[unroll]
                    for g in 0..group {
                        acc[g * slots + sl] += vv * Vector::new(p_s[g * cfg.cube_dim + kk]);
                    }
                }
            }
        }
        sync_cube();
        chunk += CUBE_DIM_X as usize;
    }

    // Totals: l over units, acc over key groups (through shared memory, reusing `scratch`
    // for l and a [kgroups][group][D] buffer for acc).
    let mut l_tot = Array::<f32>::new(group);
    group_reduce(
        &l,
        &mut l_tot,
        &mut scratch,
        group,
        cfg.cube_dim,
        false,
        cfg.use_plane,
    );
    let mut red = Shared::<[f32]>::new_slice(comptime!(kgroups * cfg.group * cfg.head_dim));
    if kgroup < kgroups {
        #[unroll]
        for g in 0..group {
            #[unroll]
            for sl in 0..slots {
                let a = acc[g * slots + sl];
                #[unroll]
                for e in 0..nv {
                    red[(kgroup * group + g) * d + (lane + sl * lanes) * nv + e] = a.extract(e);
                }
            }
        }
    }
    sync_cube();
    let mut e = tid;
    while e < comptime!(cfg.group * cfg.head_dim) {
        let g = e / d;
        let j = e % d;
        let mut a = 0.0f32;
        for kg in 0..kgroups {
            a += red[(kg * group + g) * d + j];
        }
        a *= vs;
        write_piece(
            out,
            part_acc,
            part_stats,
            seq,
            split,
            splits,
            kvh * group + g,
            j,
            a,
            m[g],
            l_tot[g],
            heads,
            cfg.head_dim,
        );
        e += CUBE_DIM_X as usize;
    }
}
