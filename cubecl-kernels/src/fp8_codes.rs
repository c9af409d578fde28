//! FP8 codes decoded in registers, shared by the FP8 KV cache's attention kernels and the FP8
//! products. Two ways, both exact for every finite code (the writers saturate, so no NaN is
//! stored):
//!
//! - [`decode_f32()`], portable: a code's sign, exponent and mantissa placed in an f32's bits, then
//!   scaled by 2^(127 − bias): about seven instructions a code. CubeCL 0.11's LLVM route lowers
//!   FP8 casts to a generic software conversion about four times as long (docs/BENCHMARKS.md).
//! - [`decode_ptx()`], CUDA devices of compute capability ≥ 8.9: PTX's `cvt.rn.f16x2.e4m3x2`
//!   (or `.e5m2x2`) turns two codes into two halves in one instruction, written as inline PTX
//!   that only the vendored cubecl-llvm lowers ([`PTX_CVT_LOWERED`], as
//!   [`crate::fast_exp`]).
//!
//! And the other way, for the FP8 products' activations: [`encode_e4m3_word()`], four values to
//! a word of E4M3 codes, by PTX's `cvt.rn.satfinite.e4m3x2.f32` or CubeCL's cast.

/// Whether [`decode_ptx()`] can be compiled by this build's CubeCL (CUDA kernels only).
pub const PTX_CVT_LOWERED: bool = cfg!(cubecl_llvm_asm);

/// Where a code's exponent and mantissa land in an f32's bits (shifted left by this), and the
/// factor that then corrects the exponent bias: E4M3 (bias 7) or E5M2 (bias 15).
pub(crate) const fn placement(e5m2: bool) -> (u32, f32) {
    if e5m2 {
        (21, f32::from_bits((127 + 112) << 23))
    } else {
        (20, f32::from_bits((127 + 120) << 23))
    }
}

pub(crate) use ptx::load_codes;
pub use ptx::{decode_f32, decode_ptx, encode_e4m3_word};

/// Whether kernels on the device of `caps` decode FP8 codes by [`decode_ptx()`]: where it lowers
/// and the device converts FP8, unless `BURN_NANOVLLM_FP8_DECODE=bits` asks for bit placement.
pub(crate) fn ptx_decodes(caps: &crate::device_caps::DeviceCaps) -> bool {
    PTX_CVT_LOWERED && caps.fp8_convert && !crate::knobs::Knobs::get().fp8_decode_bits
}

// `#[cube]` generates an undocumented module beside each function.
#[allow(missing_docs)]
mod ptx {
    use cubecl::prelude::*;

    use super::placement;

    /// The values of a vector of FP8 codes `x` (`KV` an FP8 type: E5M2 with `e5m2`, else
    /// E4M3) as f32, by placing their bits: any runtime.
    #[cube]
    pub fn decode_f32<KV: Scalar, NV: Size>(
        x: Vector<KV, NV>,
        #[comptime] e5m2: bool,
    ) -> Vector<f32, NV> {
        let (shift, factor) = comptime!(placement(e5m2));
        let b = Vector::<u32, NV>::cast_from(Vector::<u8, NV>::reinterpret(x));
        let sign = (b & Vector::new(0x80u32)) << Vector::new(24u32);
        let rest = (b & Vector::new(0x7Fu32)) << Vector::new(shift);
        Vector::<f32, NV>::reinterpret(sign | rest) * Vector::new(factor)
    }

    /// The values of a vector of FP8 codes `x` (E5M2 with `e5m2`, else E4M3) as `O`, two codes
    /// an instruction by PTX's `cvt.rn.f16x2.{e4m3x2, e5m2x2}` (then cast from f16: nothing for
    /// f16, one conversion for f32 or bf16). Vectors of 4, 8 or 16 codes; others take
    /// [`decode_f32()`]. Only in CUDA kernels on devices of compute capability ≥ 8.9, and only
    /// where [`PTX_CVT_LOWERED`](crate::fp8_codes::PTX_CVT_LOWERED).
    #[cube]
    pub fn decode_ptx<KV: Scalar, O: Float, NV: Size>(
        x: Vector<KV, NV>,
        #[comptime] e5m2: bool,
    ) -> Vector<O, NV> {
        let n = x.vector_size();
        let mut out = Vector::<O, NV>::empty();
        if comptime!(n == 16) {
            let w = Vector::<u32, Const<4>>::reinterpret(x);
            put_word::<O, NV>(&mut out, w.extract(0usize), 0usize, e5m2);
            put_word::<O, NV>(&mut out, w.extract(1usize), 4usize, e5m2);
            put_word::<O, NV>(&mut out, w.extract(2usize), 8usize, e5m2);
            put_word::<O, NV>(&mut out, w.extract(3usize), 12usize, e5m2);
        } else if comptime!(n == 8) {
            let w = Vector::<u32, Const<2>>::reinterpret(x);
            put_word::<O, NV>(&mut out, w.extract(0usize), 0usize, e5m2);
            put_word::<O, NV>(&mut out, w.extract(1usize), 4usize, e5m2);
        } else if comptime!(n == 4) {
            put_word::<O, NV>(&mut out, u32::reinterpret(x), 0usize, e5m2);
        } else {
            out = Vector::<O, NV>::cast_from(decode_f32(x, e5m2));
        }
        out
    }

