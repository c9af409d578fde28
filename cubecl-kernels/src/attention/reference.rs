//! Plain-Burn paged attention: gathers each sequence's keys and values through its block table
//! and runs a masked softmax. Runs on every backend; the fallback path and the test oracle of
//! the CubeCL kernels.

use burn::tensor::{
    Bool, FloatDType, IndexingUpdateOp, Int, Tensor, TensorData, activation::softmax,
};

use super::{AttentionMetadata, LayerKvCache, QkNorm, Rope};
use crate::rms_norm_linear::reference::rms_norm;

/// Rotate-half (GPT-NeoX) RoPE of `x [T, heads, D]` at `positions [T]`: element `j` pairs with
/// `j + D/2`, `x' = x·cos + rotate_half(x)·sin`, computed in f32 and returned in `x`'s dtype.
pub fn apply_rope(x: Tensor<3>, rope: Rope<'_>, positions: Tensor<1, Int>) -> Tensor<3> {
    let [t, _, d] = x.dims();
    let half = d / 2;
    let dtype = x.dtype();
    let cos = rope
        .cos
        .clone()
        .select(0, positions.clone())
        .reshape([t, 1, half]);
    let sin = rope.sin.clone().select(0, positions).reshape([t, 1, half]);
    let x = x.cast(FloatDType::F32);
    let x1 = x.clone().slice_dim(2, 0..half);
    let x2 = x.slice_dim(2, half..d);
    let out1 = x1.clone() * cos.clone() - x2.clone() * sin.clone();
    let out2 = x2 * cos + x1 * sin;
    Tensor::cat(vec![out1, out2], 2).cast(dtype)
}

/// Splits `qkv [T, (heads + 2·kv_heads)·D]` into `q [T, heads, D]`, `k`, `v [T, kv_heads, D]`.
pub fn split_qkv(
    qkv: Tensor<2>,
    heads: usize,
    kv_heads: usize,
    d: usize,
) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
    let t = qkv.dims()[0];
    let q = qkv
        .clone()
        .slice_dim(1, 0..heads * d)
        .reshape([t, heads, d]);
    let k = qkv
        .clone()
        .slice_dim(1, heads * d..(heads + kv_heads) * d)
        .reshape([t, kv_heads, d]);
    let v = qkv
        .slice_dim(1, (heads + kv_heads) * d..(heads + 2 * kv_heads) * d)
        .reshape([t, kv_heads, d]);
    (q, k, v)
}

/// Per-head RMSNorm of `x [T, heads, D]` with `weight [D]`.
pub fn head_rms_norm(x: Tensor<3>, weight: &Tensor<1>, eps: f64) -> Tensor<3> {
    let [t, h, d] = x.dims();
    rms_norm(x.reshape([t * h, d]), weight.clone(), eps).reshape([t, h, d])
}

/// Reference of [`crate::rope_store_kv`]: split, q/k norm, RoPE, KV write; returns q.
pub fn rope_store_kv(
    qkv: Tensor<2>,
    heads: usize,
    qk_norm: Option<QkNorm<'_>>,
    rope: Rope<'_>,
    meta: &AttentionMetadata,
    cache: &mut LayerKvCache,
) -> Tensor<3> {
    let (mut q, mut k, v) = split_qkv(qkv, heads, cache.kv_heads(), cache.head_dim());
    if let Some(n) = qk_norm {
        q = head_rms_norm(q, n.q, n.eps);
        k = head_rms_norm(k, n.k, n.eps);
    }
    let positions = meta.tensors.positions.clone();
    let q = apply_rope(q, rope, positions.clone());
    let k = apply_rope(k, rope, positions);
    store_kv(cache, k, v, meta);
    q
}

/// Writes the new tokens' keys and values into their cache slots (`meta.slot_mapping`, −1 =
/// skip).
///
/// `k`, `v`: `[num_tokens, num_kv_heads, head_dim]`.
pub fn store_kv(cache: &mut LayerKvCache, k: Tensor<3>, v: Tensor<3>, meta: &AttentionMetadata) {
    let shape = cache.dims();
    let [num_blocks, kv_heads, block_size, head_dim] = shape;
    let device = k.device();
    let kept: Vec<usize> = (0..meta.num_tokens())
        .filter(|&t| meta.slot_mapping[t] >= 0)
        .collect();
    if kept.is_empty() {
        return;
    }
    let slots: Vec<i64> = kept.iter().map(|&t| meta.slot_mapping[t]).collect();
    let rows_at = index_tensor(head_rows(&slots, kv_heads, block_size), &device);
    // [tokens, kv_heads, D] -> the kept tokens' head rows, [kept · kv_heads, D].
    let rows = |x: Tensor<3>| {
        let x = if kept.len() == meta.num_tokens() {
            x
        } else {
            x.select(
                0,
                index_tensor(kept.iter().map(|&t| t as i64).collect(), &device),
            )
        };
        x.reshape([kept.len() * kv_heads, head_dim])
    };
    let write = |c: Tensor<4>, x: Tensor<3>| {
        c.reshape([num_blocks * kv_heads * block_size, head_dim])
            .select_assign(0, rows_at.clone(), rows(x), IndexingUpdateOp::Assign)
            .reshape(shape)
    };
    cache.k.inplace(|c| write(c, k));
    cache.v.inplace(|c| write(c, v));
}

/// The cache rows (`[num_blocks · kv_heads · block_size, D]` view of the head-major layout,
/// [`crate::LayerKvCache`]) of every kv head of each slot, slot-major: `slots.len() · kv_heads`.
fn head_rows(slots: &[i64], kv_heads: usize, block_size: usize) -> Vec<i64> {
    let (kv_heads, block_size) = (kv_heads as i64, block_size as i64);
    slots
        .iter()
        .flat_map(|&s| {
            (0..kv_heads)
                .map(move |h| ((s / block_size) * kv_heads + h) * block_size + s % block_size)
        })
        .collect()
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
    let [num_blocks, kv_heads, block_size, _] = cache.dims();
    let group = heads / kv_heads;
    let device = q.device();
    let dtype = q.dtype();
    let flat = |c: &Tensor<4>| {
        c.clone()
            .reshape([num_blocks * kv_heads * block_size, head_dim])
            .cast(FloatDType::F32)
    };
    let (k_all, v_all) = (flat(&cache.k), flat(&cache.v));
    let q = q.cast(FloatDType::F32);
    let cu = meta.cu_seqlens_q();
    let mut outputs = Vec::with_capacity(meta.num_seqs());
    for s in 0..meta.num_seqs() {
        let (lq, ctx) = (meta.query_lens[s], meta.context_lens[s]);
        let rows = head_rows(&meta.context_slots(s, ctx), kv_heads, block_size);
        let rows = index_tensor(rows, &device);
        // [ctx, kv_heads, d] -> [heads, ctx, d], each KV head repeated for its query group.
        let expand = |x: Tensor<2>| {
            x.select(0, rows.clone())
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
fn causal_mask(
    lq: usize,
    ctx: usize,
    heads: usize,
    device: &burn::tensor::Device,
) -> Tensor<3, Bool> {
    let offset = ctx - lq;
    let mask: Vec<bool> = (0..lq)
        .flat_map(|i| (0..ctx).map(move |j| j > offset + i))
        .collect();
    Tensor::<2, Bool>::from_data(TensorData::new(mask, [lq, ctx]), device)
        .unsqueeze::<3>()
        .expand([heads, lq, ctx])
}

pub(crate) fn index_tensor(values: Vec<i64>, device: &burn::tensor::Device) -> Tensor<1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}
