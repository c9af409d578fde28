//! Fused RMSNorm + linear, its residual variant, the plain linear op and the linear op that adds
//! a residual to its output; the gated activation with a deferred row scale.

use burn::tensor::DType;
use cubecl_kernels::rms_norm_linear::reference;

use super::common::*;

/// Awkward shapes: M = 1, 3 (skinny kernel), 257 (tiled, ragged last tile); K not a multiple
/// of any tile or vector; N = 1 and ragged. On CUDA, M > 4 takes cuBLASLt (or, with
/// `BURN_NANOVLLM_CUBLAS=0`, cubek's matmul, 64 × 1024 → 200 split along K); K = 4200 is too
/// long a row for the plane norm to hold in registers (it reads the row in ragged chunks).
const SHAPES: [(usize, usize, usize); 9] = [
    (1, 96, 1),
    (1, 100, 67),
    (3, 37, 130),
    (3, 128, 5),
    (257, 72, 67),
    (40, 24, 33),
    (64, 1024, 200),
    (300, 128, 96),
    (9, 4200, 24),
];

pub(super) struct Case {
    m: usize,
    k: usize,
    n: usize,
    dtype: DType,
    x: Vec<f32>,
    r: Vec<f32>,
    /// The residual added to the output (`linear_add`), `[M, N]`.
    ro: Vec<f32>,
    g: Vec<f32>,
    w: Vec<f32>,
    b: Vec<f32>,
}

impl Case {
    pub(super) fn new(
        rng: &mut rand::rngs::StdRng,
        (m, k, n): (usize, usize, usize),
        dtype: DType,
    ) -> Self {
        Self {
            m,
            k,
            n,
            dtype,
            x: random(rng, m * k, 2.0, dtype),
            r: random(rng, m * k, 1.0, dtype),
            ro: random(rng, m * n, 1.0, dtype),
            g: random(rng, k, 1.0, dtype).iter().map(|v| v + 1.5).collect(),
            w: random(rng, n * k, 1.0 / (k as f32).sqrt(), dtype),
            b: random(rng, n, 0.5, dtype),
        }
    }
}

/// Runs `op` on the kernel device and on the reference device with the same inputs.
pub(super) fn check(name: &str, c: &Case, bias: bool) {
    let (kd, rd) = (kernel_device(), reference_device());
    let dt = c.dtype;
    let route = {
        let x = tensor(&c.x, [c.m, c.k], dt, &kd);
        cubecl_kernels::linear_route(&x, c.n, cubecl_kernels::ReductionOrder::Fastest)
    };
    let what = format!(
        "{name} {:?} M={} K={} N={} bias={bias} route={route:?}",
        dt, c.m, c.k, c.n
    );
    let eps = 1e-6;
    let run = |dev: &burn::tensor::Device,
               dtype: DType,
               kernel: bool|
     -> (Vec<f32>, Option<Vec<f32>>) {
        let x = tensor(&c.x, [c.m, c.k], dtype, dev);
        let r = tensor(&c.r, [c.m, c.k], dtype, dev);
        let g = tensor(&c.g, [c.k], dtype, dev);
        let w = tensor(&c.w, [c.n, c.k], dtype, dev);
        let b = bias.then(|| tensor(&c.b, [c.n], dtype, dev));
        if kernel {
            poison_pool(dev, 4 * c.m * c.n.max(c.k) + 4096);
        }
        match (name, kernel) {
            ("linear", true) => (host(cubecl_kernels::linear(x, w, b)), None),
            ("linear", false) => (host(reference::linear(x, w, b)), None),
            ("linear_add", kernel) => {
                let ro = tensor(&c.ro, [c.m, c.n], dtype, dev);
                if kernel {
                    (host(cubecl_kernels::linear_add(x, w, b, ro)), None)
                } else {
                    (host(reference::linear(x, w, b) + ro), None)
                }
            }
            ("rms_norm_linear", true) => {
                (host(cubecl_kernels::rms_norm_linear(x, g, w, b, eps)), None)
            }
            ("rms_norm_linear", false) => (host(reference::rms_norm_linear(x, g, w, b, eps)), None),
            ("add_rms_norm_linear", true) => {
                let (y, h) = cubecl_kernels::add_rms_norm_linear(x, r, g, w, b, eps);
                (host(y), Some(host(h)))
            }
            ("add_rms_norm_linear", false) => {
                let (y, h) = reference::add_rms_norm_linear(x, r, g, w, b, eps);
                (host(y), Some(host(h)))
            }
            _ => unreachable!(),
        }
    };
    eprintln!("{what}");
    let (y, h) = run(&kd, dt, true);
    // The reference computes in f32 from the same (rounded) inputs.
    let (y_ref, h_ref) = run(&rd, DType::F32, false);
    // Errors are relative to the size of the terms summed (‖ |ĥ|·|g| · |W|ᵀ + |b| ‖), not of
    // the result, which cancellation can make arbitrarily small (N = 1 is a single number).
    let terms = magnitude(name, c, bias, &rd);
    let err = rel_error(&format!("{what}: y"), &y, &y_ref) * norm(&y_ref) / norm(&terms);
    assert!(
        err < tolerance(dt),
        "{what}: y: error {err:e} relative to the terms ≥ {:e}",
        tolerance(dt)
    );
    if let (Some(h), Some(h_ref)) = (h, h_ref) {
        assert_rel(&format!("{what}: h"), &h, &h_ref, tolerance(dt));
    }
}

