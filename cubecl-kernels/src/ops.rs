//! The custom Burn backend ops: one extension trait, implemented for CubeCL backends (the
//! `Fusion` wrapper is generated: each op is an opaque deferred operation on the fusion stream).

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::{Backend, backend_extension, tensor::FloatTensor};
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;

use crate::rms_norm_linear::launch as linear_launch;

/// Our fused ops as a Burn backend extension. Call them through the functions of this crate
/// (which check arguments and fall back to plain Burn off CubeCL devices), not directly.
#[backend_extension(Cube, Fusion)]
pub trait KernelOps: Backend {
    /// `h = x (+ residual)`, `y = rms_norm(h, gamma)·Wᵀ (+ b)`; returns `(y [M, N], h [M, K])`.
    /// `operands` ([`LinearOperands`] bits) says which of `residual`, `gamma` and `bias` are
    /// real; the others are placeholders (any tensor) and are never read.
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

/// Which optional operands of [`KernelOps::fused_linear`] are present.
pub struct LinearOperands;

impl LinearOperands {
    /// `residual` is added to `x`.
    pub const RESIDUAL: u32 = 1;
    /// `gamma` is an RMSNorm weight.
    pub const NORM: u32 = 2;
    /// `bias` is added.
    pub const BIAS: u32 = 4;
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

impl KernelOps for CubeBackend {
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
        linear_launch::fused_linear(
            x,
            has(LinearOperands::RESIDUAL).then_some(residual),
            has(LinearOperands::NORM).then_some(gamma),
            weight,
            has(LinearOperands::BIAS).then_some(bias),
            eps,
        )
    }
}
