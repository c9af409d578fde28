//! Paged decode attention: one query token per sequence over its cached context, with the
//! context split across cubes when the batch is small and the context long (flash-decoding).
//!
//! Memory layout: `q [B, heads, D]` row-major; caches `[num_blocks, block_size, kv_heads, D]`
//! contiguous; `block_tables [B, max_blocks]` i32; `context_lens [B]` i32.
//!
//! Launch geometry: one cube per (kv head, sequence, split). The cube holds the `G = heads /
//! kv_heads` queries that share the kv head in shared memory (f32), so each key and value is
//! read once for the whole group. It walks its split in chunks of `CUBE_DIM` keys:
//! 1. unit `u` scores key `chunk + u` against the `G` queries (scores → shared memory);
//! 2. per-head chunk maxima and sums are cube reductions (plane reductions where available);
//!    the running max/sum/rescale of the online softmax are kept redundantly by every unit;
//! 3. the output elements `(g, d)` are spread over the units, which accumulate `p · v` reading
//!    `v` rows coalesced along `d`.
//!
//! With one split the cube normalises and writes `out [B, heads, D]`; otherwise it writes its
//! unnormalised accumulator, max and sum to a workspace and a second kernel combines the splits.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{ops::numeric::empty_device_dtype, tensor::CubeTensor};
use cubecl::prelude::{CubeCount, CubeDim};

use crate::device_caps::DeviceCaps;

pub(crate) mod kernel {
    use cubecl::prelude::*;

    /// Comptime part of the launch.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct DecodeConfig {
        pub group: usize,
        pub head_dim: usize,
        pub kv_heads: usize,
        pub cube_dim: usize,
        pub splits: usize,
        pub use_plane: bool,
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
    #[cube(launch_unchecked)]
    #[allow(clippy::too_many_arguments)]
    pub fn paged_decode<F: Float>(
        q: &Tensor<F>,
        k_cache: &Tensor<F>,
        v_cache: &Tensor<F>,
        block_tables: &Tensor<i32>,
        context_lens: &Tensor<i32>,
        out: &mut Tensor<F>,
        part_acc: &mut Tensor<f32>,
        part_stats: &mut Tensor<f32>,
        scale: f32,
        block_size: usize,
        split_len: usize,
        #[comptime] cfg: DecodeConfig,
        #[define(F)] _dtype: ElemType,
    ) {
        let kvh = CUBE_POS_X as usize;
        let seq = CUBE_POS_Y as usize;
        let split = CUBE_POS_Z as usize;
        let tid = UNIT_POS_X as usize;
        let d = cfg.head_dim;
        let group = cfg.group;
        let heads = comptime!(cfg.group * cfg.kv_heads);
        let ctx = context_lens[seq] as usize;
        let start = split * split_len;
        let end = min(ctx, start + split_len);
        let owned = comptime!((cfg.group * cfg.head_dim).div_ceil(cfg.cube_dim));

        // The group's queries, f32.
        let mut q_s = Shared::<[f32]>::new_slice(comptime!(cfg.group * cfg.head_dim));
        let mut e = tid;
        while e < comptime!(cfg.group * cfg.head_dim) {
            let g = e / d;
            let h = kvh * group + g;
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
        let mut acc = Array::<f32>::new(owned);
        #[unroll]
        for g in 0..group {
            m[g] = f32::new(f32::NEG_INFINITY);
            l[g] = 0.0;
        }
        #[unroll]
        for i in 0..owned {
            acc[i] = 0.0;
        }
        let table_row = seq * block_tables.stride(0);

        let mut chunk = start;
        while chunk < end {
            // 1. Scores of key `chunk + tid`.
            let key = chunk + tid;
            let valid = key < end;
            let mut base = 0usize;
            if valid {
                let block = block_tables[table_row + key / block_size] as usize;
                base = ((block * block_size + key % block_size) * cfg.kv_heads + kvh) * d;
            }
            base_s[tid] = base as u32;
            #[unroll]
            for g in 0..group {
                s[g] = f32::new(f32::NEG_INFINITY);
            }
            if valid {
                #[unroll]
                for g in 0..group {
                    let mut dot = 0.0f32;
                    for j in 0..d {
                        dot += q_s[g * d + j] * f32::cast_from(k_cache[base + j]);
                    }
                    s[g] = dot * scale;
                }
            }
            // 2. Online softmax over the chunk.
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
                p_s[g * cfg.cube_dim + tid] = p;
                s[g] = p;
                // Rescale of what was accumulated so far (0 → 0 before the first key).
                tot[g] = select(
                    m[g] == f32::new(f32::NEG_INFINITY),
                    0.0,
                    f32::exp(m[g] - m_new),
                );
                m[g] = m_new;
            }
            let mut sums = Array::<f32>::new(group);
            group_reduce(
                &s,
                &mut sums,
                &mut scratch,
                group,
                cfg.cube_dim,
                false,
                cfg.use_plane,
            );
            #[unroll]
            for g in 0..group {
                l[g] = l[g] * tot[g] + sums[g];
            }
            // 3. acc(g, j) += Σ_keys p · v.
            let n_keys = min(end - chunk, CUBE_DIM_X as usize);
            #[unroll]
            for i in 0..owned {
                let e = tid + i * cfg.cube_dim;
                if e < comptime!(cfg.group * cfg.head_dim) {
                    let g = e / d;
                    let j = e % d;
                    let mut a = acc[i] * tot[g];
                    for kk in 0..n_keys {
                        let vbase = base_s[kk] as usize;
                        a += p_s[g * cfg.cube_dim + kk] * f32::cast_from(v_cache[vbase + j]);
                    }
                    acc[i] = a;
                }
            }
            sync_cube();
            chunk += CUBE_DIM_X as usize;
        }

        #[unroll]
        for i in 0..owned {
            let e = tid + i * cfg.cube_dim;
            if e < comptime!(cfg.group * cfg.head_dim) {
                let g = e / d;
                let j = e % d;
                let h = kvh * group + g;
                if comptime!(cfg.splits == 1) {
                    let at = seq * out.stride(0) + h * out.stride(1) + j;
                    out[at] = F::cast_from(acc[i] / l[g]);
                } else {
                    let row = (seq * heads + h) * cfg.splits + split;
                    part_acc[row * d + j] = acc[i];
                    if j == 0 {
                        part_stats[row * 2] = m[g];
                        part_stats[row * 2 + 1] = l[g];
                    }
                }
            }
        }
    }

