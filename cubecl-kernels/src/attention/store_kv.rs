//! The KV-cache write, with the query/key preprocessing of a Qwen layer fused in: Qwen3's
//! per-head q/k RMSNorm and the rotate-half RoPE.
//!
//! Memory layout: `q`, `k`, `v` are column ranges of row-major `[T, width]` matrices (the merged
//! qkv projection, or separate tensors), head `h` at columns `offset + h·D .. offset + (h+1)·D`.
//! The caches are `[num_blocks, block_size, kv_heads, D]`, contiguous, so slot `s` of head `h`
//! starts at `(s·kv_heads + h)·D`. RoPE tables `cos`, `sin` are `[max_pos, D/2]` f32.
//!
//! Launch geometry: one cube per (token, head) over `heads + kv_heads` heads (`kv_heads` only
//! for a plain write). A unit owns the rotation pairs `(j, j + D/2)` at `j = UNIT_POS + i·CUBE_DIM`;
//! the norm's sum of squares is a cube reduction. Query heads write the rotated query to
//! `q_out [T, heads·D]`; key/value heads write their slot unless it is −1.
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
}

pub(crate) mod kernel {
    use cubecl::prelude::*;

    use crate::rms_norm_linear::kernel::cube_sum;
    use crate::row_scale::row_inv_rms;

