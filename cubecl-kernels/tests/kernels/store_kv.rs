//! The KV write (plain, and fused with the Q/K norms and RoPE) against the plain-Burn
//! reference.

use burn::tensor::{DType, Device};
use cubecl_kernels::attention::reference;
use cubecl_kernels::{AttentionMetadata, QkNorm, ReductionOrder, Rope, RowScale};
use rand::Rng;
use rand::rngs::StdRng;

use super::attention::{Heads, Layout, cache};
use super::common::*;

/// The fused norm + RoPE + KV write, with skipped slots (−1), against split/norm/rope/store;
/// with a deferred row scale (with and without bias) against the scaled projection first.
#[test]
fn rope_store_kv_matches_reference() {
    let mut rng = rng("rope_store_kv_matches_reference");
    // (heads, qk_norm, row scale: None or Some(bias), dtype)
    for (h, qk_norm, row_scale, dtype) in [
        (
            Heads {
                heads: 14,
                kv_heads: 2,
                d: 64,
            },
            false,
            None,
            DType::F32,
        ),
        (
            Heads {
                heads: 14,
                kv_heads: 2,
                d: 64,
            },
            false,
            Some(true),
            DType::F32,
        ),
        (
            Heads {
                heads: 4,
                kv_heads: 2,
                d: 32,
            },
            true,
            None,
            DType::F32,
        ),
        (
            Heads {
                heads: 4,
                kv_heads: 2,
                d: 32,
            },
            true,
            Some(false),
            DType::F32,
        ),
        (
            Heads {
                heads: 8,
                kv_heads: 4,
                d: 128,
            },
            true,
            None,
            DType::BF16,
        ),
        (
            Heads {
                heads: 8,
                kv_heads: 4,
                d: 128,
            },
            false,
            Some(true),
            DType::BF16,
        ),
        (
            Heads {
                heads: 14,
                kv_heads: 2,
                d: 64,
            },
            false,
            Some(true),
            DType::BF16,
        ),
    ] {
        // The row-scale input: K = 72 (vectors of 4 or 8); 896 as in Qwen2-0.5B.
        let kx = if dtype == DType::BF16 { 896 } else { 72 };
        check_rope_store_kv(&mut rng, &h, qk_norm, row_scale, dtype, kx);
    }
}