    /// Combines the splits: `out = Σ_s acc_s·e^(m_s − M) / Σ_s l_s·e^(m_s − M)`.
    ///
    /// Grid: one cube per (head, sequence); units over `D`.
    #[cube(launch_unchecked)]
    pub fn combine_splits<F: Float>(
        part_acc: &Tensor<f32>,
        part_stats: &Tensor<f32>,
        out: &mut Tensor<F>,
        #[comptime] heads: usize,
        #[comptime] head_dim: usize,
        #[comptime] splits: usize,
        #[define(F)] _dtype: ElemType,
    ) {
        let h = CUBE_POS_X as usize;
        let seq = CUBE_POS_Y as usize;
        let row0 = (seq * heads + h) * splits;
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
}

/// Host side of decode attention. `q [B, heads, D]`; returns `[B, heads, D]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_decode(
    q: CubeTensor,
    k_cache: CubeTensor,
    v_cache: CubeTensor,
    block_tables: CubeTensor,
    context_lens: CubeTensor,
    max_context: usize,
    scale: f32,
) -> CubeTensor {
    let caps = DeviceCaps::of(&q.client);
    let q = super::unit_inner_stride(q);
    let (b, heads, d) = {
        let s = q.meta.shape();
        (s[0], s[1], s[2])
    };
    let cache_shape = k_cache.meta.shape();
    let (block_size, kv_heads) = (cache_shape[1], cache_shape[2]);
    let dtype = q.dtype;
    let out = empty_device_dtype(
        q.client.clone(),
        q.device.clone(),
        Shape::new([b, heads, d]),
        dtype,
    );
    if b == 0 {
        return out;
    }
    let cube_dim = caps.cube_units;
    // Enough cubes to fill the device: split long contexts when batch × kv heads is small.
    let cubes = b * kv_heads;
    let target = 2 * caps.multiprocessors;
    let chunks = max_context.div_ceil(cube_dim).max(1);
    let splits = if cubes >= target {
        1
    } else {
        target.div_ceil(cubes).min(chunks).clamp(1, 64)
    };
    let split_len = chunks.div_ceil(splits) * cube_dim;
    let splits = max_context.div_ceil(split_len).max(1);
    let cfg = kernel::DecodeConfig {
        group: heads / kv_heads,
        head_dim: d,
        kv_heads,
        cube_dim,
        splits,
        use_plane: caps.plane_ops,
    };
    let rows = if splits > 1 { b * heads * splits } else { 1 };
    let part_acc = empty_device_dtype(
        q.client.clone(),
        q.device.clone(),
        Shape::new([rows * d]),
        DType::F32,
    );
    let part_stats = empty_device_dtype(
        q.client.clone(),
        q.device.clone(),
        Shape::new([rows * 2]),
        DType::F32,
    );
    // SAFETY: keys are read only below each sequence's context length, through block-table
    // entries the metadata checked; output indices are below B × heads × D.
    unsafe {
        kernel::paged_decode::launch_unchecked(
            &q.client,
            CubeCount::Static(kv_heads as u32, b as u32, splits as u32),
            CubeDim::new_1d(cube_dim as u32),
            q.clone().into_tensor_arg(),
            k_cache.into_tensor_arg(),
            v_cache.into_tensor_arg(),
            block_tables.into_tensor_arg(),
            context_lens.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            part_acc.clone().into_tensor_arg(),
            part_stats.clone().into_tensor_arg(),
            scale,
            block_size,
            split_len,
            cfg,
            dtype_to_storage_type(dtype),
        );
        if splits > 1 {
            kernel::combine_splits::launch_unchecked(
                &q.client,
                CubeCount::Static(heads as u32, b as u32, 1),
                CubeDim::new_1d(cube_dim.min(d) as u32),
                part_acc.into_tensor_arg(),
                part_stats.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                heads,
                d,
                splits,
                dtype_to_storage_type(dtype),
            );
        }
    }
    out
}
