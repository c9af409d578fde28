//! FP8 codes decoded exactly in registers, shared by the FP8 KV cache's attention kernels and
//! the FP8 products: a code's sign, exponent and mantissa placed in an f32's bits, then scaled
//! by 2^(127 − bias). Exact for every finite code, subnormals included (the writers saturate,
//! so no NaN is stored). CubeCL 0.11's LLVM route lowers FP8 casts to a generic software
//! conversion about four times as long (docs/BENCHMARKS.md).

use cubecl::prelude::*;

/// Where a code's exponent and mantissa land in an f32's bits (shifted left by this), and the
/// factor that then corrects the exponent bias: E4M3 (bias 7) or E5M2 (bias 15).
pub(crate) const fn placement(e5m2: bool) -> (u32, f32) {
    if e5m2 {
        (21, f32::from_bits((127 + 112) << 23))
    } else {
        (20, f32::from_bits((127 + 120) << 23))
    }
}

/// The values of a vector of FP8 codes (`KV` an FP8 type: E5M2 with `e5m2`, else E4M3).
#[cube]
pub(crate) fn decode_f32<KV: Float, NV: Size>(
    x: Vector<KV, NV>,
    #[comptime] e5m2: bool,
) -> Vector<f32, NV> {
    let (shift, factor) = comptime!(placement(e5m2));
    let b = Vector::<u32, NV>::cast_from(Vector::<u8, NV>::reinterpret(x));
    let sign = (b & Vector::new(0x80u32)) << Vector::new(24u32);
    let rest = (b & Vector::new(0x7Fu32)) << Vector::new(shift);
    Vector::<f32, NV>::reinterpret(sign | rest) * Vector::new(factor)
}
