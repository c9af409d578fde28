//! [`Fp8LinearOps`]: the backend extension of the FP8 linear family and its CubeCL dispatch.

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::{Backend, backend_extension, tensor::FloatTensor};
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;

use super::Fp8Operands;
use super::launch;
use crate::{FP8_CARRIER, ReductionOrder};

/// The FP8 linear family as a Burn backend extension (the `Fusion` wrapper is generated: each
/// op is an opaque deferred operation on the fusion stream). Call it through
/// [`super::Fp8Rows::quantize`] and [`super::fp8_linear`], which check arguments.
#[backend_extension(Cube, Fusion)]
pub trait Fp8LinearOps: Backend {
    /// `x [R, C]` → its E4M3 codes (`[R, C / 2]` [`FP8_CARRIER`]) and scales (`[R]` f32): one
    /// scale per row, or with `per_tensor` one for the tensor, in every entry.
    #[fusion(meta = quantize_meta)]
    fn fp8_quantize(
        x: FloatTensor<Self>,
        per_tensor: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `y [M, N] = x [M, K] · Wᵀ (+ bias [N]) (+ residual [M, N])`, `W` given by its codes
    /// (`[N, K / 2]` carrier) and scales (`[N]` f32, all equal with
    /// [`Fp8Operands::PER_TENSOR`]). `operands` ([`Fp8Operands`] bits) says which of `bias` and
    /// `residual` are real; the others are placeholders, never read.
    #[fusion(meta = linear_meta)]
    fn fp8_linear(
        x: FloatTensor<Self>,
        codes: FloatTensor<Self>,
        scales: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        operands: u32,
    ) -> FloatTensor<Self>;
}

fn quantize_meta(x: &TensorSpec, _per_tensor: &bool) -> (TensorSpec, TensorSpec) {
    (
        TensorSpec::new(Shape::new([x.shape[0], x.shape[1] / 2]), FP8_CARRIER),
        TensorSpec::new(Shape::new([x.shape[0]]), DType::F32),
    )
}

fn linear_meta(
    x: &TensorSpec,
    codes: &TensorSpec,
    _scales: &TensorSpec,
    _bias: &TensorSpec,
    _residual: &TensorSpec,
    _operands: &u32,
) -> TensorSpec {
    TensorSpec::new(Shape::new([x.shape[0], codes.shape[0]]), x.dtype)
}

impl Fp8LinearOps for CubeBackend {
    fn fp8_quantize(
        x: FloatTensor<Self>,
        per_tensor: bool,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (codes, scales) = launch::quantize(x, per_tensor);
        (crate::attention::kv_cache::bytes_as_carrier(codes), scales)
    }

    fn fp8_linear(
        x: FloatTensor<Self>,
        codes: FloatTensor<Self>,
        scales: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        operands: u32,
    ) -> FloatTensor<Self> {
        let has = |bit: u32| operands & bit != 0;
        launch::fp8_linear(
            x,
            codes,
            scales,
            has(Fp8Operands::BIAS).then_some(bias),
            has(Fp8Operands::RESIDUAL).then_some(residual),
            if has(Fp8Operands::BATCH_INVARIANT) {
                ReductionOrder::BatchInvariant
            } else {
                ReductionOrder::Fastest
            },
            has(Fp8Operands::PER_TENSOR),
        )
    }
}
