use burn::module::Module;
use burn::tensor::Tensor;
use cubecl_kernels::{AttentionMetadata, LayerKvCache};

use super::{Qwen2Attention, Qwen2Mlp, RmsNorm, RotaryEmbedding};

/// One decoder layer: `h += attn(norm(h)); h += mlp(norm(h))`.
///
/// The residual add is deferred into the next norm (the fused residual RMSNorm + linear), so the
/// layer takes and returns the pair `(x, residual)` whose sum is the residual stream.
#[derive(Module, Debug)]
pub struct Qwen2DecoderLayer {
    /// RMSNorm before attention, `[H]`.
    pub input_layernorm: RmsNorm,
    /// Self-attention.
    pub self_attn: Qwen2Attention,
    /// RMSNorm before the MLP, `[H]`.
    pub post_attention_layernorm: RmsNorm,
    /// Gated MLP.
    pub mlp: Qwen2Mlp,
}

impl Qwen2DecoderLayer {
    /// `x [T, H]` and the pending `residual [T, H]` (None for the first layer, whose input is
    /// the embedding) → `(mlp_out [T, H], residual [T, H])`; the layer's output is their sum.
    pub fn forward(
        &self,
        x: Tensor<2>,
        residual: Option<Tensor<2>>,
        rotary: &RotaryEmbedding,
        meta: &AttentionMetadata,
        cache: &mut LayerKvCache,
    ) -> (Tensor<2>, Tensor<2>) {
        let (qkv, residual) = match residual {
            Some(r) => self
                .input_layernorm
                .forward_add_linear(x, r, &self.self_attn.qkv_proj),
            None => (
                self.input_layernorm
                    .forward_linear(x.clone(), &self.self_attn.qkv_proj),
                x,
            ),
        };
        let attn = self.self_attn.attend(qkv, rotary, meta, cache);
        let attn = self.self_attn.o_proj.forward(attn);
        let (gate_up, residual) = self.post_attention_layernorm.forward_add_linear(
            attn,
            residual,
            &self.mlp.gate_up_proj,
        );
        (self.mlp.forward_from_gate_up(gate_up), residual)
    }
}
