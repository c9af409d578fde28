//! FP8 KV caches: the KV write's rounding against the host's E4M3/E5M2 conversion (exact), and
//! paged attention over an FP8 cache against the reference over the same values dequantised
//! on the host.

use burn::tensor::{DType, Tensor, TensorData};
use cubecl_kernels::attention::reference;
use cubecl_kernels::{FP8_CARRIER, KvCacheDtype, KvQuant, LayerKvCache, ReductionOrder};
use rand::Rng;
use rand::rngs::StdRng;

use super::attention::{Heads, Layout};
use super::common::*;

const FORMATS: [KvCacheDtype; 2] = [KvCacheDtype::Fp8E4M3, KvCacheDtype::Fp8E5M2];

/// Element `j` of kv head `h` at cache slot `slot`, in the head-major layout.
fn at(slot: usize, h: usize, j: usize, kv_heads: usize, block_size: usize, d: usize) -> usize {
    (((slot / block_size) * kv_heads + h) * block_size + slot % block_size) * d + j
}

/// The bytes an FP8 cache tensor carries.
fn bytes(t: &Tensor<4>) -> Vec<u8> {
    t.clone().into_data().as_bytes().to_vec()
}

/// The KV write into an FP8 cache stores round(x / scale) of each value, saturating, for the
/// written slots only (the rest stay zero); the scales differ per kv head and some values lie
/// past the format's range.
#[test]
fn fp8_kv_write_rounds_like_the_host() {
    let mut rng = rng("fp8_kv_write_rounds_like_the_host");
    let device = kernel_device();
    let (kv_heads, d, bs) = (2, 64, 16);
    let seqs = [(5, 5), (3, 20), (1, 33)];
    for kv_dtype in FORMATS {
        for dtype in [DType::F32, DType::BF16] {
            let l = Layout::new(&mut rng, &seqs, bs);
            let what = format!("{kv_dtype:?} {dtype:?}");
            let t = l.tokens();
            // Head 0's key scale makes values of 8 reach 800 (past E4M3's 448).
            let (ks, vs) = ([0.01f32, 0.5], [0.02f32, 1.5]);
            let k = random(&mut rng, t * kv_heads * d, 8.0, dtype);
            let v = random(&mut rng, t * kv_heads * d, 8.0, dtype);
            let mut cache =
                LayerKvCache::zeros(l.num_blocks, bs, kv_heads, d, dtype, kv_dtype, &device)
                    .unwrap();
            assert_eq!(cache.dims(), [l.num_blocks, kv_heads, bs, d], "{what}");
            assert_eq!(cache.k.dtype(), FP8_CARRIER, "{what}");
            cache.set_scales(&ks, &vs).unwrap();
            let meta = l.meta(&device, ReductionOrder::Fastest);
            cubecl_kernels::store_kv(
                &mut cache,
                tensor(&k, [t, kv_heads, d], dtype, &device),
                tensor(&v, [t, kv_heads, d], dtype, &device),
                &meta,
            );
            for (values, stored, scales) in [(&k, bytes(&cache.k), ks), (&v, bytes(&cache.v), vs)] {
                let mut expected = vec![0.0f32; stored.len()];
                for (tok, &slot) in meta.slot_mapping.iter().enumerate() {
                    for h in 0..kv_heads {
                        for j in 0..d {
                            let x = values[(tok * kv_heads + h) * d + j];
                            expected[at(slot as usize, h, j, kv_heads, bs, d)] =
                                kv_dtype.round(x / scales[h]);
                        }
                    }
                }
                let got: Vec<f32> = stored.iter().map(|&b| kv_dtype.decode(b)).collect();
                let bad = got.iter().zip(&expected).position(|(a, b)| a != b);
                assert!(
                    bad.is_none(),
                    "{what}: element {} stored {} where the host rounds to {}",
                    bad.unwrap(),
                    got[bad.unwrap()],
                    expected[bad.unwrap()]
                );
            }
        }
    }
}

