//! Host side of the FP8 linear family on CubeCL runtimes: the quantisation's launch geometry,
//! and the product's route (cuBLASLt's FP8 GEMM, else the emulation; module doc of
//! `fp8_linear`).
//!
//! Products of one row (a lone decode) take the skinny kernel of the linear family over the
//! codes (`rms_norm_linear::kernel::linear_skinny`), larger ones (and batch-invariant ones of
//! any size) cuBLASLt.
//!
//! `quantize` (per row) and `amax_rows`: one cube per row, `cube_units` units (4 planes on
//! GPUs; up to a vector per unit, at most 1,024, when there are fewer rows than twice the
//! multiprocessors), vectors of up to 16 bytes of the input; `quantize` per tensor: as many
//! cubes as rows, at most eight per multiprocessor. `dequantize_rows`: one unit per vector,
//! 256-unit cubes.
//!
//! A weight quantised per tensor ([`super::Fp8Scaling::PerTensor`]) takes activations
//! quantised per tensor too and cuBLASLt's scalar-scale FP8 GEMM (vLLM's online FP8), except
//! in the skinny kernel, in batch-invariant products (a tensor scale would make a row's result
//! depend on the batch) and above `PER_TENSOR_MAX_M` rows, whose activations stay per row.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, FloatDType, Shape};
use burn_cubecl::{CubeBackend, ops::numeric::empty_device_dtype, tensor::CubeTensor};
use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::{CubeCount, CubeDim};

use super::kernel::{
    amax_rows as amax_rows_kernel, dequantize_rows as dequantize_kernel,
    quantize as quantize_kernel,
};
use crate::attention::kv_cache::{carrier_as_bytes, relabel};
use crate::device_caps::DeviceCaps;
use crate::knobs::Knobs;
use crate::rms_norm_linear::kernel::SkinnyConfig;
use crate::rms_norm_linear::launch::{SkinnyOperands, launch_skinny, skinny_config};
use crate::{ReductionOrder, unit_inner_stride, vector_size};

/// The element the kernels read and write codes as.
const E4M3: ElemType = ElemType::Float(FloatKind::E4M3);

/// Largest `M` whose product takes the skinny kernel (`BURN_NANOVLLM_SKINNY_MAX_M` overrides
/// it, as for 16-bit weights). Measured on the H100 over Qwen2.5-7B's products: at one row the
/// skinny kernel beat cuBLASLt's FP8 GEMM on all four (down 40.7 against 61.8 µs), at 4 and 8
/// rows it lost to cuBLASLt's figures at 16 (gate/up 131 and 216 against 84 µs).
const SKINNY_MAX_M: usize = 1;

/// Most units of a per-row `quantize` cube (rows of few-row calls).
const MAX_QUANTIZE_UNITS: usize = 1024;

/// Cubes of a per-tensor `quantize` per multiprocessor at most (each reads all of `amax [R]`
/// once). Two a multiprocessor took 77 µs over 4,608 × 3,584 bf16 values on the H200 (byte
/// stores then), against 49 µs for the per-row form's cube a row; eight is not timed on its own
/// (the per-tensor products of up to 1,024 rows ran with it).
const TENSOR_QUANTIZE_CUBES_PER_MP: usize = 8;

/// Largest `M` whose activations a per-tensor weight's product quantises per tensor; larger
/// products (prefill chunks) quantise them per row and take cuBLASLt's scale-vector GEMM with
/// the weight's repeated scale. On the H200 over Qwen2.5-7B's products, per tensor against
/// per row: at 256 rows 0.82–0.95× the time (down + residual 60.1 against 73.7 µs), at 1,024
/// rows 0.93–1.13×, at 4,096 rows 1.0–1.2× (the extra pass over `x` for its largest
/// magnitude costs more than the scalar-scale GEMM saves).
const PER_TENSOR_MAX_M: usize = 1024;

/// Units per cube of `dequantize_rows`.
const DEQUANTIZE_CUBE: usize = 256;

