//! Plain-Burn paged attention: gathers each sequence's keys and values through its block table
//! and runs a masked softmax. Runs on every backend; the fallback path and the test oracle of
//! the CubeCL kernels.

use burn::tensor::{
    Bool, FloatDType, IndexingUpdateOp, Int, Tensor, TensorData, activation::softmax,
};

use super::{AttentionMetadata, LayerKvCache};

/// Writes the new tokens' keys and values into their cache slots (`meta.slot_mapping`, −1 =
/// skip).
///
/// `k`, `v`: `[num_tokens, num_kv_heads, head_dim]`.
pub fn store_kv(cache: &mut LayerKvCache, k: Tensor<3>, v: Tensor<3>, meta: &AttentionMetadata) {
    let [num_blocks, block_size, kv_heads, head_dim] = cache.dims();
    let device = k.device();
    let kept: Vec<usize> = (0..meta.num_tokens()).filter(|&t| meta.slot_mapping[t] >= 0).collect();
    if kept.is_empty() {
        return;
    }
    let slots: Vec<i64> = kept.iter().map(|&t| meta.slot_mapping[t]).collect();
    let slots = index_tensor(slots, &device);
    let rows = |x: Tensor<3>| {
        let x = x.reshape([meta.num_tokens(), kv_heads * head_dim]);
        if kept.len() == meta.num_tokens() {
            x
        } else {
            x.select(0, index_tensor(kept.iter().map(|&t| t as i64).collect(), &device))
        }
    };
    let write = |c: Tensor<4>, x: Tensor<3>| {
        c.reshape([num_blocks * block_size, kv_heads * head_dim])
            .select_assign(0, slots.clone(), rows(x), IndexingUpdateOp::Assign)
            .reshape([num_blocks, block_size, kv_heads, head_dim])
    };
    cache.k.inplace(|c| write(c, k));
    cache.v.inplace(|c| write(c, v));
}

/// Causal attention of each sequence's new tokens over its whole context in the paged cache
/// (the new tokens' keys must already be stored). Computed in f32, returned in `q`'s dtype.
///
/// `q`: `[num_tokens, num_heads, head_dim]` → `[num_tokens, num_heads, head_dim]`. Query head
/// `h` reads KV head `h / (num_heads / num_kv_heads)`.
pub fn paged_attention(
    q: Tensor<3>,
    cache: &LayerKvCache,
    meta: &AttentionMetadata,
    scale: f32,
) -> Tensor<3> {
    let [num_tokens, heads, head_dim] = q.dims();
    let [num_blocks, block_size, kv_heads, _] = cache.dims();
    let group = heads / kv_heads;
    let device = q.device();
    let dtype = q.dtype();
    let flat = |c: &Tensor<4>| {
        c.clone().reshape([num_blocks * block_size, kv_heads, head_dim]).cast(FloatDType::F32)
    };
    let (k_all, v_all) = (flat(&cache.k), flat(&cache.v));
    let q = q.cast(FloatDType::F32);
    let cu = meta.cu_seqlens_q();
    let mut outputs = Vec::with_capacity(meta.num_seqs());
    for s in 0..meta.num_seqs() {
        let (lq, ctx) = (meta.query_lens[s], meta.context_lens[s]);
        let slots = index_tensor(meta.context_slots(s, ctx), &device);
        // [ctx, kv_heads, d] -> [heads, ctx, d], each KV head repeated for its query group.
        let expand = |x: Tensor<3>| {
            x.select(0, slots.clone())
                .reshape([ctx, kv_heads, 1, head_dim])
                .expand([ctx, kv_heads, group, head_dim])
                .reshape([ctx, heads, head_dim])
                .swap_dims(0, 1)
        };
        let (k, v) = (expand(k_all.clone()), expand(v_all.clone()));
        let qs = q.clone().slice(cu[s]..cu[s + 1]).swap_dims(0, 1); // [heads, lq, d]
        let scores = qs.matmul(k.swap_dims(1, 2)) * scale; // [heads, lq, ctx]
        let scores = scores.mask_fill(causal_mask(lq, ctx, heads, &device), f32::NEG_INFINITY);
        let out = softmax(scores, 2).matmul(v); // [heads, lq, d]
        outputs.push(out.swap_dims(0, 1));
    }
    let out = Tensor::cat(outputs, 0);
    debug_assert_eq!(out.dims(), [num_tokens, heads, head_dim]);
    out.cast(dtype)
}

/// `[heads, lq, ctx]`, true where query `i` (position `ctx - lq + i`) must not see key `j`.
fn causal_mask(lq: usize, ctx: usize, heads: usize, device: &burn::tensor::Device) -> Tensor<3, Bool> {
    let offset = ctx - lq;
    let mask: Vec<bool> =
        (0..lq).flat_map(|i| (0..ctx).map(move |j| j > offset + i)).collect();
    Tensor::<2, Bool>::from_data(TensorData::new(mask, [lq, ctx]), device)
        .unsqueeze::<3>()
        .expand([heads, lq, ctx])
}

pub(crate) fn index_tensor(values: Vec<i64>, device: &burn::tensor::Device) -> Tensor<1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}
