//! FP8 weights: the quantisation (per row and per tensor) against the host's E4M3 rounding
//! (exact), and the FP8 product (on CUDA in bf16: cuBLASLt's FP8 GEMM) against its definition
//! (the host-quantised operands multiplied in f32) and within one E4M3 step of the unquantised
//! product.

use burn::tensor::{DType, Tensor};
use cubecl_kernels::fp8_linear::reference;
use cubecl_kernels::{FP8_CARRIER, Fp8Rows, Fp8Scaling, ReductionOrder};

use super::common::*;

/// The kernels' codes and scales equal the host's for every dtype and both scalings, with a row
/// of zeros, a row whose values pass E4M3's range before scaling, and rows of tiny values.
#[test]
fn fp8_quantize_matches_the_host() {
    let mut rng = rng("fp8_quantize_matches_the_host");
    let device = kernel_device();
    let (rows, cols) = (7, 200);
    for (dtype, scaling) in [DType::F32, DType::F16, DType::BF16]
        .into_iter()
        .flat_map(|d| [(d, Fp8Scaling::PerRow), (d, Fp8Scaling::PerTensor)])
    {
        let mut x = random(&mut rng, rows * cols, 1.0, dtype);
        x[..cols].iter_mut().for_each(|v| *v = 0.0);
        x[cols..2 * cols].iter_mut().for_each(|v| *v *= 2048.0);
        x[2 * cols..3 * cols].iter_mut().for_each(|v| *v *= 1e-3);
        x[3 * cols + 17] = 96.0; // an outlier: the rest of its row lands in E4M3's small codes
        // Round to the dtype again after the edits (exact for the powers of two).
        let x = host(tensor(&x, [rows, cols], dtype, &device));
        let q = Fp8Rows::quantize(tensor(&x, [rows, cols], dtype, &device), scaling).unwrap();
        assert_eq!(q.dims(), [rows, cols], "{dtype:?}");
        assert_eq!(q.codes.dtype(), FP8_CARRIER, "{dtype:?}");
        let (codes, scales) = q.to_host();
        let (want_codes, want_scales) = reference::quantize(&x, rows, cols, scaling);
        assert_eq!(scales, want_scales, "{dtype:?} {scaling:?}: scales");
        if scaling == Fp8Scaling::PerRow {
            assert_eq!(scales[0], 1.0, "{dtype:?}: a row of zeros keeps scale 1");
        } else {
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(
                scales,
                vec![amax / 448.0; rows],
                "{dtype:?}: the tensor's scale"
            );
        }
        let bad: Vec<usize> = (0..codes.len())
            .filter(|&i| codes[i] != want_codes[i])
            .collect();
        if !bad.is_empty() {
            let shown: Vec<String> = bad
                .iter()
                .take(8)
                .map(|&i| {
                    format!(
                        "[{}, {}] {} → {} (host {})",
                        i / cols,
                        i % cols,
                        x[i],
                        Fp8Rows::decode(codes[i]),
                        Fp8Rows::decode(want_codes[i])
                    )
                })
                .collect();
            let mut rows: Vec<usize> = bad.iter().map(|i| i / cols).collect();
            rows.dedup();
            panic!(
                "{dtype:?} {scaling:?}: {} of {} codes differ from the host's, in rows {rows:?}: \
                 {}",
                bad.len(),
                codes.len(),
                shown.join("; ")
            );
        }
        // Each row's (per tensor: the tensor's) largest magnitude is coded as ±448: the scale
        // uses the whole range.
        let top_rows = match scaling {
            Fp8Scaling::PerRow => 1..rows,
            Fp8Scaling::PerTensor => 0..rows,
        };
        let mut tops = Vec::new();
        for r in top_rows {
            let row = &codes[r * cols..(r + 1) * cols];
            let top = row
                .iter()
                .map(|&b| Fp8Rows::decode(b).abs())
                .fold(0.0, f32::max);
            if scaling == Fp8Scaling::PerRow {
                assert_eq!(top, 448.0, "{dtype:?}: row {r}");
            }
            tops.push(top);
        }
        assert_eq!(tops.iter().copied().fold(0.0, f32::max), 448.0, "{dtype:?}");
    }
}

