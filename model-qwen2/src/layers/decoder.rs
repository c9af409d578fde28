use burn::module::Module;
use burn::tensor::Tensor;
use cubecl_kernels::{AttentionMetadata, LayerKvCache};

use super::{Linear, Qwen2Attention, Qwen2Mlp, RmsNorm, RotaryEmbedding};
use crate::tensor_parallel::Parallel;

/// One decoder layer: `h += attn(norm(h)); h += mlp(norm(h))`.
///
/// Neither RMSNorm runs as a kernel of its own: their gains are folded into the weights of the
/// products that follow them (qkv, gate/up; [`Self::fold_norm_gains`], done at load), the
/// products multiply the raw residual stream, and the per-row `1/rms` is applied by the kernels
/// that read the products next (the KV write, the gated activation; see
/// [`cubecl_kernels::row_scale`]). The residual adds ride in o_proj's and down_proj's products.
#[derive(Module, Debug)]
pub struct Qwen2DecoderLayer {
    /// RMSNorm before attention, `[H]`; its gain is also folded into `qkv_proj`.
    pub input_layernorm: RmsNorm,
    /// Self-attention.
    pub self_attn: Qwen2Attention,
    /// RMSNorm before the MLP, `[H]`; its gain is also folded into `gate_up_proj`.
    pub post_attention_layernorm: RmsNorm,
    /// Gated MLP.
    pub mlp: Qwen2Mlp,
    /// Under tensor parallelism, this rank and its collective: o_proj and down_proj hold the
    /// rank's input columns, and their partial products are summed over the ranks (the
    /// residual added by rank 0 alone). `None`: the whole layer.
    #[module(skip)]
    pub parallel: Option<Parallel>,
}

impl Qwen2DecoderLayer {
    /// A layer from checkpoint weights (q/k/v and gate/up merged, norms not yet folded): folds
    /// each norm's gain into the product after it.
    pub fn fold_norm_gains(mut self) -> Self {
        let fold = |linear: &mut super::Linear, norm: &RmsNorm| {
            let w = cubecl_kernels::fold_norm_gain(linear.weight.val(), norm.weight.val());
            linear.weight = burn::module::Param::from_tensor(w);
        };
        fold(&mut self.self_attn.qkv_proj, &self.input_layernorm);
        fold(&mut self.mlp.gate_up_proj, &self.post_attention_layernorm);
        self
    }

    /// The residual stream after this layer, `h [T, H]` → `[T, H]`. Writes the batch's keys and
    /// values into `cache`.
    pub fn forward(
        &self,
        h: Tensor<2>,
        rotary: &RotaryEmbedding,
        meta: &AttentionMetadata,
        cache: &mut LayerKvCache,
    ) -> Tensor<2> {
        let attn = &self.self_attn;
        let qkv = attn.project(h.clone());
        let row_scale = attn.row_scale(&h, self.input_layernorm.eps);
        let out = attn.attend(qkv, row_scale, rotary, meta, cache);
        let h = self.residual_product(out, &attn.o_proj, h);
        let act = self.mlp.activation(&h, self.post_attention_layernorm.eps);
        self.residual_product(act, &self.mlp.down_proj, h)
    }

    /// `h + x·Wᵀ` `[T, H]` of a row-split product (`x [T, K]`, `linear.weight [H, K]`): the
    /// residual rides in the product's epilogue; under tensor parallelism rank 0 adds it to
    /// its partial product, the others add nothing, and the sum over the ranks completes it.
    fn residual_product(&self, x: Tensor<2>, linear: &Linear, h: Tensor<2>) -> Tensor<2> {
        match &self.parallel {
            None => linear.product_add(x, h),
            Some(p) if p.rank.rank == 0 => p.all_reduce.sum(linear.product_add(x, h)),
            Some(p) => p.all_reduce.sum(linear.product(x)),
        }
    }
}