/// Attention over an FP8 cache of random values (power-of-two scales, so that the values
/// dequantised in bf16 are exact) against the reference over the same values in f32: decode
/// rows and prefill chunks over cached prefixes, narrow and wide query groups, both head
/// sizes, both formats.
#[test]
fn fp8_attention_matches_dequantised_reference() {
    let mut rng = rng("fp8_attention_matches_dequantised_reference");
    let seqs = [(1, 1), (1, 40), (1, 300), (17, 40), (64, 64), (5, 200)];
    let shapes = [
        Heads {
            heads: 14,
            kv_heads: 2,
            d: 64,
        },
        Heads {
            heads: 4,
            kv_heads: 2,
            d: 128,
        },
        Heads {
            heads: 8,
            kv_heads: 1,
            d: 128,
        },
    ];
    for kv_dtype in FORMATS {
        for h in &shapes {
            for dtype in [DType::F32, DType::BF16] {
                for order in [ReductionOrder::Fastest, ReductionOrder::BatchInvariant] {
                    check(&mut rng, &seqs, h, dtype, kv_dtype, order);
                }
            }
        }
    }
}

fn check(
    rng: &mut StdRng,
    seqs: &[(usize, usize)],
    h: &Heads,
    dtype: DType,
    kv_dtype: KvCacheDtype,
    order: ReductionOrder,
) {
    let bs = 16;
    let l = Layout::new(rng, seqs, bs);
    let what = format!(
        "{kv_dtype:?} heads={}/{} d={} {dtype:?} {order:?}",
        h.heads, h.kv_heads, h.d
    );
    eprintln!("{what}");
    let shape = [l.num_blocks, h.kv_heads, bs, h.d];
    let n: usize = shape.iter().product();
    let per_head = bs * h.d;
    // Scales 2^-3 .. 2^2 by kv head, keys and values apart.
    let scale = |i: usize| (2.0f32).powi((i % 6) as i32 - 3);
    let (k_scales, v_scales): (Vec<f32>, Vec<f32>) =
        (0..h.kv_heads).map(|i| (scale(i), scale(i + 3))).unzip();
    // Random stored values (their bytes) and what they mean.
    let mut make = |scales: &[f32]| {
        let mut bits = Vec::with_capacity(n);
        let mut values = Vec::with_capacity(n);
        for e in 0..n {
            let s = scales[(e / per_head) % h.kv_heads];
            let x: f32 = (rng.random::<f32>() * 2.0 - 1.0) * 4.0;
            let b = match kv_dtype {
                KvCacheDtype::Fp8E5M2 => cubecl::e5m2::from_f32(x / s).to_bits(),
                _ => cubecl::e4m3::from_f32(x / s).to_bits(),
            };
            bits.push(b);
            values.push(kv_dtype.decode(b) * s);
        }
        (bits, values)
    };
    let (k_bits, k_values) = make(&k_scales);
    let (v_bits, v_values) = make(&v_scales);
    let q = random(rng, l.tokens() * h.heads * h.d, 1.0, dtype);
    let softmax_scale = 1.0 / (h.d as f32).sqrt();
    let device = kernel_device();
    let carrier = |bits: &[u8]| {
        let mut carried = shape;
        carried[3] /= 2;
        Tensor::<4>::from_data(
            TensorData::from_bytes_vec(bits.to_vec(), carried, FP8_CARRIER),
            (&device, FP8_CARRIER),
        )
    };
    let scales: Vec<f32> = k_scales.iter().chain(&v_scales).copied().collect();
    let cache = LayerKvCache {
        k: carrier(&k_bits),
        v: carrier(&v_bits),
        quant: Some(KvQuant {
            dtype: kv_dtype,
            scales: tensor(&scales, [2 * h.kv_heads], DType::F32, &device),
        }),
    };
    let meta = l.meta(&device, order);
    let out = cubecl_kernels::paged_attention_ordered(
        tensor(&q, [l.tokens(), h.heads, h.d], dtype, &device),
        &cache,
        &meta,
        softmax_scale,
        order,
    );
    let r = reference_device();
    let expected = reference::paged_attention(
        tensor(&q, [l.tokens(), h.heads, h.d], DType::F32, &r),
        &LayerKvCache::new(
            tensor(&k_values, shape, DType::F32, &r),
            tensor(&v_values, shape, DType::F32, &r),
        ),
        &l.meta(&r, order),
        softmax_scale,
    );
    assert_rel(&what, &host(out), &host(expected), tolerance(dtype));
}
