use burn::module::Module;
use burn::tensor::Tensor;
use cubecl_kernels::{AttentionMetadata, LayerKvCache};

use super::{Linear, RmsNorm, RotaryEmbedding};

/// Grouped-query self-attention of one Qwen2/Qwen3 layer over the paged KV cache.
///
/// q, k and v are one merged projection (`qkv_proj.weight [(heads + 2·kv_heads)·head_dim, H]`),
/// computed by the caller together with the input RMSNorm.
#[derive(Module, Debug)]
pub struct Qwen2Attention {
    /// Merged q/k/v projection, `[(heads + 2·kv_heads)·head_dim, H]` (+ bias on Qwen2).
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
    /// `v [T, kv_heads, d]` and applies Qwen3's q/k norms (before RoPE).
    pub fn split_qkv(&self, qkv: Tensor<2>) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
        let t = qkv.dims()[0];
        let (hq, hkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let q = qkv.clone().slice_dim(1, 0..hq * d).reshape([t, hq, d]);
        let k = qkv.clone().slice_dim(1, hq * d..(hq + hkv) * d).reshape([t, hkv, d]);
        let v = qkv.slice_dim(1, (hq + hkv) * d..(hq + 2 * hkv) * d).reshape([t, hkv, d]);
        let per_head = |norm: &Option<RmsNorm>, x: Tensor<3>| match norm {
            Some(norm) => {
                let [t, h, d] = x.dims();
                norm.forward(x.reshape([t * h, d])).reshape([t, h, d])
            }
            None => x,
        };
        (per_head(&self.q_norm, q), per_head(&self.k_norm, k), v)
    }

    /// Attention output before `o_proj`, `[T, heads·head_dim]`, from the merged projection
    /// `qkv [T, (heads + 2·kv_heads)·head_dim]`. Stores the new keys/values in `cache`.
    pub fn attend(
        &self,
        qkv: Tensor<2>,
        rotary: &RotaryEmbedding,
        meta: &AttentionMetadata,
        cache: &mut LayerKvCache,
    ) -> Tensor<2> {
        let t = qkv.dims()[0];
        let (q, k, v) = self.split_qkv(qkv);
        let positions = meta.tensors.positions.clone();
        let q = rotary.apply(q, positions.clone());
        let k = rotary.apply(k, positions);
        cubecl_kernels::store_kv(cache, k, v, meta);
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        cubecl_kernels::paged_attention(q, cache, meta, scale).reshape([t, self.num_heads * self.head_dim])
    }
}
