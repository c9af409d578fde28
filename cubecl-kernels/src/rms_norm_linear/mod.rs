//! Fused RMSNorm + linear, its residual variant, and the plain linear op.

pub mod reference;

use burn::tensor::Tensor;

/// RMSNorm over the last dimension (statistics in f32). `x [M, K]`, `weight [K]` → `[M, K]`.
pub fn rms_norm(x: Tensor<2>, weight: Tensor<1>, eps: f64) -> Tensor<2> {
    reference::rms_norm(x, weight, eps)
}

/// `y = rms_norm(x, norm_weight) · Wᵀ (+ b)`.
///
/// `x [M, K]`, `norm_weight [K]`, `weight [N, K]` (Hugging Face layout), `bias [N]` → `[M, N]`.
pub fn rms_norm_linear(
    x: Tensor<2>,
    norm_weight: Tensor<1>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    eps: f64,
) -> Tensor<2> {
    reference::rms_norm_linear(x, norm_weight, weight, bias, eps)
}

/// `h = x + residual; y = rms_norm(h, norm_weight) · Wᵀ (+ b)`; returns `(y, h)`.
///
/// `x`, `residual [M, K]`, `norm_weight [K]`, `weight [N, K]`, `bias [N]` →
/// `(y [M, N], h [M, K])`.
pub fn add_rms_norm_linear(
    x: Tensor<2>,
    residual: Tensor<2>,
    norm_weight: Tensor<1>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    eps: f64,
) -> (Tensor<2>, Tensor<2>) {
    reference::add_rms_norm_linear(x, residual, norm_weight, weight, bias, eps)
}

/// `y = x · Wᵀ (+ b)`. `x [M, K]`, `weight [N, K]`, `bias [N]` → `[M, N]`.
pub fn linear(x: Tensor<2>, weight: Tensor<2>, bias: Option<Tensor<1>>) -> Tensor<2> {
    reference::linear(x, weight, bias)
}
