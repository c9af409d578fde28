//! The fused RMSNorm + linear op and the plain linear op at Qwen2 shapes, against Burn's own
//! rms_norm + matmul and matmul alone; `scripts/baselines/torch_linear.py` times cuBLAS
//! (`F.linear`) on the same shapes, graph against graph, and `compare_linear.py` joins both.

use burn::tensor::{DType, Device, Distribution, Tensor};
use cubecl_kernels::rms_norm_linear::reference;
use model_qwen2::Qwen2Config;
use serde_json::json;

use crate::report::Report;
use crate::timing::graph_us;

/// One weight matrix of a model: `W [n, k]`, preceded by an RMSNorm when `fused`.
struct Shape {
    name: &'static str,
    k: usize,
    n: usize,
    fused: bool,
    bias: bool,
}

fn shapes(c: &Qwen2Config) -> Vec<Shape> {
    let qkv = c.q_size() + 2 * c.kv_size();
    vec![
        Shape {
            name: "qkv",
            k: c.hidden_size,
            n: qkv,
            fused: true,
            bias: c.attention_bias,
        },
        Shape {
            name: "gate_up",
            k: c.hidden_size,
            n: 2 * c.intermediate_size,
            fused: true,
            bias: false,
        },
        Shape {
            name: "o_proj",
            k: c.q_size(),
            n: c.hidden_size,
            fused: false,
            bias: false,
        },
        Shape {
            name: "down",
            k: c.intermediate_size,
            n: c.hidden_size,
            fused: false,
            bias: false,
        },
        Shape {
            name: "lm_head",
            k: c.hidden_size,
            n: c.vocab_size,
            fused: true,
            bias: false,
        },
    ]
}

/// Times every product of `config` at every `m` (the LM head fused with the final norm, as the
/// model runs it). With `baselines`, also Burn's own ops, and the fused op is checked against
/// the reference (relative error in the table; NaN without).
pub fn run(
    model: &str,
    config: &Qwen2Config,
    ms: &[usize],
    baselines: bool,
    device: &Device,
    dtype: DType,
) -> Report {
    let mut report = Report::new(
        &format!("linear {model} {dtype:?}"),
        &[
            "model",
            "op",
            "dtype",
            "route",
            "M",
            "K",
            "N",
            "ours_us",
            "burn_unfused_us",
            "burn_matmul_us",
            "ours_GBps",
            "ours_TFLOPs",
            "speedup_vs_unfused",
            "rel_err",
        ],
    );
    let normal = |shape: [usize; 2], std: f64| {
        Tensor::<2>::random(shape, Distribution::Normal(0.0, std), (device, dtype))
    };
    for s in shapes(config) {
        let w = normal([s.n, s.k], 1.0 / (s.k as f64).sqrt());
        let g = Tensor::<1>::random([s.k], Distribution::Uniform(0.5, 1.5), (device, dtype));
        let b = s
            .bias
            .then(|| Tensor::<1>::random([s.n], Distribution::Normal(0.0, 0.1), (device, dtype)));
        for &m in ms {
            let x = normal([m, s.k], 1.0);
            let ours = || {
                if s.fused {
                    cubecl_kernels::rms_norm_linear(
                        x.clone(),
                        g.clone(),
                        w.clone(),
                        b.clone(),
                        1e-6,
                    )
                } else {
                    cubecl_kernels::linear(x.clone(), w.clone(), b.clone())
                }
            };
            let unfused = || {
                if s.fused {
                    reference::rms_norm_linear(x.clone(), g.clone(), w.clone(), b.clone(), 1e-6)
                } else {
                    reference::linear(x.clone(), w.clone(), b.clone())
                }
            };
            let matmul = || x.clone().matmul(w.clone().transpose());
            let err = if baselines {
                rel_err(ours(), unfused())
            } else {
                f64::NAN
            };
            let route = cubecl_kernels::linear_route(&x, s.n)
                .map_or_else(|| "reference".to_string(), |r| format!("{r:?}"));
            let calls = ((1usize << 30) / (m * s.n * dtype.size())).clamp(1, 10);
            let reps = if m * s.k * s.n > 1 << 32 { 5 } else { 15 };
            let t_ours = graph_us(device, calls, reps, ours);
            let (t_unfused, t_matmul) = if baselines {
                (
                    graph_us(device, calls, reps, unfused),
                    graph_us(device, calls, reps, matmul),
                )
            } else {
                (f64::NAN, f64::NAN)
            };
            let bytes = (m * s.k + s.n * s.k + m * s.n) * dtype.size();
            let flops = 2.0 * (m * s.k * s.n) as f64;
            report.row(vec![
                json!(model),
                json!(s.name),
                json!(format!("{dtype:?}").to_lowercase()),
                json!(route),
                json!(m),
                json!(s.k),
                json!(s.n),
                json!(t_ours),
                json!(t_unfused),
                json!(t_matmul),
                json!(bytes as f64 / t_ours / 1e3),
                json!(flops / t_ours / 1e6),
                json!(t_unfused / t_ours),
                json!(err),
            ]);
        }
    }
    report
}

/// `‖a − b‖ / ‖b‖` on the host, in f64.
pub fn rel_err<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> f64 {
    let a = a.into_data().try_into_vec_as::<f32>().expect("f32 data");
    let b = b.into_data().try_into_vec_as::<f32>().expect("f32 data");
    let num: f64 = a
        .iter()
        .zip(&b)
        .map(|(x, y)| ((x - y) as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    if a.iter().any(|v| !v.is_finite()) {
        f64::NAN
    } else {
        (num / den.max(1e-30)).sqrt()
    }
}
