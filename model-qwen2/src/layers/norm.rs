use burn::module::{Module, Param};
use burn::tensor::Tensor;

use super::Linear;

/// RMSNorm with a multiplicative weight (`w · x / √(mean(x²) + eps)`, statistics in f32).
#[derive(Module, Debug)]
pub struct RmsNorm {
    /// `[dim]`.
    pub weight: Param<Tensor<1>>,
    /// Added to the mean square.
    pub eps: f64,
}

impl RmsNorm {
    /// Wraps a loaded weight.
    pub fn new(weight: Tensor<1>, eps: f64) -> Self {
        Self {
            weight: Param::from_tensor(weight),
            eps,
        }
    }

    /// Normalises the last dimension of `x [M, dim]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        cubecl_kernels::rms_norm(x, self.weight.val(), self.eps)
    }

    /// `rms_norm(x) · Wᵀ (+ b)` in one op (two for an FP8 `linear`), in `linear`'s reduction
    /// order. `x [M, dim]` → `[M, out]`.
    pub fn forward_linear(&self, x: Tensor<2>, linear: &Linear) -> Tensor<2> {
        if linear.fp8_scales.is_some() {
            // The FP8 product quantises its input rows: the norm runs first.
            return linear.forward(self.forward(x));
        }
        cubecl_kernels::rms_norm_linear_ordered(
            x,
            self.weight.val(),
            linear.weight.val(),
            linear.bias.as_ref().map(Param::val),
            self.eps,
            linear.order,
        )
    }
}