/// `rope_store_kv` of a three-sequence batch (one token skipped) against the reference:
/// queries, both caches, and no write outside the new tokens' slots. `kx`: the row-scale
/// input's width.
pub(super) fn check_rope_store_kv(
    rng: &mut StdRng,
    h: &Heads,
    qk_norm: bool,
    row_scale: Option<bool>,
    dtype: DType,
    kx: usize,
) {
    let l = Layout::new(rng, &[(5, 9), (1, 17), (3, 3)], 16);
    let what = format!(
        "heads={}/{} d={} qk_norm={qk_norm} row_scale={row_scale:?} {dtype:?}",
        h.heads, h.kv_heads, h.d
    );
    let t = l.tokens();
    let width = (h.heads + 2 * h.kv_heads) * h.d;
    let qkv = random(rng, t * width, 2.0, dtype);
    // The row-scale input (`kx` wide), rows scaled by powers of two (exact) so that each row
    // has its own scale, and the projection's bias.
    let xs = row_scaled(random(rng, t * kx, 3.0, dtype), kx);
    let bias = random(rng, width, 0.5, dtype);
    let cache_len = l.num_blocks * l.block_size * h.kv_heads * h.d;
    let kv = (
        random(rng, cache_len, 1.0, dtype),
        random(rng, cache_len, 1.0, dtype),
    );
    let norms: Vec<Vec<f32>> = (0..2)
        .map(|_| {
            random(rng, h.d, 0.5, dtype)
                .iter()
                .map(|v| v + 1.0)
                .collect()
        })
        .collect();
    let max_pos = 64;
    let angles: Vec<f32> = (0..max_pos * h.d / 2)
        .map(|i| (i / (h.d / 2)) as f32 * rng.random::<f32>())
        .collect();
    let skip = rng.random_range(0..t);
    let run = |device: &Device, dtype: DType, kernel: bool| {
        let mut cache = cache(&kv, &l, h, dtype, device);
        let mut meta = l.meta(device, ReductionOrder::Fastest);
        if !kernel {
            meta.slot_mapping[skip] = -1;
        } else {
            meta = with_skipped_slot(meta, skip, device);
        }
        // Pitched tables and row-scale input on every device, as on CUDA.
        let cos = strided(
            &angles.iter().map(|a| a.cos()).collect::<Vec<_>>(),
            [max_pos, h.d / 2],
            DType::F32,
            device,
        );
        let sin = strided(
            &angles.iter().map(|a| a.sin()).collect::<Vec<_>>(),
            [max_pos, h.d / 2],
            DType::F32,
            device,
        );
        let (qn, kn) = (
            tensor(&norms[0], [h.d], dtype, device),
            tensor(&norms[1], [h.d], dtype, device),
        );
        let norm = qk_norm.then_some(QkNorm {
            q: &qn,
            k: &kn,
            eps: 1e-6,
        });
        let qkv = tensor(&qkv, [t, width], dtype, device);
        let rope = Rope {
            cos: &cos,
            sin: &sin,
        };
        let (x, b) = (
            tensor(&xs, [t, kx], dtype, device),
            tensor(&bias, [width], dtype, device),
        );
        let scale = row_scale.map(|with_bias| RowScale {
            input: &x,
            bias: with_bias.then_some(&b),
            eps: 1e-6,
        });
        let q = if kernel {
            cubecl_kernels::rope_store_kv(qkv, h.heads, scale, norm, rope, &meta, &mut cache)
        } else {
            let qkv = match scale {
                Some(s) => s.apply(qkv),
                None => qkv,
            };
            reference::rope_store_kv(qkv, h.heads, norm, rope, &meta, &mut cache)
        };
        (host(q), host(cache.k), host(cache.v))
    };
    let (q, k, v) = run(&kernel_device(), dtype, true);
    let (q_ref, k_ref, v_ref) = run(&reference_device(), DType::F32, false);
    assert_rel(&format!("{what}: q"), &q, &q_ref, tolerance(dtype));
    assert_rel(&format!("{what}: k cache"), &k, &k_ref, tolerance(dtype));
    assert_rel(&format!("{what}: v cache"), &v, &v_ref, tolerance(dtype));
    // Untouched slots keep their old content exactly, the skipped token's slot included.
    let untouched = |c: &[f32], old: &[f32]| c.iter().zip(old).filter(|(a, b)| a == b).count();
    assert!(
        untouched(&k, &kv.0) >= cache_len - (t - 1) * h.kv_heads * h.d,
        "{what}: writes outside the slots"
    );
}

/// `values` `[rows, cols]` as a view with a row pitch of the next power of two above `cols`
/// elements (as CUDA pitches 2-D tensors, on every device), the padding NaN.
fn strided(
    values: &[f32],
    [rows, cols]: [usize; 2],
    dtype: DType,
    device: &Device,
) -> burn::tensor::Tensor<2> {
    let pitch = (cols + 1).next_power_of_two();
    let mut padded = vec![f32::NAN; rows * pitch];
    for r in 0..rows {
        padded[r * pitch..r * pitch + cols].copy_from_slice(&values[r * cols..(r + 1) * cols]);
    }
    tensor(&padded, [rows, pitch], dtype, device).slice([0..rows, 0..cols])
}

/// Metadata whose token `skip` has slot −1 on the device too.
fn with_skipped_slot(
    mut meta: AttentionMetadata,
    skip: usize,
    device: &Device,
) -> AttentionMetadata {
    meta.slot_mapping[skip] = -1;
    let slots: Vec<i32> = meta.slot_mapping.iter().map(|&s| s as i32).collect();
    let n = slots.len();
    meta.tensors.slot_mapping = burn::tensor::Tensor::from_data(
        burn::tensor::TensorData::new(slots, [n]),
        (device, DType::I32),
    );
    meta
}

