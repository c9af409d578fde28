//! The KV-cache write, with the query/key preprocessing of a Qwen layer fused in: Qwen3's
//! per-head q/k RMSNorm and the rotate-half RoPE.
//!
//! Memory layout: `q`, `k`, `v` are column ranges of row-major `[T, width]` matrices (the merged
//! qkv projection, or separate tensors), head `h` at columns `offset + h·D .. offset + (h+1)·D`.
//! The caches are `[num_blocks, kv_heads, block_size, D]`, contiguous: slot `s` of head `h`
//! starts at row `cache_row(s / block_size, s % block_size, h)` (`super::kv_cache`). RoPE
//! tables `cos`, `sin` are `[max_pos, D/2]` f32.
//!
//! Launch geometry: one cube per (token, group of `H` heads) over `heads + kv_heads` heads
//! (`kv_heads` only for a plain write), `U` units per head (`H·U` per cube): unit `u` works on
//! head `group·H + u / U` and owns its rotation pairs `(j, j + D/2)` at `j = u mod U + i·U`; the
//! norm's sum of squares is a reduction over the head's `U` units. Units past the last head only
//! join the reductions. Query heads write the rotated query to `q_out [T, heads·D]`; key/value
//! heads write their slot unless it is −1. Several heads per cube (rather than one: 6,144 cubes
//! of 64 units for 256 Qwen3-0.6B tokens) make fewer, fuller cubes, and the row scale below is
//! reduced once per group instead of once per head.
//!
//! The distance `D/2` between a pair's two elements is a run-time argument (`pair`), not the
//! comptime `head_dim / 2`: on CubeCL's CPU runtime, LLVM 23 merges two bf16 stores at a known
//! small distance into one gapped masked vector store (`llvm.masked.store.v33bf16` for
//! `D = 64`) when the host has AVX512-BF16, and x86 instruction selection cannot lower that
//! store without AVX512-FP16 (AMD Zen 4/5): the JIT aborted the process. An unknown distance
//! leaves the stores apart (engine/tests/engine/cpu_targets.rs compiles every kernel for such
//! CPUs).
//!
//! With a deferred row scale (`crate::row_scale`) q, k and v are the unscaled product of the
//! layer input `x [T, K]`: each cube first reduces `x`'s row to `inv_rms` (the row is shared by
//! the token's cubes, cache-resident after the first), then scales every value it reads and adds
//! the projection's bias `[width]` (merged-qkv columns) before anything else.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::Shape;
use burn_cubecl::{ops::numeric::empty_device_dtype, tensor::CubeTensor};
use cubecl::prelude::{CubeCount, CubeDim};

use crate::device_caps::DeviceCaps;
use crate::{unit_inner_stride, vector_size};

/// Where q, k and v sit in their input matrices and what to apply to them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct QkvLayout {
    /// Query heads (0 for a plain key/value write).
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Per-head width `D`.
    pub head_dim: usize,
    /// First column of q, k and v in their matrices.
    pub offsets: [usize; 3],
    /// Apply the rotary embedding to q and k.
    pub rope: bool,
    /// Apply per-head RMSNorm (weights `[D]`) to q and k before RoPE.
    pub qk_norm: bool,
    /// Scale each token's q, k and v by `inv_rms` of its row of `x` first.
    pub row_scale: bool,
    /// Add the projection's bias after the row scale.
    pub row_bias: bool,
    /// How the caches store keys and values (FP8: scaled by `kv_scales`).
    pub kv_dtype: super::KvCacheDtype,
}

pub(crate) mod kernel {
    use cubecl::prelude::*;

    use crate::attention::kv_cache::cache_row;
    use crate::attention::kv_read::head_scales;
    use crate::row_scale::row_inv_rms;

