//! `ReductionOrder::BatchInvariant`: a row's result, bit for bit, alone and inside larger
//! batches (the products at M = 1 … 64, with the control that the fastest order does change it,
//! else the comparison would prove nothing; decode attention alone and among 40 sequences,
//! where the fastest order splits a lone context into more pieces on a device with enough
//! multiprocessors to fill, CUDA's, and the invariant one cuts it by its length alone).

use burn::tensor::DType;
use cubecl_kernels::{AttentionMetadata, LayerKvCache, ReductionOrder};
use rand::seq::SliceRandom;

use super::common::*;

/// Row 0 of `x [m, k] · W [n, k]ᵀ + b` for each `m` of `rows` (x's first `m` rows).
fn first_rows(order: ReductionOrder, dtype: DType, rows: &[usize]) -> Vec<Vec<f32>> {
    let mut rng = rng("batch_invariance_linear");
    let (k, n, most) = (96, 80, 64);
    let device = kernel_device();
    let x = random(&mut rng, most * k, 1.0, dtype);
    let w = random(&mut rng, n * k, 0.1, dtype);
    let b = random(&mut rng, n, 0.1, dtype);
    rows.iter()
        .map(|&m| {
            let x = tensor(&x[..m * k], [m, k], dtype, &device);
            let w = tensor(&w, [n, k], dtype, &device);
            let b = tensor(&b, [n], dtype, &device);
            let y = cubecl_kernels::linear_ordered(x, w, Some(b), order);
            host(y)[..n].to_vec()
        })
        .collect()
}

#[test]
fn batch_invariant_products_give_a_row_the_same_bits_at_every_batch_size() {
    let rows = [1, 2, 7, 8, 9, 33, 64];
    for dtype in [DType::F32, DType::BF16] {
        let fixed = first_rows(ReductionOrder::BatchInvariant, dtype, &rows);
        for (m, row) in rows.iter().zip(&fixed) {
            assert_eq!(row, &fixed[0], "{dtype:?}: row 0 at M = {m} against M = 1");
        }
    }
    // The control: the skinny kernel (small M) and the tiled one (larger M) sum in other orders.
    let fastest = first_rows(ReductionOrder::Fastest, DType::F32, &rows);
    assert!(
        fastest.iter().any(|row| row != &fastest[0]),
        "the fastest routes change some row's bits with M"
    );
}

/// Decode attention of sequence 0 (context 1,000), alone and as row 0 of 40 sequences: its
/// output row in both launches.
fn decode_alone_and_in_batch(order: ReductionOrder, dtype: DType) -> (Vec<f32>, Vec<f32>) {
    let mut rng = rng("batch_invariance_decode");
    let (heads, kv_heads, d, bs) = (8, 2, 64, 16);
    let device = kernel_device();
    let contexts: Vec<usize> = (0..40)
        .map(|i| if i == 0 { 1000 } else { 50 + i * 7 })
        .collect();
    let need: usize = contexts.iter().map(|c| c.div_ceil(bs)).sum();
    let mut free: Vec<u32> = (0..need as u32).collect();
    free.shuffle(&mut rng);
    let tables: Vec<Vec<u32>> = contexts
        .iter()
        .map(|c| free.split_off(free.len() - c.div_ceil(bs)))
        .collect();
    let shape = [need, kv_heads, bs, d];
    let len = need * kv_heads * bs * d;
    let (k, v) = (
        random(&mut rng, len, 1.0, dtype),
        random(&mut rng, len, 1.0, dtype),
    );
    let q = random(&mut rng, contexts.len() * heads * d, 1.0, dtype);
    let cache = LayerKvCache::new(
        tensor(&k, shape, dtype, &device),
        tensor(&v, shape, dtype, &device),
    );
    let scale = 1.0 / (d as f32).sqrt();
    let run = |seqs: usize| {
        let meta = AttentionMetadata::decode(
            contexts[..seqs].to_vec(),
            tables[..seqs].to_vec(),
            bs,
            &device,
        )
        .unwrap();
        let q = tensor(&q[..seqs * heads * d], [seqs, heads, d], dtype, &device);
        let out = cubecl_kernels::paged_attention_ordered(q, &cache, &meta, scale, order);
        host(out)[..heads * d].to_vec()
    };
    (run(1), run(contexts.len()))
}

#[test]
fn batch_invariant_decode_gives_a_row_the_same_bits_in_any_batch() {
    for dtype in [DType::F32, DType::BF16] {
        let (alone, in_batch) = decode_alone_and_in_batch(ReductionOrder::BatchInvariant, dtype);
        assert_eq!(alone, in_batch, "{dtype:?}: sequence 0 alone and among 40");
    }
}
