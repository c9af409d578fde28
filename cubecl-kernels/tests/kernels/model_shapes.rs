//! Every op of a decoder layer at every config shape of the shape sweep
//! (`fixtures/shape-sweep.json`: head dims 16–256, MHA/GQA/MQA, hidden sizes off multiples of
//! 32 and 64, odd and prime vocabularies) against its reference, so that a wrong or
//! out-of-bounds kernel at an unusual shape is named by its op: the products of the layer (qkv
//! with Qwen2's bias, o_proj and down with the residual, gate/up, the final norm + LM head) at a
//! decode-sized and a prefill-sized M, the gated activation with the deferred norm, the KV write
//! (RoPE, Qwen3's q/k norm, the deferred row scale), and prefill and decode attention. f32 on
//! every device; bf16 too on GPUs.

use burn::tensor::DType;

use super::attention::{Heads, check_attention};
use super::common::*;
use super::linear::{Case, check};
use super::store_kv::check_rope_store_kv;

/// One config of the sweep (fields the kernels need; the file has more).
#[derive(serde::Deserialize)]
struct Shape {
    qwen3: bool,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    intermediate: usize,
    vocab: usize,
}

#[derive(serde::Deserialize)]
struct Sweep {
    shapes: Vec<Shape>,
}

fn shapes() -> Vec<Shape> {
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/shape-sweep.json");
    let text = std::fs::read_to_string(path).unwrap();
    serde_json::from_str::<Sweep>(&text).unwrap().shapes
}

#[test]
fn layer_ops_match_reference_at_every_config_shape() {
    let mut rng = rng("layer_ops_match_reference_at_every_config_shape");
    let on_gpu = std::env::var("KERNEL_TEST_DEVICE").is_ok_and(|d| d.starts_with("cuda"));
    // Every op in both dtypes on GPUs; on the CPU runtime bf16 for attention only (its decode
    // kernels split rows of D / 8 vectors, f32's D / 4, over a cube of two units: D = 40 in bf16
    // is a row that does not divide the cube), the rest in f32 for time.
    let dtypes = [DType::F32, DType::BF16];
    for s in shapes() {
        let (h, d, i) = (s.hidden, s.head_dim, s.intermediate);
        let (q, qkv) = (s.heads * d, (s.heads + 2 * s.kv_heads) * d);
        for dtype in dtypes {
            eprintln!(
                "== H={h} heads={}/{} D={d} I={i} V={} qwen3={} {dtype:?}",
                s.heads, s.kv_heads, s.vocab, s.qwen3
            );
            let heads = || Heads {
                heads: s.heads,
                kv_heads: s.kv_heads,
                d,
            };
            // Decodes over short and long contexts, a prompt, a chunk over a cached prefix.
            check_attention(&mut rng, &[(1, 40), (1, 300)], 16, heads(), dtype);
            check_attention(&mut rng, &[(37, 37), (20, 90)], 16, heads(), dtype);
            if !on_gpu && dtype != DType::F32 {
                continue;
            }
            for m in [3, 70] {
                check("linear", &Case::new(&mut rng, (m, h, qkv), dtype), !s.qwen3);
                check("linear_add", &Case::new(&mut rng, (m, q, h), dtype), false);
                check("linear", &Case::new(&mut rng, (m, h, 2 * i), dtype), false);
                check("linear_add", &Case::new(&mut rng, (m, i, h), dtype), false);
                check(
                    "rms_norm_linear",
                    &Case::new(&mut rng, (m, h, s.vocab), dtype),
                    false,
                );
            }
            super::linear::check_silu_mul(&mut rng, 70, i, h, Some(false), dtype);
            check_rope_store_kv(&mut rng, &heads(), s.qwen3, Some(!s.qwen3), dtype, h);
        }
    }
}