/// `x [R, C]` → its codes (`U8 [R, C]`, unit inner stride, rows as the device pitches them)
/// and scales (`[R]` f32), one scale per row (`per_tensor == false`) or one for the whole
/// tensor, repeated in every entry.
pub(crate) fn quantize(x: CubeTensor, per_tensor: bool) -> (CubeTensor, CubeTensor) {
    let mut x = unit_inner_stride(x);
    let [r, c] = [x.meta.shape()[0], x.meta.shape()[1]];
    // The kernels encode four codes to a word: vectors of at least 4 elements (`C` is a
    // multiple of 4, checked by the callers; a row pitch that is not gets a contiguous copy).
    if vector_size(x.dtype, &[c, x.meta.strides()[0]]) < 4 {
        x = burn_cubecl::kernel::into_contiguous(x);
    }
    let alloc = |shape: Shape, dtype: DType| {
        empty_device_dtype(x.client.clone(), x.device.clone(), shape, dtype)
    };
    let codes = alloc(Shape::new([r, c]), DType::U8);
    let scales = alloc(Shape::new([r]), DType::F32);
    if r == 0 || c == 0 {
        return (codes, scales);
    }
    let caps = DeviceCaps::of(&x.client);
    let vec = vector_size(x.dtype, &[c, x.meta.strides()[0]]);
    // Codes as the words the kernels store (`[R, C / 4]`, the same row pitch in bytes).
    let words = relabel(codes.clone(), 1, 4, DType::U32);
    let ptx = crate::fp8_codes::ptx_decodes(&caps);
    // Few rows (decode steps) leave most multiprocessors idle with one small cube each: their
    // cubes grow up to a vector per unit, at most `MAX_QUANTIZE_UNITS`.
    let units = if r >= 2 * caps.multiprocessors || !caps.plane_ops {
        caps.cube_units
    } else {
        (c / vec)
            .next_multiple_of(caps.plane_size)
            .clamp(caps.cube_units, MAX_QUANTIZE_UNITS.min(caps.max_cube_units))
    };
    let use_plane = caps.plane_ops && units.is_multiple_of(caps.plane_size);
    let dtypes = [dtype_to_storage_type(x.dtype), E4M3];
    let cube_dim = CubeDim::new_1d(units as u32);
    // Each row's largest magnitude (per tensor; per row one unread element binds the argument).
    let amax = alloc(Shape::new([if per_tensor { r } else { 1 }]), DType::F32);
    let cubes = if per_tensor {
        r.min(TENSOR_QUANTIZE_CUBES_PER_MP * caps.multiprocessors.max(1))
    } else {
        r
    };
    // SAFETY: `amax_rows` writes `amax[row]` of its one row below `R`; `quantize` reads
    // `amax[..R]` (per tensor) and strides its cubes over the rows below `R`; vector indices
    // stay below a row's `C / vec`, `C` and the row pitches being multiples of the vector.
    unsafe {
        if per_tensor {
            amax_rows_kernel::launch_unchecked(
                &x.client,
                CubeCount::Static(r as u32, 1, 1),
                cube_dim,
                vec,
                x.clone().into_tensor_arg(),
                amax.clone().into_tensor_arg(),
                units,
                use_plane,
                dtypes[0],
            );
        }
        quantize_kernel::launch_unchecked(
            &x.client,
            CubeCount::Static(cubes as u32, 1, 1),
            cube_dim,
            vec,
            x.clone().into_tensor_arg(),
            amax.into_tensor_arg(),
            words.into_tensor_arg(),
            scales.clone().into_tensor_arg(),
            units,
            use_plane,
            ptx,
            per_tensor,
            dtypes,
        );
    }
    (codes, scales)
}

/// Codes (`U8 [R, C]`) and scales (`[R]`) → `code · scale` `[R, C]` f32.
fn dequantize_rows(codes: &CubeTensor, scales: &CubeTensor) -> CubeTensor {
    let [r, c] = [codes.meta.shape()[0], codes.meta.shape()[1]];
    let out = empty_device_dtype(
        codes.client.clone(),
        codes.device.clone(),
        Shape::new([r, c]),
        DType::F32,
    );
    if r == 0 || c == 0 {
        return out;
    }
    // The vector divides the rows and both row pitches (CUDA pitches 2-D allocations).
    let vec = vector_size(
        DType::F32,
        &[c, codes.meta.strides()[0], out.meta.strides()[0]],
    );
    let cubes = (r * c / vec).div_ceil(DEQUANTIZE_CUBE);
    // SAFETY: units past the `R · C / vec` vectors do nothing; each row is addressed through
    // its tensor's pitch, a multiple of the vector.
    unsafe {
        dequantize_kernel::launch_unchecked(
            &codes.client,
            CubeCount::Static(cubes as u32, 1, 1),
            CubeDim::new_1d(DEQUANTIZE_CUBE as u32),
            vec,
            codes.clone().into_tensor_arg(),
            scales.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            E4M3,
        );
    }
    out
}