    /// Comptime part of the launch.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct StoreConfig {
        pub heads: usize,
        pub kv_heads: usize,
        pub head_dim: usize,
        /// Tokens per cache block.
        pub block_size: usize,
        pub rope: bool,
        pub qk_norm: bool,
        pub row_scale: bool,
        pub row_bias: bool,
        /// Units per head (`U`).
        pub head_units: usize,
        /// Heads per cube (`H`).
        pub heads_per_cube: usize,
        /// Reduce through plane operations (`U` is then a multiple of the plane size).
        pub use_plane: bool,
        /// How the caches store values (FP8 in `KV`: divided by their kv head's scale first).
        pub kv: crate::attention::KvCacheDtype,
    }

    /// What the cache stores for value `y`: `y` rounded to `F` (the model's activations), then,
    /// for an FP8 cache, divided by `scale` and rounded to `KV` (saturating).
    #[cube]
    fn stored<F: Float, KV: Float>(
        y: f32,
        scale: f32,
        #[comptime] kv: crate::attention::KvCacheDtype,
    ) -> KV {
        let y = F::cast_from(y);
        if comptime!(kv.is_fp8()) {
            KV::cast_from(f32::cast_from(y) / scale)
        } else {
            KV::cast_from(y)
        }
    }

    /// Sum of `value` over the `units` consecutive units of the caller's segment (unit
    /// `UNIT_POS_X / units`), returned to each of them. `scratch`: `CUBE_DIM_X` slots. With
    /// `use_plane`, `units` is a multiple of the plane size.
    #[cube]
    fn segment_sum(
        value: f32,
        scratch: &mut Shared<[f32]>,
        #[comptime] units: usize,
        #[comptime] use_plane: bool,
    ) -> f32 {
        let segment = UNIT_POS_X as usize / units;
        let mut total = 0.0f32;
        if comptime!(use_plane) {
            let s = plane_sum(value);
            if UNIT_POS_PLANE == 0 {
                scratch[PLANE_POS as usize] = s;
            }
            sync_cube();
            let planes = units / PLANE_DIM as usize;
            for p in 0..planes {
                total += scratch[segment * planes + p];
            }
        } else {
            scratch[UNIT_POS_X as usize] = value;
            sync_cube();
            for p in 0..units {
                total += scratch[segment * units + p];
            }
        }
        sync_cube();
        total
    }

    /// A projection value `z` of merged-qkv column `col` as the undeferred product gives it:
    /// with the row scale, `s·z (+ bias[col])` rounded once to `F`; else `z`.
    #[cube]
    fn projected<F: Float>(
        z: F,
        s: f32,
        bias: &Tensor<F>,
        col: usize,
        #[comptime] cfg: StoreConfig,
    ) -> f32 {
        let mut v = f32::cast_from(z);
        if comptime!(cfg.row_scale) {
            v *= s;
            if comptime!(cfg.row_bias) {
                v += f32::cast_from(bias[col]);
            }
            v = f32::cast_from(F::cast_from(v));
        }
        v
    }

    /// See the module documentation.
    #[cube(launch_unchecked, address_type = "dynamic")]
    #[allow(clippy::too_many_arguments)]
    pub fn rope_store_kv<F: Float, KV: Float, XV: Size>(
        q: &Tensor<F>,
        k: &Tensor<F>,
        v: &Tensor<F>,
        x: &Tensor<Vector<F, XV>>,
        row_bias: &Tensor<F>,
        q_norm: &Tensor<F>,
        k_norm: &Tensor<F>,
        cos: &Tensor<f32>,
        sin: &Tensor<f32>,
        positions: &Tensor<i32>,
        slots: &Tensor<i32>,
        k_cache: &mut Tensor<KV>,
        v_cache: &mut Tensor<KV>,
        kv_scales: &Tensor<f32>,
        q_out: &mut Tensor<F>,
        q_off: usize,
        k_off: usize,
        v_off: usize,
        eps: f32,
        row_eps: f32,
        pair: usize,
        #[comptime] cfg: StoreConfig,
        #[define(F, KV)] _dtypes: [ElemType; 2],
    ) {
        let t = CUBE_POS_X as usize;
        let units = cfg.head_units;
        let lane = UNIT_POS_X as usize % units;
        let head = CUBE_POS_Y as usize * cfg.heads_per_cube + UNIT_POS_X as usize / units;
        let d = cfg.head_dim;
        let half = comptime!(cfg.head_dim / 2);
        let is_query = head < cfg.heads;
        // Units past the last head (and key/value heads of a token without a slot) compute
        // nothing of their own; they stay for the cube's reductions.
        let kv_head = min(head - select(is_query, 0, cfg.heads), cfg.kv_heads - 1);
        let slot = slots[t];
        let live = head < cfg.heads + cfg.kv_heads && (is_query || slot >= 0);
        let (src_row, src_col) = if is_query {
            (t * q.stride(0), q_off + head * d)
        } else {
            (t * k.stride(0), k_off + kv_head * d)
        };

        // Every load of this unit's pairs `(j, j + D/2)`, `j = lane + p·U`, is issued before
        // the reductions, so that their latency overlaps the row scale's (the q/k values were
        // loaded after it and again after the norm's: 10.1 → 8.8 µs a layer at 256 Qwen3-0.6B
        // tokens on the H100). Raw values: `projected` needs the row scale.
        let pairs = comptime!(half.div_ceil(units));
        let vcol = v_off + kv_head * d;
        let vrow = t * v.stride(0) + vcol;
        let pos = positions[t] as usize;
        let mut z = Array::<F>::new(comptime!(2 * pairs));
        let mut vz = Array::<F>::new(comptime!(2 * pairs));
        let mut w = Array::<F>::new(comptime!(2 * pairs));
        let mut cs = Array::<f32>::new(comptime!(2 * pairs));
        #[unroll]
        for p in 0..pairs {
            let j = lane + p * units;
            let mut z1 = F::new(0.0);
            let mut z2 = F::new(0.0);
            let mut v1 = F::new(0.0);
            let mut v2 = F::new(0.0);
            let mut w1 = F::new(0.0);
            let mut w2 = F::new(0.0);
            let mut c = 0.0f32;
            let mut sn = 0.0f32;
            if live && j < half {
                if is_query {
                    z1 = q[src_row + src_col + j];
                    z2 = q[src_row + src_col + j + pair];
                    if comptime!(cfg.qk_norm) {
                        w1 = q_norm[j];
                        w2 = q_norm[j + pair];
                    }
                } else {
                    z1 = k[src_row + src_col + j];
                    z2 = k[src_row + src_col + j + pair];
                    v1 = v[vrow + j];
                    v2 = v[vrow + j + pair];
                    if comptime!(cfg.qk_norm) {
                        w1 = k_norm[j];
                        w2 = k_norm[j + pair];
                    }
                }
                if comptime!(cfg.rope) {
                    // The tables' rows may be pitched (a 2-D CUDA tensor pads rows to a power
                    // of two: head_dim/2 = 12, 20, 24, 40, 48 f32 are): index through the row
                    // stride.
                    c = cos[pos * cos.stride(0) + j];
                    sn = sin[pos * sin.stride(0) + j];
                }
            }
            z[2 * p] = z1;
            z[2 * p + 1] = z2;
            vz[2 * p] = v1;
            vz[2 * p + 1] = v2;
            w[2 * p] = w1;
            w[2 * p + 1] = w2;
            cs[2 * p] = c;
            cs[2 * p + 1] = sn;
        }

        let mut scratch =
            Shared::<[f32]>::new_slice(comptime!(cfg.head_units * cfg.heads_per_cube));
        let mut row_s = 1.0f32;
        if comptime!(cfg.row_scale) {
            row_s = row_inv_rms(x, t, row_eps, &mut scratch, cfg.use_plane);
        }

        // The projection's values, and the sum of squares for the per-head norm.
        let mut xs = Array::<f32>::new(comptime!(2 * pairs));
        let mut acc = 0.0f32;
        #[unroll]
        for p in 0..pairs {
            let j = lane + p * units;
            let x1 = projected(z[2 * p], row_s, row_bias, src_col + j, cfg);
            let x2 = projected(z[2 * p + 1], row_s, row_bias, src_col + j + pair, cfg);
            xs[2 * p] = x1;
            xs[2 * p + 1] = x2;
            acc += x1 * x1 + x2 * x2;
        }
        let mut scale = 1.0f32;
        if comptime!(cfg.qk_norm) {
            let total = segment_sum(acc, &mut scratch, cfg.head_units, cfg.use_plane);
            scale = f32::inverse_sqrt(total / f32::cast_from(d) + eps);
        }

        let (ks, vs) = head_scales(kv_scales, kv_head, cfg.kv_heads, comptime!(cfg.kv.is_fp8()));
        let slot = max(slot, 0) as usize;
        let cache_base = cache_row(
            slot / cfg.block_size,
            slot % cfg.block_size,
            kv_head,
            cfg.kv_heads,
            cfg.block_size,
        ) * d;
        // Past the last head, or a key/value head without a slot: nothing to write.
        #[unroll]
        for p in 0..pairs {
            let j = lane + p * units;
            if live && j < half {
                let mut x1 = xs[2 * p];
                let mut x2 = xs[2 * p + 1];
                if comptime!(cfg.qk_norm) {
                    // Rounded to F like the model's normalised activations.
                    x1 = f32::cast_from(F::cast_from(x1 * scale * f32::cast_from(w[2 * p])));
                    x2 = f32::cast_from(F::cast_from(x2 * scale * f32::cast_from(w[2 * p + 1])));
                }
                let (mut y1, mut y2) = (x1, x2);
                if comptime!(cfg.rope) {
                    let (c, sn) = (cs[2 * p], cs[2 * p + 1]);
                    y1 = x1 * c - x2 * sn;
                    y2 = x2 * c + x1 * sn;
                }
                if is_query {
                    let at = t * q_out.stride(0) + head * d + j;
                    q_out[at] = F::cast_from(y1);
                    q_out[at + pair] = F::cast_from(y2);
                } else {
                    k_cache[cache_base + j] = stored::<F, KV>(y1, ks, cfg.kv);
                    k_cache[cache_base + j + pair] = stored::<F, KV>(y2, ks, cfg.kv);
                    // Without a row scale `projected` is the value itself (F → f32 → F is exact).
                    let v1 = projected(vz[2 * p], row_s, row_bias, vcol + j, cfg);
                    let v2 = projected(vz[2 * p + 1], row_s, row_bias, vcol + j + pair, cfg);
                    v_cache[cache_base + j] = stored::<F, KV>(v1, vs, cfg.kv);
                    v_cache[cache_base + j + pair] = stored::<F, KV>(v2, vs, cfg.kv);
                }
            }
        }
    }
}