#[test]
fn plain_store_kv_matches_reference() {
    let mut rng = rng("plain_store_kv_matches_reference");
    let h = Heads {
        heads: 0,
        kv_heads: 2,
        d: 64,
    };
    let l = Layout::new(&mut rng, &[(4, 20), (2, 2)], 16);
    let t = l.tokens();
    let cache_len = l.num_blocks * l.block_size * h.kv_heads * h.d;
    let kv = (
        random(&mut rng, cache_len, 1.0, DType::F32),
        random(&mut rng, cache_len, 1.0, DType::F32),
    );
    let (k_new, v_new) = (
        random(&mut rng, t * 128, 1.0, DType::F32),
        random(&mut rng, t * 128, 1.0, DType::F32),
    );
    let run = |device: &Device, kernel: bool| {
        let mut cache = cache(&kv, &l, &h, DType::F32, device);
        let meta = l.meta(device, ReductionOrder::Fastest);
        let k = tensor(&k_new, [t, 2, 64], DType::F32, device);
        let v = tensor(&v_new, [t, 2, 64], DType::F32, device);
        if kernel {
            cubecl_kernels::store_kv(&mut cache, k, v, &meta);
        } else {
            reference::store_kv(&mut cache, k, v, &meta);
        }
        (host(cache.k), host(cache.v))
    };
    let (k, v) = run(&kernel_device(), true);
    let (k_ref, v_ref) = run(&reference_device(), false);
    assert_eq!(k, k_ref, "k cache");
    assert_eq!(v, v_ref, "v cache");
    let _ = h.heads;
}

/// RoPE tables must be f32 (the kernel reads them as such): anything else is refused by name,
/// like a row scale whose input has the wrong number of rows or the wrong dtype.
#[test]
fn rope_store_kv_refuses_bad_tables_and_row_scales() {
    let mut rng = rng("rope_store_kv_refuses_bad_tables_and_row_scales");
    let dev = kernel_device();
    let h = Heads {
        heads: 2,
        kv_heads: 1,
        d: 8,
    };
    let l = Layout::new(&mut rng, &[(2, 2)], 16);
    let n = l.num_blocks * l.block_size * h.d;
    let attempt = |table_dtype: DType, scale_rows: usize, scale_dtype: DType| {
        let mut cache = cache(&(vec![0.0; n], vec![0.0; n]), &l, &h, DType::F32, &dev);
        let meta = l.meta(&dev, ReductionOrder::Fastest);
        let table = tensor(&[0.5; 16 * 4], [16, 4], table_dtype, &dev);
        let qkv = tensor(&[1.0; 2 * 32], [2, 32], DType::F32, &dev);
        let x = tensor(
            &vec![1.0; scale_rows * 8],
            [scale_rows, 8],
            scale_dtype,
            &dev,
        );
        let scale = RowScale {
            input: &x,
            bias: None,
            eps: 1e-6,
        };
        let rope = Rope {
            cos: &table,
            sin: &table,
        };
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            cubecl_kernels::rope_store_kv(qkv, h.heads, Some(scale), None, rope, &meta, &mut cache)
        }))
        .map(|q| q.dims())
        .map_err(|e| e.downcast_ref::<String>().cloned().unwrap_or_default())
    };
    assert_eq!(attempt(DType::F32, 2, DType::F32), Ok([2, 2, 8]));
    let err = attempt(DType::BF16, 2, DType::F32).unwrap_err();
    assert!(err.contains("RoPE table cos has dtype BF16"), "{err}");
    let err = attempt(DType::F32, 3, DType::F32).unwrap_err();
    assert!(
        err.contains("row_scale input has 3 rows, the product 2"),
        "{err}"
    );
    let err = attempt(DType::F32, 2, DType::BF16).unwrap_err();
    assert!(
        err.contains("row_scale input has dtype BF16, the product F32"),
        "{err}"
    );
}