    /// Comptime part of the launch.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct StoreConfig {
        pub heads: usize,
        pub kv_heads: usize,
        pub head_dim: usize,
        pub rope: bool,
        pub qk_norm: bool,
        pub row_scale: bool,
        pub row_bias: bool,
        pub cube_dim: usize,
        pub use_plane: bool,
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
    pub fn rope_store_kv<F: Float, XV: Size>(
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
        k_cache: &mut Tensor<F>,
        v_cache: &mut Tensor<F>,
        q_out: &mut Tensor<F>,
        q_off: usize,
        k_off: usize,
        v_off: usize,
        eps: f32,
        row_eps: f32,
        pair: usize,
        #[comptime] cfg: StoreConfig,
        #[define(F)] _dtype: ElemType,
    ) {
        let t = CUBE_POS_X as usize;
        let head = CUBE_POS_Y as usize;
        let d = cfg.head_dim;
        let half = comptime!(cfg.head_dim / 2);
        let is_query = head < cfg.heads;
        let kv_head = head - select(is_query, 0, cfg.heads);
        let slot = slots[t];
        if !is_query && slot < 0 {
            terminate!();
        }
        let (src_row, src_col) = if is_query {
            (t * q.stride(0), q_off + head * d)
        } else {
            (t * k.stride(0), k_off + kv_head * d)
        };

        let mut scratch = Shared::<[f32]>::new_slice(cfg.cube_dim);
        let mut row_s = 1.0f32;
        if comptime!(cfg.row_scale) {
            row_s = row_inv_rms(x, t, row_eps, &mut scratch, cfg.use_plane);
        }

        // Sum of squares for the per-head norm.
        let mut scale = 1.0f32;
        if comptime!(cfg.qk_norm) {
            let mut acc = 0.0f32;
            let mut j = UNIT_POS_X as usize;
            while j < d {
                let z = if is_query {
                    q[src_row + src_col + j]
                } else {
                    k[src_row + src_col + j]
                };
                let x = projected(z, row_s, row_bias, src_col + j, cfg);
                acc += x * x;
                j += CUBE_DIM_X as usize;
            }
            let total = cube_sum(acc, &mut scratch, cfg.use_plane);
            scale = f32::inverse_sqrt(total / f32::cast_from(d) + eps);
        }

        let pos = positions[t] as usize;
        let cache_base = (slot as usize * cfg.kv_heads + kv_head) * d;
        let mut j = UNIT_POS_X as usize;
        while j < half {
            let (z1, z2) = if is_query {
                (q[src_row + src_col + j], q[src_row + src_col + j + pair])
            } else {
                (k[src_row + src_col + j], k[src_row + src_col + j + pair])
            };
            let mut x1 = projected(z1, row_s, row_bias, src_col + j, cfg);
            let mut x2 = projected(z2, row_s, row_bias, src_col + j + pair, cfg);
            if comptime!(cfg.qk_norm) {
                // Rounded to F like the model's normalised activations.
                let (w1, w2) = if is_query {
                    (f32::cast_from(q_norm[j]), f32::cast_from(q_norm[j + pair]))
                } else {
                    (f32::cast_from(k_norm[j]), f32::cast_from(k_norm[j + pair]))
                };
                x1 = f32::cast_from(F::cast_from(x1 * scale * w1));
                x2 = f32::cast_from(F::cast_from(x2 * scale * w2));
            }
            let (mut y1, mut y2) = (x1, x2);
            if comptime!(cfg.rope) {
                // The tables' rows may be pitched (a 2-D CUDA tensor pads rows to a power of
                // two: head_dim/2 = 12, 20, 24, 40, 48 f32 are): index through the row stride.
                let c = cos[pos * cos.stride(0) + j];
                let s = sin[pos * sin.stride(0) + j];
                y1 = x1 * c - x2 * s;
                y2 = x2 * c + x1 * s;
            }
            if is_query {
                let at = t * q_out.stride(0) + head * d + j;
                q_out[at] = F::cast_from(y1);
                q_out[at + pair] = F::cast_from(y2);
            } else {
                k_cache[cache_base + j] = F::cast_from(y1);
                k_cache[cache_base + j + pair] = F::cast_from(y2);
                // Without a row scale `projected` is the value itself (F → f32 → F is exact).
                let vcol = v_off + kv_head * d;
                let vrow = t * v.stride(0) + vcol;
                let v1 = projected(v[vrow + j], row_s, row_bias, vcol + j, cfg);
                let v2 = projected(v[vrow + j + pair], row_s, row_bias, vcol + j + pair, cfg);
                v_cache[cache_base + j] = F::cast_from(v1);
                v_cache[cache_base + j + pair] = F::cast_from(v2);
            }
            j += CUBE_DIM_X as usize;
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
    layout: QkvLayout,
    eps: [f32; 2],
) -> (CubeTensor, CubeTensor, CubeTensor) {
    let caps = DeviceCaps::of(&k.client);
    let t = slots.meta.shape()[0];
    let dtype = k_cache.dtype;
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
    let cfg = kernel::StoreConfig {
        heads: layout.heads,
        kv_heads: layout.kv_heads,
        head_dim: layout.head_dim,
        rope: layout.rope,
        qk_norm: layout.qk_norm,
        row_scale: layout.row_scale,
        row_bias: layout.row_bias,
        cube_dim: caps.cube_units.min(layout.head_dim / 2).max(1),
        use_plane: caps.plane_ops && layout.head_dim / 2 >= caps.plane_size,
    };
    let x = unit_inner_stride(x);
    // Read by row stride (rows may be pitched), elements contiguous.
    let (cos, sin) = (unit_inner_stride(cos), unit_inner_stride(sin));
    let xv = if layout.row_scale {
        vector_size(dtype, &[x.meta.shape()[1], x.meta.strides()[0]])
    } else {
        1
    };
    let q_out_arg = if layout.heads == 0 {
        k_cache.clone()
    } else {
        q_out.clone()
    };
    // SAFETY: every index stays inside the row ranges checked by the public op; slots index
    // the cache, which the metadata checks against the block tables.
    unsafe {
        kernel::rope_store_kv::launch_unchecked(
            &k_cache.client,
            CubeCount::Static(t as u32, (layout.heads + layout.kv_heads) as u32, 1),
            CubeDim::new_1d(cfg.cube_dim as u32),
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
            q_out_arg.into_tensor_arg(),
            layout.offsets[0],
            layout.offsets[1],
            layout.offsets[2],
            eps[0],
            eps[1],
            layout.head_dim / 2,
            cfg,
            dtype_to_storage_type(dtype),
        );
    }
    (q_out, k_cache, v_cache)
}