#[test]
fn fused_ops_match_reference_f32() {
    let mut rng = rng("fused_ops_match_reference_f32");
    for (i, &shape) in SHAPES.iter().enumerate() {
        let c = Case::new(&mut rng, shape, DType::F32);
        check("rms_norm_linear", &c, i % 2 == 0);
        check("add_rms_norm_linear", &c, i % 2 == 1);
        check("linear", &c, i % 3 == 0);
        check("linear_add", &c, i % 2 == 0);
    }
}

#[test]
fn fused_ops_match_reference_half_precision() {
    let mut rng = rng("fused_ops_match_reference_half_precision");
    for (i, &shape) in SHAPES.iter().enumerate() {
        let dtype = if i % 2 == 0 { DType::BF16 } else { DType::F16 };
        let c = Case::new(&mut rng, shape, dtype);
        check("add_rms_norm_linear", &c, true);
        check("linear", &c, false);
        check("linear_add", &c, i % 3 == 0);
    }
}

/// With the timing of cuBLASLt's candidates on (CUDA; the engine's graph warm-ups): a shape's
/// first call runs every candidate several times on its own operands before the kept one, and
/// the result is still the product — the output and an added residual (`linear_add`) are not
/// accumulated over the timed runs. Elsewhere the same checks on the kernels.
#[test]
fn tuned_products_match_reference() {
    let mut rng = rng("tuned_products_match_reference");
    cubecl_kernels::set_linear_tuning(true);
    for (i, &shape) in SHAPES.iter().enumerate() {
        let dtype = [DType::BF16, DType::F16, DType::F32][i % 3];
        let c = Case::new(&mut rng, shape, dtype);
        check("linear_add", &c, i % 2 == 0);
        check("rms_norm_linear", &c, i % 2 == 1);
    }
    cubecl_kernels::set_linear_tuning(false);
}

/// `silu(gate)·up` with and without a deferred row scale (and bias) against the plain-Burn
/// definition: odd and vector-unfriendly widths, one and many rows, long input rows; rows split
/// over several cubes and whole rows per cube (on an H100: `T` = 16 and 100 split with 1 and 2
/// vectors per unit, `T` = 300 whole rows of 608 vectors).
#[test]
fn silu_mul_matches_reference() {
    let mut rng = rng("silu_mul_matches_reference");
    // (T, I, K of the row-scale input, row scale: None or Some(bias), dtype)
    let cases = [
        (1, 8, 72, None, DType::F32),
        (3, 37, 100, Some(false), DType::F32),
        (257, 64, 96, Some(true), DType::F32),
        (5, 600, 896, Some(false), DType::BF16),
        (17, 96, 4200, Some(true), DType::F16),
        (2, 40, 24, None, DType::BF16),
        (16, 4864, 896, Some(false), DType::BF16),
        (100, 4864, 896, Some(true), DType::BF16),
        (300, 4864, 128, Some(false), DType::F16),
    ];
    for (t, i, k, scaled, dtype) in cases {
        check_silu_mul(&mut rng, t, i, k, scaled, dtype);
    }
}

/// `silu_mul` of `gate_up [T, 2·I]` (with the row scale of a `[T, K]` input, and its bias when
/// `scaled` is `Some(true)`) against the reference.
pub(super) fn check_silu_mul(
    rng: &mut rand::rngs::StdRng,
    t: usize,
    i: usize,
    k: usize,
    scaled: Option<bool>,
    dtype: DType,
) {
    use cubecl_kernels::{RowScale, silu_mul};
    let what = format!("silu_mul T={t} I={i} K={k} row_scale={scaled:?} {dtype:?}");
    eprintln!("{what}");
    let gu = random(rng, t * 2 * i, 3.0, dtype);
    let xs = row_scaled(random(rng, t * k, 2.0, dtype), k);
    let bias = random(rng, 2 * i, 0.5, dtype);
    let run = |dev: &burn::tensor::Device, dt: DType, kernel: bool| {
        if kernel {
            poison_pool(dev, 4 * t * 2 * i + 4096);
        }
        let gu = tensor(&gu, [t, 2 * i], dt, dev);
        let x = tensor(&xs, [t, k], dt, dev);
        let b = tensor(&bias, [2 * i], dt, dev);
        let scale = scaled.map(|with_bias| RowScale {
            input: &x,
            bias: with_bias.then_some(&b),
            eps: 1e-6,
        });
        host(if kernel {
            silu_mul(gu, scale)
        } else {
            cubecl_kernels::silu_mul::reference(gu, scale)
        })
    };
    let y = run(&kernel_device(), dtype, true);
    let y_ref = run(&reference_device(), DType::F32, false);
    assert_rel(&what, &y, &y_ref, tolerance(dtype));
}