/// Host side: writes k/v of `T` tokens into the caches (after norm and RoPE when asked) and,
/// with query heads, returns the rotated queries `[T, heads·D]` (else an empty `[T, 0]`).
///
/// `q`, `k`, `v`: `[T, *]` matrices holding the heads at `layout.offsets`; `q_norm`, `k_norm`:
/// `[D]` (read only with `qk_norm`); `cos`, `sin`: `[max_pos, D/2]` f32 (read only with `rope`);
/// `positions`, `slots`: `[T]` i32; `x [T, K]`, `row_bias [width]` (read only with
/// `layout.row_scale`, `layout.row_bias`). The caches are written in place.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_store_kv(
    q: CubeTensor,
    k: CubeTensor,
    v: CubeTensor,
    x: CubeTensor,
    row_bias: CubeTensor,
    q_norm: CubeTensor,
    k_norm: CubeTensor,
    cos: CubeTensor,
    sin: CubeTensor,
    positions: CubeTensor,
    slots: CubeTensor,
    k_cache: CubeTensor,
    v_cache: CubeTensor,
    kv_scales: CubeTensor,
    layout: QkvLayout,
    eps: [f32; 2],
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let caps = DeviceCaps::of(&k.client);
    let t = slots.meta.shape()[0];
    let dtype = k.dtype;
    let q_out = empty_device_dtype(
        k.client.clone(),
        k.device.clone(),
        Shape::new([t, layout.heads * layout.head_dim]),
        dtype,
    );
    if t == 0 {
        return (q_out, k_cache, v_cache);
    }
    let k_cache = super::writable(k_cache);
    let v_cache = super::writable(v_cache);
    // Units per head: one per rotation pair up to the cube size; with plane reductions a
    // multiple of the plane. Heads per cube: up to twice the usual cube size in units on plane
    // devices; one on CPU runtimes, whose cube size is the core count (a cube of more units
    // than cores waits at every barrier: a 4-unit cube on 2 cores ran an engine test for over
    // 20 minutes instead of 9 s).
    let half = layout.head_dim / 2;
    let use_plane = caps.plane_ops && half >= caps.plane_size;
    let head_units = if use_plane {
        caps.cube_units.min(half) / caps.plane_size * caps.plane_size
    } else {
        caps.cube_units.min(half).max(1)
    };
    let all_heads = layout.heads + layout.kv_heads;
    let cube_units = if caps.plane_ops {
        2 * caps.cube_units
    } else {
        caps.cube_units
    };
    let heads_per_cube = (cube_units / head_units).clamp(1, all_heads.max(1));
    let cfg = kernel::StoreConfig {
        heads: layout.heads,
        kv_heads: layout.kv_heads,
        head_dim: layout.head_dim,
        block_size: k_cache.meta.shape()[2],
        rope: layout.rope,
        qk_norm: layout.qk_norm,
        row_scale: layout.row_scale,
        row_bias: layout.row_bias,
        head_units,
        heads_per_cube,
        use_plane,
        kv: layout.kv_dtype,
    };
    let x = unit_inner_stride(x);
    // Read by row stride (rows may be pitched), elements contiguous.
    let (cos, sin) = (unit_inner_stride(cos), unit_inner_stride(sin));
    let xv = if layout.row_scale {
        vector_size(dtype, &[x.meta.shape()[1], x.meta.strides()[0]])
    } else {
        1
    };
    // Never written without query heads.
    let q_out_arg = if layout.heads == 0 {
        k.clone()
    } else {
        q_out.clone()
    };
    // SAFETY: every index stays inside the row ranges checked by the public op; slots index
    // the cache, which the metadata checks against the block tables.
    unsafe {
        kernel::rope_store_kv::launch_unchecked(
            &k_cache.client,
            CubeCount::Static(t as u32, all_heads.div_ceil(heads_per_cube) as u32, 1),
            CubeDim::new_1d((head_units * heads_per_cube) as u32),
            super::address_type(&[&k_cache, &q]),
            xv,
            q.into_tensor_arg(),
            k.into_tensor_arg(),
            v.into_tensor_arg(),
            x.into_tensor_arg(),
            row_bias.into_tensor_arg(),
            q_norm.into_tensor_arg(),
            k_norm.into_tensor_arg(),
            cos.into_tensor_arg(),
            sin.into_tensor_arg(),
            positions.into_tensor_arg(),
            slots.into_tensor_arg(),
            k_cache.clone().into_tensor_arg(),
            v_cache.clone().into_tensor_arg(),
            kv_scales.into_tensor_arg(),
            q_out_arg.into_tensor_arg(),
            layout.offsets[0],
            layout.offsets[1],
            layout.offsets[2],
            eps[0],
            eps[1],
            layout.head_dim / 2,
            cfg,
            [dtype_to_storage_type(dtype), layout.kv_dtype.storage(dtype)],
        );
    }
    (q_out, k_cache, v_cache)
}
