use burn::module::Module;
use burn::tensor::{Tensor, activation::silu};

use super::Linear;

/// SiLU-gated MLP: `down(silu(gate(x)) · up(x))`, gate and up merged into one projection that the
/// caller computes together with the post-attention RMSNorm.
#[derive(Module, Debug)]
pub struct Qwen2Mlp {
    /// `[2·I, H]`: rows `0..I` are `gate_proj`, rows `I..2I` are `up_proj`.
    pub gate_up_proj: Linear,
    /// `[H, I]`.
    pub down_proj: Linear,
}

impl Qwen2Mlp {
    /// `silu(gate) · up` from the merged projection `gate_up [T, 2·I]` → `[T, I]`.
    pub fn activate(gate_up: Tensor<2>) -> Tensor<2> {
        let i = gate_up.dims()[1] / 2;
        let gate = gate_up.clone().slice_dim(1, 0..i);
        let up = gate_up.slice_dim(1, i..2 * i);
        silu(gate) * up
    }

    /// `down(silu(gate) · up)` from `gate_up [T, 2·I]` → `[T, H]`.
    pub fn forward_from_gate_up(&self, gate_up: Tensor<2>) -> Tensor<2> {
        self.down_proj.forward(Self::activate(gate_up))
    }
}
