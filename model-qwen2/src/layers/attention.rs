use burn::module::Module;
use burn::tensor::Tensor;
use cubecl_kernels::attention::reference;
use cubecl_kernels::{AttentionMetadata, LayerKvCache, QkNorm, RowScale};

use super::{Linear, RmsNorm, RotaryEmbedding};

/// Grouped-query self-attention of one Qwen2/Qwen3 layer over the paged KV cache.
///
/// q, k and v are one merged projection (`qkv_proj.weight [(heads + 2·kv_heads)·head_dim, H]`)
/// of the layer's input, with the input RMSNorm's gain folded into its weight: the caller runs
/// the plain product of the raw rows, and [`Self::attend`] completes it (the norm's row scale,
/// then the bias) inside the KV write.
#[derive(Module, Debug)]
pub struct Qwen2Attention {
    /// Merged q/k/v projection, `[(heads + 2·kv_heads)·head_dim, H]` (+ bias on Qwen2), the
    /// input RMSNorm's gain folded in (`W·diag g`).
    pub qkv_proj: Linear,
    /// Output projection, `[H, heads·head_dim]`, no bias.
    pub o_proj: Linear,
    /// Qwen3's per-head RMSNorm of queries, `[head_dim]`.
    pub q_norm: Option<RmsNorm>,
    /// Qwen3's per-head RMSNorm of keys, `[head_dim]`.
    pub k_norm: Option<RmsNorm>,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
}

impl Qwen2Attention {
    /// Splits the merged projection into `q [T, heads, d]`, `k [T, kv_heads, d]`,
    /// `v [T, kv_heads, d]` and applies Qwen3's q/k norms (before RoPE), with plain Burn ops
    /// (the forward pass does this inside [`cubecl_kernels::rope_store_kv`]).
    pub fn split_qkv(&self, qkv: Tensor<2>) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
        let (q, k, v) = reference::split_qkv(qkv, self.num_heads, self.num_kv_heads, self.head_dim);
        match self.qk_norm() {
            Some(n) => (
                reference::head_rms_norm(q, n.q, n.eps),
                reference::head_rms_norm(k, n.k, n.eps),
                v,
            ),
            None => (q, k, v),
        }
    }

    fn qk_norm(&self) -> Option<QkNorm<'_>> {
        match (&self.q_norm, &self.k_norm) {
            (Some(q), Some(k)) => Some(QkNorm {
                q: &q.weight,
                k: &k.weight,
                eps: q.eps,
            }),
            _ => None,
        }
    }

    /// The unscaled, unbiased merged projection of the layer input `h [T, H]`:
    /// `h · (W·diag g)ᵀ` `[T, (heads + 2·kv_heads)·head_dim]` (what [`Self::attend`] takes).
    pub fn project(&self, h: Tensor<2>) -> Tensor<2> {
        self.qkv_proj.product(h)
    }

    /// The projection's deferred RMSNorm row scale and bias, for the layer input `h`.
    pub fn row_scale<'a>(&'a self, h: &'a Tensor<2>, eps: f64) -> RowScale<'a> {
        RowScale {
            input: h,
            bias: self.qkv_proj.bias.as_deref(),
            eps,
        }
    }

    /// Attention output before `o_proj`, `[T, heads·head_dim]`, from the unscaled merged
    /// projection `qkv [T, (heads + 2·kv_heads)·head_dim]` ([`Self::project`]) and its row scale.
    /// Stores the new keys/values in `cache`.
    pub fn attend(
        &self,
        qkv: Tensor<2>,
        row_scale: RowScale<'_>,
        rotary: &RotaryEmbedding,
        meta: &AttentionMetadata,
        cache: &mut LayerKvCache,
    ) -> Tensor<2> {
        let t = qkv.dims()[0];
        let q = cubecl_kernels::rope_store_kv(
            qkv,
            self.num_heads,
            Some(row_scale),
            self.qk_norm(),
            rotary.rope(),
            meta,
            cache,
        );
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        // The layer reduces in its products' order.
        let order = self.qkv_proj.order;
        cubecl_kernels::paged_attention_ordered(q, cache, meta, scale, order)
            .reshape([t, self.num_heads * self.head_dim])
    }
}
