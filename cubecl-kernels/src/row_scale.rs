//! The RMSNorm of a product's input, deferred to the product's consumer.
//!
//! `rms_norm(x, g) · Wᵀ + b` equals `inv_rms(x) ⊙ (x · (W·diag g)ᵀ) + b` with
//! `inv_rms(x)[t] = 1 / √(mean_k x[t, k]² + eps)`, one number per row. With the norm's gain folded
//! into the weight once ([`fold_norm_gain`]), the product is a plain GEMM of the raw rows (no
//! normalisation kernel before it: on cuBLASLt that kernel cost as much as the GEMM at decode
//! sizes), and the row scale and bias ride in the kernel that reads the product next
//! ([`crate::rope_store_kv`], [`crate::silu_mul()`]), which recomputes `inv_rms` from `x`.
//!
//! Device side: `row_inv_rms`, shared by those kernels.

use burn::tensor::{DType, FloatDType, Tensor};

pub(crate) use device::row_inv_rms;

/// The deferred RMSNorm of a product `z = x · (W·diag g)ᵀ`: its rows are
/// `y[t] = inv_rms(x)[t] · z[t] (+ b)` (f32 arithmetic, rounded to the product's dtype as the
/// undeferred product would be).
#[derive(Clone, Copy, Debug)]
pub struct RowScale<'a> {
    /// The product's input before normalisation, `x [T, K]`, the product's dtype.
    pub input: &'a Tensor<2>,
    /// The product's bias `[N]`, added after the scale.
    pub bias: Option<&'a Tensor<1>>,
    /// Added to the mean square.
    pub eps: f64,
}

impl RowScale<'_> {
    /// `inv_rms(x) [T, 1]`, f32.
    pub fn inv_rms(&self) -> Tensor<2> {
        crate::rms_norm_linear::reference::inv_rms(
            self.input.clone().cast(FloatDType::F32),
            self.eps,
        )
    }

    /// The plain-Burn definition: `z [T, N]` → `inv_rms(x) ⊙ z (+ b)` `[T, N]`, `z`'s dtype.
    pub fn apply(&self, z: Tensor<2>) -> Tensor<2> {
        let dtype = z.dtype();
        let y = z.cast(FloatDType::F32) * self.inv_rms();
        let y = match self.bias {
            Some(b) => y + b.clone().cast(FloatDType::F32).unsqueeze::<2>(),
            None => y,
        };
        y.cast(dtype)
    }

    /// Checks `input [T, K]` and `bias [width]` against a product `[rows, width]` of `dtype`
    /// (the kernels read them as the product's dtype).
    pub(crate) fn check(
        &self,
        rows: usize,
        width: usize,
        dtype: DType,
    ) -> Result<(), crate::KernelError> {
        let [t, _] = self.input.dims();
        if t != rows {
            return Err(crate::KernelError::invalid(format!(
                "row_scale input has {t} rows, the product {rows}"
            )));
        }
        if let Some(b) = self.bias
            && b.dims() != [width]
        {
            return Err(crate::KernelError::invalid(format!(
                "row_scale bias has shape {:?}; expected [{width}]",
                b.dims()
            )));
        }
        for (name, d) in [
            ("row_scale input", Some(self.input.dtype())),
            ("row_scale bias", self.bias.map(|b| b.dtype())),
        ] {
            if let Some(d) = d.filter(|&d| d != dtype) {
                return Err(crate::KernelError::invalid(format!(
                    "{name} has dtype {d:?}, the product {dtype:?}"
                )));
            }
        }
        Ok(())
    }
}

/// `W · diag(g)`: an RMSNorm gain `g [K]` folded into the weight `W [N, K]` of the product that
/// follows the norm (in f32, rounded once to `W`'s dtype).
pub fn fold_norm_gain(weight: Tensor<2>, gain: Tensor<1>) -> Tensor<2> {
    let dtype = weight.dtype();
    (weight.cast(FloatDType::F32) * gain.cast(FloatDType::F32).unsqueeze::<2>()).cast(dtype)
}

mod device {
    use cubecl::prelude::*;

    use crate::rms_norm_linear::kernel::cube_sum;

    /// Vectors each unit loads before using any in [`row_inv_rms`] (in flight together).
    const ROW_HELD: usize = 4;

    /// `1 / √(mean_k x[row, k]² + eps)` (f32) for the whole cube: the units stride over the row in
    /// vectors of `NV` elements, [`ROW_HELD`] loads in flight at a time, and [`cube_sum`] adds their
    /// parts (`scratch`: `CUBE_DIM_X` slots). `x`: `[T, K]`, `K` a multiple of `NV`.
    #[cube]
    pub fn row_inv_rms<F: Float, NV: Size>(
        x: &Tensor<Vector<F, NV>>,
        row: usize,
        eps: f32,
        scratch: &mut Shared<[f32]>,
        #[comptime] use_plane: bool,
    ) -> f32 {
        let nv = x.vector_size();
        let k = x.shape(1);
        let k_vecs = k / nv;
        let at = row * (x.stride(0) / nv);
        let units = CUBE_DIM_X as usize;
        let mut vals = Array::<Vector<F, NV>>::new(ROW_HELD);
        let mut acc = 0.0f32;
        let mut base = UNIT_POS_X as usize;
        while base < k_vecs {
            #[unroll]
            for j in 0..ROW_HELD {
                let i = base + j * units;
                let mut v = Vector::<F, NV>::new(F::new(0.0));
                if i < k_vecs {
                    v = x[at + i];
                }
                vals[j] = v;
            }
            #[unroll]
            for j in 0..ROW_HELD {
                let f = Vector::<f32, NV>::cast_from(vals[j]);
                #[unroll]
                for e in 0..nv {
                    acc += f.extract(e) * f.extract(e);
                }
            }
            base += ROW_HELD * units;
        }
        let total = cube_sum(acc, scratch, use_plane);
        f32::inverse_sqrt(total / f32::cast_from(k) + eps)
    }
}
