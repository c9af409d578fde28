//! FP8 weights for the linear family (vLLM's `--quantization fp8` on a 16-bit checkpoint):
//! weights quantised once to E4M3 with one f32 scale per tensor (vLLM's online FP8) or per
//! output feature ([`Fp8Scaling`]), activations quantised on the fly (per tensor or per row:
//! `launch`'s module doc), the product `y = x · Wᵀ (+ b) (+ residual)` in the model's dtype.
//!
//! Quantisation of a matrix `[R, C]` row by row ([`Fp8Rows`]): `scale[r] = max_c |x[r, c]| / 448`
//! (1 for a row of zeros), `code[r, c] = e4m3(x[r, c] / scale[r])` (round to nearest even,
//! saturating), so `x[r, c] ≈ code[r, c] · scale[r]`; per tensor the same with the largest
//! magnitude of the whole matrix, its scale repeated in every row's entry. The product is
//! `y[m, n] = scale_x[m] · scale_w[n] · Σ_k code_x[m, k] · code_w[n, k]`, the sum in f32.
//!
//! Routes: on CUDA devices with FP8 tensor cores (compute capability ≥ 8.9), cuBLASLt's FP8
//! GEMM with scalar scales (per tensor) or per-row scale vectors (`rms_norm_linear/cublas.rs`:
//! the bias as its epilogue, the residual as C with `beta = 1`, on CubeCL's stream and so
//! inside CUDA graphs); on CubeCL's CPU runtime (tests) and wherever cuBLASLt's FP8 product
//! fails, an emulation with the same quantisation: the codes dequantised to f32 and multiplied
//! by the f32 linear kernels.
//! [`fp8_linear_support`] says whether a device runs it.
//!
//! Burn has no 8-bit float dtype and a float tensor cannot hold `U8`, so the codes travel in an
//! f16 tensor of half the width ([`crate::FP8_CARRIER`], `[R, C / 2]`: the same bytes), like an
//! FP8 KV cache's.

mod kernel;
mod launch;
mod ops;
pub mod reference;

use burn::backend::{Dispatch, DispatchDevice};
use burn::tensor::{DType, Device, Tensor};

pub use self::ops::Fp8LinearOps;
use crate::attention::KvCacheDtype;
use crate::knobs::Knobs;
use crate::{FP8_CARRIER, KernelError, ReductionOrder};

/// How a matrix's FP8 scales are shared.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fp8Scaling {
    /// One scale for the whole matrix (vLLM's online FP8); the products then quantise their
    /// activations per tensor too and take cuBLASLt's scalar-scale GEMM.
    #[default]
    PerTensor,
    /// One scale per row (a weight's output feature); activations per row, cuBLASLt's
    /// scale-vector GEMM.
    PerRow,
}

impl Fp8Scaling {
    /// The scaling of FP8 weights quantised at load: [`Fp8Scaling::PerTensor`], or per row with
    /// `BURN_NANOVLLM_FP8_SCALES=row` (for A/B runs).
    pub fn for_weights() -> Self {
        if Knobs::get().fp8_scales_per_row {
            Self::PerRow
        } else {
            Self::PerTensor
        }
    }
}

/// A matrix quantised to FP8 E4M3 (module doc): `x[r, c] ≈ code[r, c] · scales[r]`, one scale
/// per row or one for the matrix repeated in each row's entry ([`Fp8Scaling`]).
#[derive(Clone, Debug)]
pub struct Fp8Rows {
    /// The E4M3 codes of `[R, C]`, carried two to an element: `[R, C / 2]`, [`FP8_CARRIER`].
    pub codes: Tensor<2>,
    /// `[R]` f32.
    pub scales: Tensor<1>,
    /// Whether `scales` holds one scale per row or the tensor's in every entry.
    pub scaling: Fp8Scaling,
}

impl Fp8Rows {
    /// Quantises `x [R, C]` (f32, f16 or bf16; `C` a multiple of 4) with `scaling` on its
    /// device, which must run CubeCL kernels ([`fp8_linear_support`]).
    pub fn quantize(x: Tensor<2>, scaling: Fp8Scaling) -> Result<Self, KernelError> {
        let [_, c] = x.dims();
        if !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            return Err(KernelError::invalid(format!(
                "FP8 quantisation: x has dtype {:?}; expected f32, f16 or bf16",
                x.dtype()
            )));
        }
        if !c.is_multiple_of(4) {
            return Err(KernelError::invalid(format!(
                "FP8 quantisation: x has shape {:?}; its rows need a length that is a multiple \
                 of 4",
                x.dims()
            )));
        }
        if !crate::runs_kernels(&x) {
            return Err(KernelError::invalid(
                "FP8 quantisation runs on CubeCL devices (CUDA or CubeCL's CPU runtime)",
            ));
        }
        let per_tensor = scaling == Fp8Scaling::PerTensor;
        let (codes, scales) = Dispatch::fp8_quantize(x.into_dispatch(), per_tensor);
        Ok(Self {
            codes: Tensor::from_dispatch(codes),
            scales: Tensor::from_dispatch(scales),
            scaling,
        })
    }

    /// The quantised matrix's shape `[R, C]` (the codes' carrier is half as wide).
    pub fn dims(&self) -> [usize; 2] {
        let [r, w] = self.codes.dims();
        [r, 2 * w]
    }

    /// The codes (`R · C` bytes, row-major) and the scales, read back to the host.
    pub fn to_host(&self) -> (Vec<u8>, Vec<f32>) {
        let codes = self.codes.clone().into_data().as_bytes().to_vec();
        let scales = self
            .scales
            .clone()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap_or_default();
        (codes, scales)
    }

    /// The value of code `bits` (E4M3).
    pub fn decode(bits: u8) -> f32 {
        KvCacheDtype::Fp8E4M3.decode(bits)
    }
}

