//! The definition of the FP8 linear family on the host and in plain Burn: the test oracle, and
//! [`super::fp8_linear`]'s path on devices that run no CubeCL kernels.

use burn::tensor::{DType, FloatDType, Tensor, TensorData};

use super::kernel::E4M3_MAX;
use super::{Fp8Rows, Fp8Scaling};

/// Quantises `x` (`rows × cols` f32, row-major) with `scaling` as the kernels do: the E4M3
/// codes (`rows · cols` bytes) and the scales (`rows`; per tensor, the tensor's in each).
pub fn quantize(x: &[f32], rows: usize, cols: usize, scaling: Fp8Scaling) -> (Vec<u8>, Vec<f32>) {
    match scaling {
        Fp8Scaling::PerRow => quantize_rows(x, rows, cols),
        Fp8Scaling::PerTensor => quantize_tensor(x, rows, cols),
    }
}

/// Quantises `x` (`rows × cols` f32, row-major) with one scale, its largest magnitude over
/// 448 (1 for zeros), repeated for every row.
pub fn quantize_tensor(x: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(
        x.len(),
        rows * cols,
        "quantize_tensor: x is not rows × cols"
    );
    let scale = scale_of(x);
    (codes_of(x, scale).collect(), vec![scale; rows])
}

/// Quantises `x` (`rows × cols` f32, row-major) row by row as the kernel does: the E4M3 codes
/// (`rows · cols` bytes) and the scales (`rows`).
pub fn quantize_rows(x: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(x.len(), rows * cols, "quantize_rows: x is not rows × cols");
    let mut codes = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(rows);
    for row in x.chunks(cols.max(1)).take(rows) {
        let scale = scale_of(row);
        codes.extend(codes_of(row, scale));
        scales.push(scale);
    }
    (codes, scales)
}

/// The scale that maps the largest magnitude of `values` to 448 (1 for zeros).
fn scale_of(values: &[f32]) -> f32 {
    let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax > 0.0 { amax / E4M3_MAX } else { 1.0 }
}

/// The E4M3 codes of `values / scale` (round to nearest even, saturating).
fn codes_of(values: &[f32], scale: f32) -> impl Iterator<Item = u8> + '_ {
    values
        .iter()
        .map(move |&v| cubecl::e4m3::from_f32(v / scale).to_bits())
}

/// The values `code · scale` of row-quantised codes, `rows × cols` f32.
pub fn dequantize_rows(codes: &[u8], scales: &[f32], cols: usize) -> Vec<f32> {
    codes
        .chunks(cols.max(1))
        .zip(scales)
        .flat_map(|(row, &s)| row.iter().map(move |&b| Fp8Rows::decode(b) * s))
        .collect()
}

/// `y = x · Wᵀ (+ b) (+ residual)` as [`super::fp8_linear`] defines it in a product of at most
/// 1,024 rows that is not batch-invariant: `x [M, K]` quantised as the weight is (per tensor or
/// per row; the same for one row), both operands dequantised, the sums in f64 on the host (no
/// device arithmetic that could round differently, such as TF32 products), rounded once to
/// `x`'s dtype. Reads its operands back to the host.
pub fn fp8_linear(
    x: Tensor<2>,
    weight: &Fp8Rows,
    bias: Option<Tensor<1>>,
    residual: Option<Tensor<2>>,
) -> Tensor<2> {
    let [m, k] = x.dims();
    let [n, _] = weight.dims();
    let device = x.device();
    let dtype = x.dtype();
    let host = |t: Tensor<2>| -> Vec<f32> {
        t.cast(FloatDType::F32)
            .into_data()
            .try_to_vec::<f32>()
            .expect("f32 data")
    };
    let (x_codes, x_scales) = quantize(&host(x), m, k, weight.scaling);
    let (w_codes, w_scales) = weight.to_host();
    let xd = dequantize_rows(&x_codes, &x_scales, k);
    let wd = dequantize_rows(&w_codes, &w_scales, k);
    let bias = bias.map(|b| host(b.unsqueeze::<2>()));
    let residual = residual.map(host);
    let mut y = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut sum: f64 = (0..k)
                .map(|c| xd[i * k + c] as f64 * wd[j * k + c] as f64)
                .sum();
            if let Some(b) = &bias {
                sum += b[j] as f64;
            }
            if let Some(r) = &residual {
                sum += r[i * n + j] as f64;
            }
            y[i * n + j] = sum as f32;
        }
    }
    Tensor::<2>::from_data(TensorData::new(y, [m, n]), (&device, DType::F32)).cast(dtype)
}
