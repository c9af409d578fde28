//! Every product of a Qwen2 block at the model's shapes, in the forms the ops offer, against
//! Burn's own ops (with FP8 weights, `--quantization fp8`, each form's FP8 product too: route
//! `Fp8`, its error against the unquantised reference); `scripts/baselines/torch_linear.py` times cuBLAS (`F.linear`) and PyTorch's
//! composition of the same result on the same shapes, graph against graph, and
//! `compare_linear.py` joins both.

use burn::tensor::{DType, Device, Distribution, Tensor};
use cubecl_kernels::rms_norm_linear::reference;
use cubecl_kernels::{Fp8Rows, Fp8Scaling, RowScale, fold_norm_gain};
use model_qwen2::Qwen2Config;
use serde_json::json;

use crate::report::Report;
use crate::timing::graph_us;

const EPS: f64 = 1e-6;

/// How a product is computed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Form {
    /// The standalone fused op `rms_norm_linear(x, g, W, b)`.
    Norm,
    /// `linear(x, W)`.
    Plain,
    /// `linear_add(x, W, residual)`: the residual connection in the product (the model's o_proj
    /// and down).
    Residual,
    /// The model's gate/up: the norm's gain folded into `W`, `linear(x, W·diag g)`, then
    /// `silu_mul` completing the deferred row scale → `[M, N / 2]`.
    Activated,
}

/// One weight matrix of a model, `W [n, k]`, in one form.
struct Shape {
    name: &'static str,
    k: usize,
    n: usize,
    form: Form,
    bias: bool,
}

fn shapes(c: &Qwen2Config) -> Vec<Shape> {
    let qkv = c.q_size() + 2 * c.kv_size();
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let shape = |name, k, n, form, bias| Shape {
        name,
        k,
        n,
        form,
        bias,
    };
    vec![
        shape("qkv", h, qkv, Form::Norm, c.attention_bias),
        shape("gate_up", h, 2 * i, Form::Norm, false),
        shape("o_proj", c.q_size(), h, Form::Plain, false),
        shape("down", i, h, Form::Plain, false),
        shape("lm_head", h, c.vocab_size, Form::Norm, false),
        shape("o_proj+residual", c.q_size(), h, Form::Residual, false),
        shape("down+residual", i, h, Form::Residual, false),
        shape("gate_up+silu_mul", h, 2 * i, Form::Activated, false),
    ]
}

/// Times every product of `config` at every `m`. With `baselines`, also Burn's own ops for the
/// same result, and ours is checked against the plain-Burn reference (relative error in the
/// table; NaN without).
pub fn run(
    model: &str,
    config: &Qwen2Config,
    ms: &[usize],
    baselines: bool,
    fp8: bool,
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
    // As the engine's warm-up does for its step graphs' shapes: cuBLASLt's candidates timed.
    cubecl_kernels::set_linear_tuning(true);
    let normal = |shape: [usize; 2], std: f64| {
        Tensor::<2>::random(shape, Distribution::Normal(0.0, std), (device, dtype))
    };
    for s in shapes(config) {
        let w = normal([s.n, s.k], 1.0 / (s.k as f64).sqrt());
        let g = Tensor::<1>::random([s.k], Distribution::Uniform(0.5, 1.5), (device, dtype));
        let folded = fold_norm_gain(w.clone(), g.clone());
        let b = s
            .bias
            .then(|| Tensor::<1>::random([s.n], Distribution::Normal(0.0, 0.1), (device, dtype)));
        // The model's FP8 products multiply the folded weight (the norm deferred).
        let quantized = fp8.then(|| {
            let w = match s.form {
                Form::Norm | Form::Activated => folded.clone(),
                Form::Plain | Form::Residual => w.clone(),
            };
            Fp8Rows::quantize(w, Fp8Scaling::for_weights()).expect("FP8 weights on this device")
        });
        for &m in ms {
            let x = normal([m, s.k], 1.0);
            let residual = normal([m, s.n], 1.0);
            let ours = || match s.form {
                Form::Norm => {
                    cubecl_kernels::rms_norm_linear(x.clone(), g.clone(), w.clone(), b.clone(), EPS)
                }
                Form::Plain => cubecl_kernels::linear(x.clone(), w.clone(), b.clone()),
                Form::Residual => {
                    cubecl_kernels::linear_add(x.clone(), w.clone(), b.clone(), residual.clone())
                }
                Form::Activated => {
                    let row_scale = RowScale {
                        input: &x,
                        bias: None,
                        eps: EPS,
                    };
                    let z = cubecl_kernels::linear(x.clone(), folded.clone(), None);
                    cubecl_kernels::silu_mul(z, Some(row_scale))
                }
            };
            let unfused = || match s.form {
                Form::Norm => {
                    reference::rms_norm_linear(x.clone(), g.clone(), w.clone(), b.clone(), EPS)
                }
                Form::Plain => reference::linear(x.clone(), w.clone(), b.clone()),
                Form::Residual => {
                    reference::linear(x.clone(), w.clone(), b.clone()) + residual.clone()
                }
                Form::Activated => cubecl_kernels::silu_mul::reference(
                    reference::rms_norm_linear(x.clone(), g.clone(), w.clone(), None, EPS),
                    None,
                ),
            };
            let matmul = || x.clone().matmul(w.clone().transpose());
            let fp8_product = |wq: &Fp8Rows| {
                let order = cubecl_kernels::ReductionOrder::Fastest;
                let row_scale = RowScale {
                    input: &x,
                    bias: b.as_ref(),
                    eps: EPS,
                };
                match s.form {
                    Form::Norm => row_scale.apply(cubecl_kernels::fp8_linear(
                        x.clone(),
                        wq,
                        None,
                        None,
                        order,
                    )),
                    Form::Plain => {
                        cubecl_kernels::fp8_linear(x.clone(), wq, b.clone(), None, order)
                    }
                    Form::Residual => cubecl_kernels::fp8_linear(
                        x.clone(),
                        wq,
                        b.clone(),
                        Some(residual.clone()),
                        order,
                    ),
                    Form::Activated => {
                        let z = cubecl_kernels::fp8_linear(x.clone(), wq, None, None, order);
                        cubecl_kernels::silu_mul(z, Some(row_scale))
                    }
                }
            };
            let err = if baselines {
                rel_err(ours(), unfused())
            } else {
                f64::NAN
            };
            let route =
                cubecl_kernels::linear_route(&x, s.n, cubecl_kernels::ReductionOrder::Fastest)
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
            if let Some(wq) = &quantized {
                let t = graph_us(device, calls, reps, || fp8_product(wq));
                let err = rel_err(fp8_product(wq), unfused());
                let bytes = m * s.k * dtype.size() + s.n * s.k + m * s.n * dtype.size();
                report.row(vec![
                    json!(model),
                    json!(s.name),
                    json!(format!("{dtype:?}").to_lowercase()),
                    json!("Fp8"),
                    json!(m),
                    json!(s.k),
                    json!(s.n),
                    json!(t),
                    json!(t_unfused),
                    json!(t_matmul),
                    json!(bytes as f64 / t / 1e3),
                    json!(flops / t / 1e6),
                    json!(t_unfused / t),
                    json!(err),
                ]);
            }
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
