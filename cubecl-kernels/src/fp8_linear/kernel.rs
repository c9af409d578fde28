//! Device side of the FP8 linear family: the quantisation (per row or per tensor) and its
//! inverse.
//!
//! `quantize` per row: one cube per row of `x [M, K]`; the units stride over the row in vectors
//! of `NV`, reduce its largest magnitude over the cube, then write `round(x / scale)` as E4M3
//! codes (`codes [M, K]`, round to nearest even, saturating; stored four to a 32-bit word,
//! `[M, K / 4]`, converted two an instruction by PTX's `cvt` where `ptx`) and
//! `scale = amax / 448` (1 for a row of zeros) to `scales [M]`. Each unit reads its elements
//! twice (the second time from cache).
//!
//! Per tensor (`amax_rows`, then `quantize`): one cube per row writes the row's largest
//! magnitude to `amax [M]`; then each cube of the second launch reduces all of `amax` to the
//! tensor's scale and writes the codes of rows `CUBE_POS_X, CUBE_POS_X + CUBE_COUNT_X, …` with
//! it, and the scale to `scales[row]` of each (every entry the same).
//!
//! `dequantize_rows`: one unit per vector of `NV` codes, `out[m, k] = code · scales[m]` in f32.

use cubecl::prelude::*;

use crate::fp8_codes::{decode_f32, encode_e4m3_word};
use crate::sampling::kernel::cube_max;

/// The largest finite E4M3 value: a row's largest magnitude maps to it.
pub(crate) const E4M3_MAX: f32 = 448.0;

/// See the module documentation: `per_tensor` takes the tensor's scale from `amax`, else each
/// row's own (`amax` unread).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantize<F: Float, Q: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    amax: &Tensor<f32>,
    codes: &mut Tensor<u32>,
    scales: &mut Tensor<f32>,
    #[comptime] cube_dim: usize,
    #[comptime] use_plane: bool,
    #[comptime] ptx: bool,
    #[comptime] per_tensor: bool,
    #[define(F, Q)] _dtypes: [ElemType; 2],
) {
    let rows = x.shape(0);
    let mut scratch = Shared::<[f32]>::new_slice(cube_dim);
    let mut tensor_scale = 1.0f32;
    if comptime!(per_tensor) {
        let mut m = 0.0f32;
        let mut r = UNIT_POS_X as usize;
        while r < rows {
            m = max(m, amax[r]);
            r += CUBE_DIM_X as usize;
        }
        tensor_scale = scale_of(cube_max(m, &mut scratch, use_plane));
    }
    let mut row = CUBE_POS_X as usize;
    while row < rows {
        let mut scale = tensor_scale;
        if comptime!(!per_tensor) {
            scale = scale_of(cube_max(row_amax(x, row), &mut scratch, use_plane));
        }
        write_codes::<F, Q, NV>(x, row, codes, scale, ptx);
        if UNIT_POS_X == 0 {
            scales[row] = scale;
        }
        row += CUBE_COUNT_X as usize;
    }
}

/// See the module documentation.
#[cube(launch_unchecked)]
pub(crate) fn amax_rows<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    amax: &mut Tensor<f32>,
    #[comptime] cube_dim: usize,
    #[comptime] use_plane: bool,
    #[define(F)] _dtype: ElemType,
) {
    let row = CUBE_POS_X as usize;
    let mut scratch = Shared::<[f32]>::new_slice(cube_dim);
    let m = cube_max(row_amax(x, row), &mut scratch, use_plane);
    if UNIT_POS_X == 0 {
        amax[row] = m;
    }
}

/// This unit's largest magnitude of row `row` of `x` (its vectors strided by the cube).
#[cube]
fn row_amax<F: Float, NV: Size>(x: &Tensor<Vector<F, NV>>, row: usize) -> f32 {
    let nv = x.vector_size();
    let k_vecs = x.shape(1) / nv;
    let at = row * (x.stride(0) / nv);
    let mut amax = 0.0f32;
    let mut i = UNIT_POS_X as usize;
    while i < k_vecs {
        let v = Vector::<f32, NV>::cast_from(x[at + i]);
        #[unroll]
        for j in 0..nv {
            amax = max(amax, f32::abs(v.extract(j)));
        }
        i += CUBE_DIM_X as usize;
    }
    amax
}

/// The scale mapping a largest magnitude `amax` to [`E4M3_MAX`] (1 for zeros).
#[cube]
fn scale_of(amax: f32) -> f32 {
    let mut scale = 1.0f32;
    if amax > 0.0 {
        scale = amax / E4M3_MAX;
    }
    scale
}

/// Writes row `row` of `x` divided by `scale` as E4M3 codes, four to a little-endian word of
/// `codes` (`[R, C / 4]`), the cube's units striding over its vectors (`NV` a multiple of 4).
#[cube]
fn write_codes<F: Float, Q: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    row: usize,
    codes: &mut Tensor<u32>,
    scale: f32,
    #[comptime] ptx: bool,
) {
    let nv = x.vector_size();
    let words = comptime!(nv / 4);
    let k_vecs = x.shape(1) / nv;
    let at = row * (x.stride(0) / nv);
    let out_at = row * codes.stride(0);
    let mut i = UNIT_POS_X as usize;
    while i < k_vecs {
        let v = Vector::<f32, NV>::cast_from(x[at + i]) / Vector::new(scale);
        #[unroll]
        for w in 0..words {
            codes[out_at + i * words + w] = encode_e4m3_word::<Q>(
                v.extract(4 * w),
                v.extract(4 * w + 1),
                v.extract(4 * w + 2),
                v.extract(4 * w + 3),
                ptx,
            );
        }
        i += CUBE_DIM_X as usize;
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
