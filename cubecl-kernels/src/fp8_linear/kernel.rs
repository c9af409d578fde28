//! Device side of the FP8 linear family: the per-row quantisation and its inverse.
//!
//! `quantize_rows`: one cube per row of `x [M, K]`; the units stride over the row in vectors of
//! `NV`, reduce its largest magnitude over the cube, then write `round(x / scale)` as E4M3
//! codes (`codes [M, K]`, one byte each, saturating, stored one at a time) and `scale = amax / 448` (1 for a row of
//! zeros) to `scales [M]`. Each unit reads its elements twice (the second time from cache).
//!
//! `dequantize_rows`: one unit per vector of `NV` codes, `out[m, k] = code · scales[m]` in f32.

use cubecl::prelude::*;

use crate::fp8_codes::decode_f32;
use crate::sampling::kernel::cube_max;

/// The largest finite E4M3 value: a row's largest magnitude maps to it.
pub(crate) const E4M3_MAX: f32 = 448.0;

/// See the module documentation.
#[cube(launch_unchecked)]
pub(crate) fn quantize_rows<F: Float, Q: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    codes: &mut Tensor<Q>,
    scales: &mut Tensor<f32>,
    #[comptime] cube_dim: usize,
    #[comptime] use_plane: bool,
    #[define(F, Q)] _dtypes: [ElemType; 2],
) {
    let row = CUBE_POS_X as usize;
    let nv = x.vector_size();
    let k_vecs = x.shape(1) / nv;
    let at = row * (x.stride(0) / nv);
    let out_at = row * codes.stride(0);
    let units = CUBE_DIM_X as usize;
    let mut amax = 0.0f32;
    let mut i = UNIT_POS_X as usize;
    while i < k_vecs {
        let v = Vector::<f32, NV>::cast_from(x[at + i]);
        #[unroll]
        for j in 0..nv {
            amax = max(amax, f32::abs(v.extract(j)));
        }
        i += units;
    }
    let mut scratch = Shared::<[f32]>::new_slice(cube_dim);
    let amax = cube_max(amax, &mut scratch, use_plane);
    let mut scale = 1.0f32;
    if amax > 0.0 {
        scale = amax / E4M3_MAX;
    }
    let mut i = UNIT_POS_X as usize;
    while i < k_vecs {
        let v = Vector::<f32, NV>::cast_from(x[at + i]);
        // One code at a time: CUDA's vector cast to FP8 stored wrong codes (measured).
        #[unroll]
        for j in 0..nv {
            codes[out_at + i * nv + j] = Q::cast_from(v.extract(j) / scale);
        }
        i += units;
    }
    if UNIT_POS_X == 0 {
        scales[row] = scale;
    }
}

/// See the module documentation.
#[cube(launch_unchecked)]
pub(crate) fn dequantize_rows<Q: Float, NV: Size>(
    codes: &Tensor<Vector<Q, NV>>,
    scales: &Tensor<f32>,
    out: &mut Tensor<Vector<f32, NV>>,
    #[define(Q)] _dtype: ElemType,
) {
    let nv = codes.vector_size();
    let k_vecs = codes.shape(1) / nv;
    let i = ABSOLUTE_POS;
    if i < codes.shape(0) * k_vecs {
        let row = i / k_vecs;
        let col = i % k_vecs;
        let v = decode_f32(codes[row * (codes.stride(0) / nv) + col], false);
        let at = row * (out.stride(0) / nv) + col;
        out[at] = v * Vector::new(scales[row]);
    }
}
