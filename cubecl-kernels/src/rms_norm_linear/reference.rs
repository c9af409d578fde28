//! Plain-Burn composition of RMSNorm followed by a linear layer: the definition of the fused
//! op, the path on non-CubeCL backends and the test oracle.

use burn::tensor::{FloatDType, Tensor};

/// RMSNorm over the last dimension, as Hugging Face's `Qwen2RMSNorm` computes it: the statistics
/// in f32, the normalised row cast back to the input dtype, then multiplied by `weight`.
///
/// `x [M, K]`, `weight [K]` → `[M, K]`, in `x`'s dtype.
pub fn rms_norm(x: Tensor<2>, weight: Tensor<1>, eps: f64) -> Tensor<2> {
    let dtype = x.dtype();
    let xf = x.cast(FloatDType::F32);
    (xf.clone() * inv_rms(xf, eps)).cast(dtype) * weight.unsqueeze::<2>()
}

/// `1 / √(mean_k x[t, k]² + eps)` of each row: `x [M, K]` f32 → `[M, 1]` f32.
pub(crate) fn inv_rms(x: Tensor<2>, eps: f64) -> Tensor<2> {
    (x.square().mean_dim(1) + eps).sqrt().recip()
}

/// `x · Wᵀ (+ b)` with the weight in the Hugging Face layout.
///
/// `x [M, K]`, `weight [N, K]`, `bias [N]` → `[M, N]`.
pub fn linear(x: Tensor<2>, weight: Tensor<2>, bias: Option<Tensor<1>>) -> Tensor<2> {
    let y = x.matmul(weight.transpose());
    match bias {
        Some(b) => y + b.unsqueeze::<2>(),
        None => y,
    }
}

/// `rms_norm(x, norm_weight) · Wᵀ (+ b)`.
///
/// `x [M, K]`, `norm_weight [K]`, `weight [N, K]`, `bias [N]` → `[M, N]`.
pub fn rms_norm_linear(
    x: Tensor<2>,
    norm_weight: Tensor<1>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    eps: f64,
) -> Tensor<2> {
    linear(rms_norm(x, norm_weight, eps), weight, bias)
}

/// Residual variant: `h = x + residual`, `y = rms_norm(h) · Wᵀ (+ b)`; returns `(y, h)`.
///
/// `x [M, K]`, `residual [M, K]` → `y [M, N]`, `h [M, K]`.
pub fn add_rms_norm_linear(
    x: Tensor<2>,
    residual: Tensor<2>,
    norm_weight: Tensor<1>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    eps: f64,
) -> (Tensor<2>, Tensor<2>) {
    let h = x + residual;
    (
        rms_norm_linear(h.clone(), norm_weight, weight, bias, eps),
        h,
    )
}
