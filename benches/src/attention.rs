//! Paged decode and prefill attention at Qwen head shapes, bf16, over a cache in the model's
//! dtype or FP8 (`--kv-cache-dtype`: a zeroed cache, whose reads time as any other; the
//! kernels' FP8 results are checked by the kernel tests).

use burn::tensor::{DType, Device, Distribution, Tensor};
use cubecl_kernels::attention::reference;
use cubecl_kernels::{AttentionMetadata, KvCacheDtype, LayerKvCache};
use model_qwen2::Qwen2Config;
use rand::seq::SliceRandom;
use serde_json::json;

use crate::linear::rel_err;
use crate::report::Report;
use crate::timing::graph_us;

const BLOCK_SIZE: usize = 16;

struct Setup {
    cache: LayerKvCache,
    meta: AttentionMetadata,
    q: Tensor<3>,
}

/// `seqs` of (new tokens, context) with shuffled blocks and random keys/values/queries.
fn setup(
    c: &Qwen2Config,
    seqs: &[(usize, usize)],
    device: &Device,
    dtype: DType,
    kv: KvCacheDtype,
) -> Setup {
    let blocks: usize = seqs.iter().map(|s| s.1.div_ceil(BLOCK_SIZE)).sum();
    let mut ids: Vec<u32> = (0..blocks as u32).collect();
    ids.shuffle(&mut rand::rng());
    let tables = seqs
        .iter()
        .map(|s| ids.split_off(ids.len() - s.1.div_ceil(BLOCK_SIZE)))
        .collect();
    let meta = AttentionMetadata::new(
        seqs.iter().map(|s| s.0).collect(),
        seqs.iter().map(|s| s.1).collect(),
        tables,
        BLOCK_SIZE,
        device,
    )
    .expect("metadata");
    let shape = [blocks, c.num_key_value_heads, BLOCK_SIZE, c.head_dim];
    let cache = if kv.is_fp8() {
        LayerKvCache::zeros(
            blocks,
            BLOCK_SIZE,
            c.num_key_value_heads,
            c.head_dim,
            dtype,
            kv,
            device,
        )
        .expect("FP8 cache")
    } else {
        LayerKvCache::new(
            Tensor::random(shape, Distribution::Normal(0.0, 1.0), (device, dtype)),
            Tensor::random(shape, Distribution::Normal(0.0, 1.0), (device, dtype)),
        )
    };
    let t: usize = seqs.iter().map(|s| s.0).sum();
    let q = Tensor::random(
        [t, c.num_attention_heads, c.head_dim],
        Distribution::Normal(0.0, 1.0),
        (device, dtype),
    );
    Setup { cache, meta, q }
}

/// Decode: batch × context; achieved bandwidth counts the keys and values read.
pub fn decode(
    model: &str,
    c: &Qwen2Config,
    batches: &[usize],
    contexts: &[usize],
    device: &Device,
    dtype: DType,
    kv: KvCacheDtype,
) -> Report {
    let mut report = Report::new(
        &format!("decode attention {model} {dtype:?} kv {}", kv.name()),
        &[
            "model", "batch", "context", "heads", "kv_heads", "head_dim", "ours_us", "kv_GBps",
            "rel_err",
        ],
    );
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    for &b in batches {
        for &ctx in contexts {
            let s = setup(c, &vec![(1, ctx); b], device, dtype, kv);
            let ours = || cubecl_kernels::paged_attention(s.q.clone(), &s.cache, &s.meta, scale);
            // The reference gathers per sequence: check the smaller configurations only.
            let err = if b * ctx <= 16 * 4096 && !kv.is_fp8() {
                rel_err(
                    ours(),
                    reference::paged_attention(s.q.clone(), &s.cache, &s.meta, scale),
                )
            } else {
                f64::NAN
            };
            let t = graph_us(device, 10, 10, ours);
            let bytes = 2 * b * ctx * c.kv_size() * kv.element_bytes(dtype);
            report.row(vec![
                json!(model),
                json!(b),
                json!(ctx),
                json!(c.num_attention_heads),
                json!(c.num_key_value_heads),
                json!(c.head_dim),
                json!(t),
                json!(bytes as f64 / t / 1e3),
                json!(err),
            ]);
        }
    }
    report
}

/// Prefill: `batch` sequences of `len` new tokens each after a cached `prefix` (shapes
/// `(batch, len, prefix)`); causal FLOPs.
pub fn prefill(
    model: &str,
    c: &Qwen2Config,
    shapes: &[(usize, usize, usize)],
    device: &Device,
    dtype: DType,
    kv: KvCacheDtype,
) -> Report {
    let mut report = Report::new(
        &format!("prefill attention {model} {dtype:?} kv {}", kv.name()),
        &[
            "model", "batch", "len", "prefix", "heads", "kv_heads", "head_dim", "ours_us",
            "TFLOPs", "rel_err",
        ],
    );
    let scale = 1.0 / (c.head_dim as f32).sqrt();
    for &(b, len, prefix) in shapes {
        let s = setup(c, &vec![(len, prefix + len); b], device, dtype, kv);
        let ours = || cubecl_kernels::paged_attention(s.q.clone(), &s.cache, &s.meta, scale);
        let err = if b * len <= 4096 && !kv.is_fp8() {
            rel_err(
                ours(),
                reference::paged_attention(s.q.clone(), &s.cache, &s.meta, scale),
            )
        } else {
            f64::NAN
        };
        // Four back-to-back calls in a device graph: no host or launch overhead (FA3's script
        // times back-to-back eager calls between events).
        let t = graph_us(device, 4, 10, ours);
        // QKᵀ and PV over the prefix and the causal triangle, 2 FLOPs per multiply-add.
        let keys = len * prefix + len * (len + 1) / 2;
        let flops = 4.0 * (b * c.num_attention_heads * c.head_dim) as f64 * keys as f64;
        report.row(vec![
            json!(model),
            json!(b),
            json!(len),
            json!(prefix),
            json!(c.num_attention_heads),
            json!(c.num_key_value_heads),
            json!(c.head_dim),
            json!(t),
            json!(flops / t / 1e6),
            json!(err),
        ]);
    }
    report
}