/// The route of each size: skinny at decode sizes; above them cuBLASLt on CUDA (unless
/// switched off), cubek's matmul with half precision on tensor-core devices, else FMA tiles.
#[test]
fn routes_follow_the_size_rules() {
    use cubecl_kernels::LinearRoute;
    let dev = kernel_device();
    let on_cuda = matches!(
        std::env::var("KERNEL_TEST_DEVICE").as_deref(),
        Ok(d) if d.starts_with("cuda")
    );
    let cublas = on_cuda && std::env::var("BURN_NANOVLLM_CUBLAS").as_deref() != Ok("0");
    let route = |m: usize, dtype: DType| {
        let x = tensor(&vec![0.5; m * 64], [m, 64], dtype, &dev);
        cubecl_kernels::linear_route(&x, 96, cubecl_kernels::ReductionOrder::Fastest)
            .expect("a CubeCL device")
    };
    for dtype in [DType::F32, DType::BF16] {
        assert_eq!(route(1, dtype), LinearRoute::Skinny, "{dtype:?}");
        assert_eq!(route(4, dtype), LinearRoute::Skinny, "{dtype:?}");
        let large = route(300, dtype);
        let expected = if cublas {
            LinearRoute::CublasLt
        } else if on_cuda && dtype == DType::BF16 {
            LinearRoute::Cubek
        } else {
            LinearRoute::Tiled
        };
        assert_eq!(large, expected, "{dtype:?} M = 300");
    }
    let x = tensor(&[0.5; 64], [1, 64], DType::F32, &reference_device());
    assert_eq!(
        cubecl_kernels::linear_route(&x, 96, cubecl_kernels::ReductionOrder::Fastest),
        None
    );
}

#[test]
fn invalid_arguments_are_refused_with_the_operand_named() {
    let dev = kernel_device();
    let x = tensor(&[1.0; 8], [2, 4], DType::F32, &dev);
    let w = tensor(&[1.0; 15], [3, 5], DType::F32, &dev);
    let g = tensor(&[1.0; 4], [4], DType::F32, &dev);
    let err = cubecl_kernels::check_args(&x, None, Some(&g), &w, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("weight has shape [3, 5]"), "{err}");
    let w = tensor(&[1.0; 12], [3, 4], DType::BF16, &dev);
    let err = cubecl_kernels::check_args(&x, None, Some(&g), &w, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("weight has dtype BF16"), "{err}");
    let w = tensor(&[1.0; 12], [3, 4], DType::F32, &dev);
    let b = tensor(&[1.0; 4], [4], DType::F32, &dev);
    let err = cubecl_kernels::check_args(&x, None, Some(&g), &w, Some(&b))
        .unwrap_err()
        .to_string();
    assert!(err.contains("bias has shape [4]"), "{err}");
    let panic =
        std::panic::catch_unwind(|| cubecl_kernels::linear(x.clone(), w.clone(), Some(b.clone())))
            .unwrap_err();
    let msg = panic.downcast_ref::<String>().unwrap();
    assert!(msg.starts_with("linear: bias has shape [4]"), "{msg}");
}

fn norm(v: &[f32]) -> f64 {
    v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt()
}

/// The op on absolute values: the sizes of the terms each output sums.
fn magnitude(name: &str, c: &Case, bias: bool, dev: &burn::tensor::Device) -> Vec<f32> {
    let abs = |v: &[f32]| v.iter().map(|x| x.abs()).collect::<Vec<_>>();
    let h: Vec<f32> = if name == "add_rms_norm_linear" {
        c.x.iter().zip(&c.r).map(|(a, b)| (a + b).abs()).collect()
    } else {
        abs(&c.x)
    };
    let x = tensor(&h, [c.m, c.k], DType::F32, dev);
    let g = tensor(&abs(&c.g), [c.k], DType::F32, dev);
    let w = tensor(&abs(&c.w), [c.n, c.k], DType::F32, dev);
    let b = bias.then(|| tensor(&abs(&c.b), [c.n], DType::F32, dev));
    if name == "linear" {
        host(reference::linear(x, w, b))
    } else if name == "linear_add" {
        let ro = tensor(&abs(&c.ro), [c.m, c.n], DType::F32, dev);
        host(reference::linear(x, w, b) + ro)
    } else {
        host(reference::rms_norm_linear(x, g, w, b, 1e-6))
    }
}