/// `y = x · Wᵀ (+ bias) (+ add)`, `W` as codes (carrier `[N, K / 2]`) and scales `[N]` (all
/// equal with `w_per_tensor`); arguments checked by `super::check_args`.
pub(crate) fn fp8_linear(
    x: CubeTensor,
    codes: CubeTensor,
    w_scales: CubeTensor,
    bias: Option<CubeTensor>,
    add: Option<CubeTensor>,
    order: ReductionOrder,
    w_per_tensor: bool,
) -> CubeTensor {
    let dtype = x.dtype;
    let m = x.meta.shape()[0];
    let w = carrier_as_bytes(unit_inner_stride(codes));
    let n = w.meta.shape()[0];
    let bias = bias.map(unit_inner_stride);
    let add = add.map(unit_inner_stride);
    let skinny_max = Knobs::get().skinny_max_m.unwrap_or(SKINNY_MAX_M);
    // A batch-invariant product keeps one route whatever `M`.
    if m > 0 && n > 0 && m <= skinny_max && order != ReductionOrder::BatchInvariant {
        let (xq, x_scales) = quantize(x, false);
        return skinny(&xq, &x_scales, &w, &w_scales, bias, add, dtype);
    }
    let per_tensor =
        w_per_tensor && order != ReductionOrder::BatchInvariant && m <= PER_TENSOR_MAX_M;
    let (xq, x_scales) = quantize(x, per_tensor);

    #[cfg(feature = "cuda")]
    {
        use crate::rms_norm_linear::cublas::{Fp8Scales, gemm};
        use crate::rms_norm_linear::launch::cublas_device;
        let y = empty_device_dtype(
            xq.client.clone(),
            xq.device.clone(),
            Shape::new([m, n]),
            dtype,
        );
        if m == 0 || n == 0 {
            return y;
        }
        let scales = Fp8Scales {
            w: &w_scales,
            x: &x_scales,
            per_tensor,
        };
        let invariant = order == ReductionOrder::BatchInvariant;
        // cuBLASLt's FP8 product serves bf16 outputs here (an f32 output with per-row scale
        // vectors was refused on the H100: CUBLAS_STATUS_INVALID_VALUE) and wants `K` and `N`
        // in multiples of 16; other products are emulated. On failure
        // (reported once, the FP8 product then emulated on the device) the emulation below
        // computes it.
        let k = xq.meta.shape()[1];
        let shaped = dtype == DType::BF16 && k.is_multiple_of(16) && n.is_multiple_of(16);
        if shaped
            && cublas_device(&xq.device, &xq.client).is_some_and(|i| {
                gemm(
                    i,
                    &xq,
                    &w,
                    bias.as_ref(),
                    add.as_ref(),
                    &y,
                    invariant,
                    Some(scales),
                )
                .is_ok()
            })
        {
            return y;
        }
    }

    // The emulation: the same codes and scales, dequantised, multiplied in f32.
    let f32_of = |t: CubeTensor| CubeBackend::float_cast(t, FloatDType::F32);
    let xd = dequantize_rows(&xq, &x_scales);
    let wd = dequantize_rows(&w, &w_scales);
    let (y, _) = crate::rms_norm_linear::launch::fused_linear(
        xd,
        None,
        None,
        wd,
        bias.map(f32_of),
        add.map(f32_of),
        0.0,
        order,
    );
    if dtype == DType::F32 {
        y
    } else {
        CubeBackend::float_cast(y, dtype.into())
    }
}

/// `y = x · Wᵀ (+ bias) (+ add)` of few rows on the skinny kernel over the codes themselves
/// (`xq [M, K]`, `w [N, K]` bytes), the scales applied to each dot product.
fn skinny(
    xq: &CubeTensor,
    x_scales: &CubeTensor,
    w: &CubeTensor,
    w_scales: &CubeTensor,
    bias: Option<CubeTensor>,
    add: Option<CubeTensor>,
    dtype: DType,
) -> CubeTensor {
    let [m, k] = [xq.meta.shape()[0], xq.meta.shape()[1]];
    let n = w.meta.shape()[0];
    let client = xq.client.clone();
    let caps = DeviceCaps::of(&client);
    let y = empty_device_dtype(client.clone(), xq.device.clone(), Shape::new([m, n]), dtype);
    let cfg = SkinnyConfig {
        has_bias: bias.is_some(),
        has_add: add.is_some(),
        fp8: true,
        fp8_ptx: crate::fp8_codes::ptx_decodes(&caps),
        ..skinny_config(m, &caps)
    };
    let vec = vector_size(DType::U8, &[k, xq.meta.strides()[0], w.meta.strides()[0]]);
    // Absent operands (and the norm's, never applied here) are bound to `y` and never read.
    let placeholder = || y.clone();
    let operands = SkinnyOperands {
        x: xq.clone(),
        inv_rms: x_scales.clone(),
        gamma: placeholder(),
        w: w.clone(),
        scales: [x_scales.clone(), w_scales.clone()],
        bias: bias.unwrap_or_else(placeholder),
        add: add.unwrap_or_else(placeholder),
        out: y.clone(),
    };
    launch_skinny(operands, cfg, vec, [dtype_to_storage_type(dtype), E4M3]);
    y
}
