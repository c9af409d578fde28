//! Host side of the RMSNorm + linear family on CubeCL runtimes: argument checks, output
//! allocation, kernel choice and launch geometry (the device code is in `kernel.rs`).

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{kernel::into_contiguous, ops::numeric::empty_device_dtype, tensor::CubeTensor};
use cubecl::prelude::{CubeCount, CubeDim};

use super::kernel::{SkinnyConfig, TiledConfig, linear_skinny, linear_tiled, rms_stats};
use crate::device_caps::DeviceCaps;

/// Largest `M` handled by the weight-streaming skinny kernel; above it the tiled kernel wins
/// (it reuses each staged weight tile for 64 rows).
const SKINNY_MAX_M: usize = 32;

/// The fused op on CubeCL tensors: `h = x (+ residual)`, `y = rms_norm(h)·Wᵀ (+ b)` (without
/// `gamma`, a plain linear). Returns `(y [M, N], h [M, K])`. Arguments were checked by
/// [`super::check_args`].
pub(crate) fn fused_linear(
    x: CubeTensor,
    residual: Option<CubeTensor>,
    gamma: Option<CubeTensor>,
    w: CubeTensor,
    bias: Option<CubeTensor>,
    eps: f32,
) -> (CubeTensor, CubeTensor) {
    let x = unit_inner_stride(x);
    let w = unit_inner_stride(w);
    let [m, k] = dims2(&x);
    let n = w.meta.shape()[0];
    let caps = DeviceCaps::of(&x.client);
    let dtype = x.dtype;

    // Row statistics (and the residual sum) once per row.
    let (h, inv_rms) = if gamma.is_some() || residual.is_some() {
        let inv_rms = empty_device_dtype(
            x.client.clone(),
            x.device.clone(),
            Shape::new([m.max(1)]),
            DType::F32,
        );
        let h = match &residual {
            Some(_) => empty_device_dtype(
                x.client.clone(),
                x.device.clone(),
                Shape::new([m, k]),
                dtype,
            ),
            None => x.clone(),
        };
        let r = residual
            .clone()
            .map(unit_inner_stride)
            .unwrap_or_else(|| x.clone());
        if m > 0 {
            // SAFETY: one cube per row; every index is below the row's `K` (checked shapes).
            unsafe {
                rms_stats::launch_unchecked(
                    &x.client,
                    CubeCount::Static(m as u32, 1, 1),
                    CubeDim::new_1d(caps.cube_units as u32),
                    x.clone().into_tensor_arg(),
                    r.into_tensor_arg(),
                    h.clone().into_tensor_arg(),
                    inv_rms.clone().into_tensor_arg(),
                    eps,
                    caps.cube_units,
                    residual.is_some(),
                    caps.plane_ops,
                    dtype_to_storage_type(dtype),
                );
            }
        }
        (h, inv_rms)
    } else {
        let inv_rms = empty_device_dtype(
            x.client.clone(),
            x.device.clone(),
            Shape::new([1]),
            DType::F32,
        );
        (x.clone(), inv_rms)
    };

    let out = empty_device_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::new([m, n]),
        dtype,
    );
    if m == 0 || n == 0 {
        return (out, h);
    }
    let has_norm = gamma.is_some();
    let has_bias = bias.is_some();
    // Absent optional operands are bound to `h` and never read (comptime flags).
    let gamma = gamma.unwrap_or_else(|| h.clone());
    let bias = bias.unwrap_or_else(|| h.clone());

    if m <= SKINNY_MAX_M || k < 16 {
        let vec = vector_size(dtype, &[k, h.meta.strides()[0], w.meta.strides()[0]]);
        let cfg = SkinnyConfig {
            rows: 4,
            m_tile: m.min(8),
            cube_dim: caps.cube_units,
            has_norm,
            has_bias,
            use_plane: caps.plane_ops,
        };
        // SAFETY: weight rows are clamped to `N - 1` and input rows to `M - 1` for loads;
        // writes are bounds-checked; `K` is a multiple of the vector size.
        unsafe {
            linear_skinny::launch_unchecked(
                &x.client,
                CubeCount::Static(n.div_ceil(cfg.rows) as u32, 1, 1),
                CubeDim::new_1d(cfg.cube_dim as u32),
                vec,
                h.clone().into_tensor_arg(),
                inv_rms.into_tensor_arg(),
                gamma.into_tensor_arg(),
                w.into_tensor_arg(),
                bias.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                cfg,
                dtype_to_storage_type(dtype),
            );
        }
    } else {
        let use_cmma = caps.cmma_16x16x16(dtype) && caps.cube_units == 4 * 32;
        // FMA: each unit owns a 4×4 register tile (8 × 16 units on GPUs, a 1 × units row on CPUs).
        let (bm, bn) = match (use_cmma, caps.cube_units) {
            (true, _) => (64, 64),
            (false, 128) => (32, 64),
            (false, units) => (4, 4 * units),
        };
        let cfg = TiledConfig {
            bm,
            bn,
            bk: if use_cmma { 64 } else { 32 },
            cube_dim: if use_cmma {
                caps.cube_units
            } else {
                bm * bn / 16
            },
            has_norm,
            has_bias,
            use_cmma,
        };
        // SAFETY: staging loads and epilogue stores are bounds-checked against M, N, K.
        unsafe {
            linear_tiled::launch_unchecked(
                &x.client,
                CubeCount::Static(n.div_ceil(cfg.bn) as u32, m.div_ceil(cfg.bm) as u32, 1),
                CubeDim::new_1d(cfg.cube_dim as u32),
                h.clone().into_tensor_arg(),
                inv_rms.into_tensor_arg(),
                gamma.into_tensor_arg(),
                w.into_tensor_arg(),
                bias.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                cfg,
                dtype_to_storage_type(dtype),
            );
        }
    }
    (out, h)
}

fn dims2(t: &CubeTensor) -> [usize; 2] {
    let s = t.meta.shape();
    [s[0], s[1]]
}

/// Kernels index the last dimension with unit stride; anything else is copied first.
fn unit_inner_stride(t: CubeTensor) -> CubeTensor {
    let strides = t.meta.strides();
    if strides[strides.len() - 1] == 1 && !t.meta.shape().iter().any(|&d| d == 0) {
        t
    } else {
        into_contiguous(t)
    }
}

/// Widest vector (at most 16 bytes) whose length divides every extent and row pitch given.
pub(crate) fn vector_size(dtype: DType, extents: &[usize]) -> usize {
    let max = (16 / dtype.size()).max(1);
    let mut v = max;
    while v > 1 && extents.iter().any(|&e| e % v != 0) {
        v /= 2;
    }
    v
}
