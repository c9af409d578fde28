use burn::module::Module;
use burn::tensor::Tensor;
use cubecl_kernels::RowScale;

use super::Linear;

/// SiLU-gated MLP: `down(silu(gate(norm(h))) · up(norm(h)))`, gate and up merged into one
/// projection whose weight carries the post-attention RMSNorm's gain; the norm's row scale is
/// applied in the activation ([`cubecl_kernels::silu_mul()`]).
#[derive(Module, Debug)]
pub struct Qwen2Mlp {
    /// `[2·I, H]`: rows `0..I` are `gate_proj`, rows `I..2I` are `up_proj`, the post-attention
    /// RMSNorm's gain folded in (`W·diag g`).
    pub gate_up_proj: Linear,
    /// `[H, I]`.
    pub down_proj: Linear,
}

impl Qwen2Mlp {
    /// The activation `silu(gate)·up` `[T, I]` of the post-attention residual stream
    /// `h [T, H]`: the unscaled merged projection, completed by the norm's row scale
    /// (epsilon `eps`) in the activation kernel.
    pub fn activation(&self, h: &Tensor<2>, eps: f64) -> Tensor<2> {
        let gate_up = self.gate_up_proj.product(h.clone());
        cubecl_kernels::silu_mul(
            gate_up,
            Some(RowScale {
                input: h,
                bias: None,
                eps,
            }),
        )
    }

    /// `h + mlp(norm(h))` `[T, H]`: the block's output, the residual added in `down_proj`.
    pub fn forward_residual(&self, h: Tensor<2>, eps: f64) -> Tensor<2> {
        let act = self.activation(&h, eps);
        self.down_proj.product_add(act, h)
    }
}
