use burn::tensor::{DType, Device, Tensor, TensorData};
use rand::{Rng, SeedableRng, rngs::StdRng};

/// The device the kernels run on: the CubeCL CPU runtime, or `KERNEL_TEST_DEVICE` (`cuda`,
/// `cuda:N`, `cubecl-cpu`) to run the same tests on a GPU (plane and tensor-core paths).
/// References run on the Flex backend.
pub fn kernel_device() -> Device {
    let name = std::env::var("KERNEL_TEST_DEVICE").unwrap_or_else(|_| "cubecl-cpu".into());
    name.parse::<cubecl_kernels::DeviceKind>()
        .and_then(|k| k.device())
        .expect("KERNEL_TEST_DEVICE")
}

pub fn reference_device() -> Device {
    Device::flex()
}

/// A fresh RNG per test run; the seed is printed so that a failure can be replayed with
/// `KERNEL_TEST_SEED`.
pub fn rng(test: &str) -> StdRng {
    let seed = std::env::var("KERNEL_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random::<u64>());
    eprintln!("{test}: KERNEL_TEST_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

/// Random values in `[-scale, scale]`, rounded to `dtype` (so the reference sees exactly the
/// kernel's inputs), returned as f32 host data.
pub fn random(rng: &mut StdRng, n: usize, scale: f32, dtype: DType) -> Vec<f32> {
    let v: Vec<f32> = (0..n)
        .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * scale)
        .collect();
    let data = TensorData::new(v, [n])
        .convert_dtype(dtype)
        .convert_dtype(DType::F32);
    data.try_into_vec_as::<f32>().unwrap()
}

/// Host values as a tensor of `dtype` on `device`.
pub fn tensor<const D: usize>(
    values: &[f32],
    shape: [usize; D],
    dtype: DType,
    device: &Device,
) -> Tensor<D> {
    Tensor::from_data(TensorData::new(values.to_vec(), shape), (device, dtype))
}

pub fn host<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_into_vec_as::<f32>().unwrap()
}

/// Fills the device's memory pool with NaN-filled buffers and frees them, so that an output a
/// kernel forgets to write holds NaN (which no comparison lets pass).
pub fn poison_pool(device: &Device, bytes: usize) {
    for size in [bytes, bytes / 2, bytes / 4, 4096] {
        let n = (size / 4).max(1);
        let t = Tensor::<1>::from_data(
            TensorData::new(vec![f32::NAN; n], [n]),
            (device, DType::F32),
        );
        device.sync().unwrap();
        drop(t);
    }
}

/// `‖a − b‖ / ‖b‖`, failing on any non-finite value of `a`.
#[track_caller]
pub fn rel_error(what: &str, actual: &[f32], expected: &[f32]) -> f64 {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    if let Some(i) = actual.iter().position(|v| !v.is_finite()) {
        panic!(
            "{what}: non-finite output at {i} ({}) — unwritten or overflowed",
            actual[i]
        );
    }
    let num: f64 = actual
        .iter()
        .zip(expected)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = expected.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

#[track_caller]
pub fn assert_rel(what: &str, actual: &[f32], expected: &[f32], tol: f64) {
    let e = rel_error(what, actual, expected);
    assert!(e < tol, "{what}: relative error {e:e} ≥ {tol:e}");
}

/// Tolerance of a dtype (f32 accumulation in every kernel).
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        _ => 1e-2,
    }
}

/// `values` (rows of `width`) with row `r` multiplied by `2^(r mod 4 − 1)`: exact in every
/// dtype, so rows keep their rounding, but each row has its own RMS.
pub fn row_scaled(mut values: Vec<f32>, width: usize) -> Vec<f32> {
    for (r, row) in values.chunks_mut(width).enumerate() {
        let f = (1u32 << (r % 4)) as f32 * 0.5;
        row.iter_mut().for_each(|v| *v *= f);
    }
    values
}