/// `fp8_linear` equals its definition (host quantisation, per row or per tensor; f32 product)
/// up to the f32 sums' order and the output's rounding, and lies within one E4M3 step of each
/// operand of the unquantised product: `|y − x·Wᵀ| ≤ (2·2⁻⁴ + 2⁻⁸)·Σ_k |x_k|·|w_k|` (each
/// code within half a step, 2⁻⁴ of its value, of the value it stands for), with and without
/// bias and residual, at decode and prefill row counts.
#[test]
fn fp8_linear_matches_its_definition() {
    let mut rng = rng("fp8_linear_matches_its_definition");
    let device = kernel_device();
    let (n, k) = (48, 256);
    let cases = [(1, false, false), (5, true, false), (70, true, true)];
    for (dtype, scaling) in [DType::F32, DType::BF16]
        .into_iter()
        .flat_map(|d| [(d, Fp8Scaling::PerRow), (d, Fp8Scaling::PerTensor)])
    {
        for (m, with_bias, with_residual) in cases {
            let what =
                format!("{dtype:?} {scaling:?} M={m} bias={with_bias} residual={with_residual}");
            let x = random(&mut rng, m * k, 2.0, dtype);
            let w = random(&mut rng, n * k, 0.05, dtype);
            let b = random(&mut rng, n, 0.5, dtype);
            let r = random(&mut rng, m * n, 1.0, dtype);
            let weight = Fp8Rows::quantize(tensor(&w, [n, k], dtype, &device), scaling).unwrap();
            let bias = with_bias.then(|| tensor(&b, [n], dtype, &device));
            let residual = with_residual.then(|| tensor(&r, [m, n], dtype, &device));
            let y = cubecl_kernels::fp8_linear(
                tensor(&x, [m, k], dtype, &device),
                &weight,
                bias.clone(),
                residual.clone(),
                ReductionOrder::Fastest,
            );
            assert_eq!(y.dtype(), dtype, "{what}");
            let got = host(y);
            let want = host(reference::fp8_linear(
                tensor(&x, [m, k], dtype, &device),
                &weight,
                bias,
                residual,
            ));
            assert_rel(&what, &got, &want, tolerance(dtype));

            // Against the unquantised product, element by element.
            let exact = host(
                tensor(&x, [m, k], DType::F32, &reference_device())
                    .matmul(tensor(&w, [n, k], DType::F32, &reference_device()).transpose()),
            );
            let bound_factor = 2.0 * 2f32.powi(-4) + 2f32.powi(-8);
            for i in 0..m {
                for j in 0..n {
                    let mass: f32 = (0..k).map(|c| (x[i * k + c] * w[j * k + c]).abs()).sum();
                    let mut expected = exact[i * n + j];
                    if with_bias {
                        expected += b[j];
                    }
                    if with_residual {
                        expected += r[i * n + j];
                    }
                    let out_rounding = if dtype == DType::F32 {
                        0.0
                    } else {
                        expected.abs() * 2f32.powi(-8) + 1e-6
                    };
                    let err = (got[i * n + j] - expected).abs();
                    assert!(
                        err <= bound_factor * mass + out_rounding,
                        "{what}: y[{i}, {j}] = {} is {err} from the unquantised {expected} \
                         (bound {})",
                        got[i * n + j],
                        bound_factor * mass + out_rounding
                    );
                }
            }
        }
    }
    // A failure of cuBLASLt's FP8 product (which the emulation would have covered) turns it
    // off for the device: it stayed on.
    cubecl_kernels::fp8_linear_support(&device).unwrap();
}

/// Bad operands are refused naming what is wrong.
#[test]
fn fp8_linear_refuses_bad_operands() {
    let device = kernel_device();
    for cols in [7, 6] {
        let odd = Tensor::<2>::zeros([4, cols], (&device, DType::F32));
        let err = Fp8Rows::quantize(odd, Fp8Scaling::PerTensor)
            .unwrap_err()
            .to_string();
        assert!(err.contains("multiple of 4"), "{err}");
    }
    let ones = Tensor::<2>::ones([8, 16], (&device, DType::F32));
    let w = Fp8Rows::quantize(ones, Fp8Scaling::PerRow).unwrap();
    let x = Tensor::<2>::ones([2, 32], (&device, DType::F32));
    let panic = std::panic::catch_unwind(|| {
        cubecl_kernels::fp8_linear(x, &w, None, None, ReductionOrder::Fastest)
    })
    .unwrap_err();
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains("weight has shape [8, 16]"), "{message}");
    let flex = cubecl_kernels::fp8_linear_support(&reference_device()).unwrap_err();
    assert!(flex.to_string().contains("not on this device"), "{flex}");
    cubecl_kernels::fp8_linear_support(&device).unwrap();
}