/// `y = x · Wᵀ (+ b) (+ residual)` with `W` quantised to FP8 ([`Fp8Rows`] of `[N, K]`), `x`
/// quantised on the fly, per tensor when `W` is (module doc).
///
/// `x [M, K]` (f16 or bf16 on CUDA; f32 too on the CPU runtime), `bias [N]`, `residual
/// [M, N]` of `x`'s dtype → `[M, N]` of `x`'s dtype. `order`: with
/// [`ReductionOrder::BatchInvariant`] one cuBLASLt algorithm serves every `M` of the weight.
///
/// # Panics
/// On mismatched shapes or dtypes, naming the operand, or on a device that does not run it
/// ([`fp8_linear_support`]).
pub fn fp8_linear(
    x: Tensor<2>,
    weight: &Fp8Rows,
    bias: Option<Tensor<1>>,
    residual: Option<Tensor<2>>,
    order: ReductionOrder,
) -> Tensor<2> {
    if let Err(e) = check_args(&x, weight, bias.as_ref(), residual.as_ref()) {
        panic!("fp8_linear: {e}");
    }
    let mut operands = 0;
    if bias.is_some() {
        operands |= Fp8Operands::BIAS;
    }
    if residual.is_some() {
        operands |= Fp8Operands::RESIDUAL;
    }
    if order == ReductionOrder::BatchInvariant {
        operands |= Fp8Operands::BATCH_INVARIANT;
    }
    if weight.scaling == Fp8Scaling::PerTensor {
        operands |= Fp8Operands::PER_TENSOR;
    }
    let placeholder = || x.clone().into_dispatch();
    Tensor::from_dispatch(Dispatch::fp8_linear(
        x.clone().into_dispatch(),
        weight.codes.clone().into_dispatch(),
        weight.scales.clone().into_dispatch(),
        bias.map(|b| b.into_dispatch()).unwrap_or_else(placeholder),
        residual
            .map(Tensor::into_dispatch)
            .unwrap_or_else(placeholder),
        operands,
    ))
}

/// Which optional operands of [`Fp8LinearOps::fp8_linear`] are present.
pub struct Fp8Operands;

impl Fp8Operands {
    /// `bias [N]` is added.
    pub const BIAS: u32 = 1;
    /// `residual [M, N]` is added to the output.
    pub const RESIDUAL: u32 = 2;
    /// [`ReductionOrder::BatchInvariant`].
    pub const BATCH_INVARIANT: u32 = 4;
    /// The weight is quantised per tensor ([`Fp8Scaling::PerTensor`]).
    pub const PER_TENSOR: u32 = 8;
}

/// Whether FP8 weights run on `device`: on CUDA devices of compute capability ≥ 8.9 where
/// cuBLASLt loads, and (emulated, for tests) on CubeCL's CPU runtime; elsewhere an error that
/// says why.
pub fn fp8_linear_support(device: &Device) -> Result<(), KernelError> {
    #[allow(unreachable_patterns)]
    match device.as_dispatch() {
        #[cfg(feature = "cuda")]
        DispatchDevice::Cube(cubecl::Device::Cuda(d)) => {
            match crate::rms_norm_linear::cublas::fp8_unavailable_reason(d.index) {
                None => Ok(()),
                Some(reason) => Err(KernelError::invalid(format!(
                    "FP8 weights need cuBLASLt's FP8 product: {reason}"
                ))),
            }
        }
        #[cfg(feature = "cpu")]
        DispatchDevice::Cube(cubecl::Device::Cpu(_)) => Ok(()),
        _ => Err(KernelError::invalid(
            "FP8 weights run on CUDA devices with FP8 tensor cores (compute capability 8.9 or \
             later) and, emulated, on CubeCL's CPU runtime; not on this device",
        )),
    }
}

/// Checks [`fp8_linear`]'s operands.
fn check_args(
    x: &Tensor<2>,
    weight: &Fp8Rows,
    bias: Option<&Tensor<1>>,
    residual: Option<&Tensor<2>>,
) -> Result<(), KernelError> {
    let m = x.dims()[0];
    let n = weight.dims()[0];
    let dtype = x.dtype();
    crate::rms_norm_linear::check_x_and_weight(x, weight.dims())?;
    if !weight.dims()[1].is_multiple_of(4) {
        return Err(KernelError::invalid(format!(
            "weight has shape {:?}; FP8 products need K, its second dimension, a multiple of 4",
            weight.dims()
        )));
    }
    if weight.codes.dtype() != FP8_CARRIER || weight.scales.dtype() != DType::F32 {
        return Err(KernelError::invalid(format!(
            "weight codes have dtype {:?} and scales {:?}; expected {FP8_CARRIER:?} and F32",
            weight.codes.dtype(),
            weight.scales.dtype()
        )));
    }
    if weight.scales.dims() != [n] {
        return Err(KernelError::invalid(format!(
            "weight scales have shape {:?}; expected [{n}]",
            weight.scales.dims()
        )));
    }
    if let Some(b) = bias
        && (b.dims() != [n] || b.dtype() != dtype)
    {
        return Err(KernelError::invalid(format!(
            "bias has shape {:?} and dtype {:?}; expected [{n}] and {dtype:?}",
            b.dims(),
            b.dtype()
        )));
    }
    if let Some(r) = residual
        && (r.dims() != [m, n] || r.dtype() != dtype)
    {
        return Err(KernelError::invalid(format!(
            "residual has shape {:?} and dtype {:?}; expected [{m}, {n}] and {dtype:?}",
            r.dims(),
            r.dtype()
        )));
    }
    Ok(())
}