    /// A vector of `X` as `O`: with `fp8`, FP8 codes (E5M2 with `e5m2`, else E4M3) decoded
    /// exactly, unscaled, by [`decode_ptx()`] where `ptx`, else by [`decode_f32()`]; without,
    /// cast. How every kernel that may read codes loads its operands.
    #[cube]
    pub(crate) fn load_codes<X: Float, O: Float, NV: Size>(
        x: Vector<X, NV>,
        #[comptime] fp8: bool,
        #[comptime] ptx: bool,
        #[comptime] e5m2: bool,
    ) -> Vector<O, NV> {
        if comptime!(fp8 && ptx) {
            decode_ptx::<X, O, NV>(x, e5m2)
        } else if comptime!(fp8) {
            Vector::<O, NV>::cast_from(decode_f32(x, e5m2))
        } else {
            Vector::<O, NV>::cast_from(x)
        }
    }

    /// Decodes the four codes of `word` (little-endian) into `out[at .. at + 4]`.
    #[cube]
    fn put_word<O: Float, NV: Size>(
        out: &mut Vector<O, NV>,
        word: u32,
        #[comptime] at: usize,
        #[comptime] e5m2: bool,
    ) {
        let lo = Vector::<half::f16, Const<2>>::reinterpret(halves_of_low_pair(word, e5m2));
        let hi = Vector::<half::f16, Const<2>>::reinterpret(halves_of_low_pair(word >> 16, e5m2));
        out.insert(at, O::cast_from(lo.extract(0usize)));
        out.insert(at + 1, O::cast_from(lo.extract(1usize)));
        out.insert(at + 2, O::cast_from(hi.extract(0usize)));
        out.insert(at + 3, O::cast_from(hi.extract(1usize)));
    }

    /// The codes in bits 0–7 and 8–15 of `pair` as two halves (f16x2 bits: the low one first).
    #[cube]
    fn halves_of_low_pair(pair: u32, #[comptime] e5m2: bool) -> u32 {
        if comptime!(e5m2) {
            e5m2_pair(pair)
        } else {
            e4m3_pair(pair)
        }
    }

    /// [`halves_of_low_pair`] of E4M3 codes.
    #[cube]
    fn e4m3_pair(pair: u32) -> u32 {
        let y: u32;
        gpu_asm!(
            "{{ .reg .b16 lo, hi; mov.b32 {{lo, hi}}, {1}; cvt.rn.f16x2.e4m3x2 {0}, lo; }}",
            out(_) y, in(_) pair, options(pure, nomem)
        );
        y
    }

    /// [`halves_of_low_pair`] of E5M2 codes.
    #[cube]
    fn e5m2_pair(pair: u32) -> u32 {
        let y: u32;
        gpu_asm!(
            "{{ .reg .b16 lo, hi; mov.b32 {{lo, hi}}, {1}; cvt.rn.f16x2.e5m2x2 {0}, lo; }}",
            out(_) y, in(_) pair, options(pure, nomem)
        );
        y
    }

    /// Four values as E4M3 codes (round to nearest even, saturating at ±448) packed into one
    /// little-endian word, `a` in the low byte: with `ptx` by PTX's
    /// `cvt.rn.satfinite.e4m3x2.f32`, two codes an instruction (CUDA, compute capability ≥ 8.9,
    /// where [`PTX_CVT_LOWERED`](crate::fp8_codes::PTX_CVT_LOWERED)), else by CubeCL's cast.
    #[cube]
    pub fn encode_e4m3_word<Q: Float>(
        a: f32,
        b: f32,
        c: f32,
        d: f32,
        #[comptime] ptx: bool,
    ) -> u32 {
        if comptime!(ptx) {
            e4m3_word(a, b, c, d)
        } else {
            code_byte::<Q>(a)
                | (code_byte::<Q>(b) << 8u32)
                | (code_byte::<Q>(c) << 16u32)
                | (code_byte::<Q>(d) << 24u32)
        }
    }

    /// `v`'s code by CubeCL's cast to `Q` (E4M3), as a word's low byte.
    #[cube]
    fn code_byte<Q: Float>(v: f32) -> u32 {
        u32::cast_from(u8::reinterpret(Q::cast_from(v)))
    }

    /// [`encode_e4m3_word`] by PTX (the second source of each `cvt` lands in the low byte).
    #[cube]
    fn e4m3_word(a: f32, b: f32, c: f32, d: f32) -> u32 {
        let y: u32;
        gpu_asm!(
            "{{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, {2}, {1}; cvt.rn.satfinite.e4m3x2.f32 hi, {4}, {3}; mov.b32 {0}, {{lo, hi}}; }}",
            out(_) y, in(_) a, in(_) b, in(_) c, in(_) d, options(pure, nomem)
        );
        y
    }
}
