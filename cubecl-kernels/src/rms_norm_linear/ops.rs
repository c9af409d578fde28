//! [`LinearOps`]: the backend extension of the fused linear layer and its CubeCL dispatch.

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::{Backend, backend_extension, tensor::FloatTensor};
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;

use super::LinearOperands;
use super::launch as linear_launch;
use crate::ReductionOrder;

/// The fused RMSNorm + linear product as a Burn backend extension (the `Fusion` wrapper is
/// generated: each op is an opaque deferred operation on the fusion stream). Call it through this
/// module's functions, which check arguments and fall back to plain Burn off CubeCL devices.
#[backend_extension(Cube, Fusion)]
pub trait LinearOps: Backend {
    /// `h = x (+ residual)`, `y = rms_norm(h, gamma)·Wᵀ (+ b)`; returns `(y [M, N], h [M, K])`.
    /// `operands` ([`LinearOperands`] bits) says which of `residual`, `gamma` and `bias` are
    /// real; the others are placeholders (any tensor) and are never read. With
    /// [`LinearOperands::ADD_OUT`], `residual [M, N]` is added to `y` instead.
    #[fusion(meta = fused_linear_meta)]
    fn fused_linear(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        operands: u32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);
}

fn fused_linear_meta(
    x: &TensorSpec,
    _residual: &TensorSpec,
    _gamma: &TensorSpec,
    weight: &TensorSpec,
    _bias: &TensorSpec,
    _eps: &f32,
    _operands: &u32,
) -> (TensorSpec, TensorSpec) {
    let y = TensorSpec::new(Shape::new([x.shape[0], weight.shape[0]]), x.dtype);
    (y, x.clone())
}

impl LinearOps for CubeBackend {
    fn fused_linear(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        operands: u32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let has = |bit: u32| operands & bit != 0;
        let (residual, add) = if has(LinearOperands::ADD_OUT) {
            (None, Some(residual))
        } else {
            (has(LinearOperands::RESIDUAL).then_some(residual), None)
        };
        linear_launch::fused_linear(
            x,
            residual,
            has(LinearOperands::NORM).then_some(gamma),
            weight,
            has(LinearOperands::BIAS).then_some(bias),
            add,
            eps,
            if has(LinearOperands::BATCH_INVARIANT) {
                ReductionOrder::BatchInvariant
            } else {
                ReductionOrder::Fastest
            },
        )
    }
}
