use burn::module::{Module, Param};
use burn::tensor::Tensor;
use cubecl_kernels::{Fp8Rows, Fp8Scaling, KernelError, ReductionOrder};

/// A linear layer in the Hugging Face layout: `y = x · Wᵀ (+ b)`.
///
/// `weight [out, in]` (the checkpoint's layout, read row by row by the fused kernels),
/// `bias [out]`. Quantised to FP8 ([`Self::quantize_fp8`]), `weight` holds the E4M3 codes of
/// `[out, in]` (carried as `[out, in / 2]` f16: [`cubecl_kernels::Fp8Rows`]) and `fp8_scales`
/// their scale per output feature (or the tensor's, repeated: `fp8_scaling`); the products then
/// quantise their input on the fly and run [`cubecl_kernels::fp8_linear()`].
#[derive(Module, Debug)]
pub struct Linear {
    /// `[out, in]` (FP8: the codes' carrier, `[out, in / 2]`).
    pub weight: Param<Tensor<2>>,
    /// `[out]`.
    pub bias: Option<Param<Tensor<1>>>,
    /// FP8 weights' scales, `[out]` f32; `None`: `weight` in the model's dtype.
    pub fp8_scales: Option<Param<Tensor<1>>>,
    /// Whether `fp8_scales` are per output feature or the tensor's in every entry.
    #[module(skip)]
    pub fp8_scaling: Fp8Scaling,
    /// How the products reduce along `in` ([`ReductionOrder::BatchInvariant`]: whatever the
    /// number of rows).
    #[module(skip)]
    pub order: ReductionOrder,
}

impl Linear {
    /// Wraps loaded tensors.
    pub fn new(weight: Tensor<2>, bias: Option<Tensor<1>>) -> Self {
        Self {
            weight: Param::from_tensor(weight),
            bias: bias.map(Param::from_tensor),
            fp8_scales: None,
            fp8_scaling: Fp8Scaling::default(),
            order: ReductionOrder::Fastest,
        }
    }

    /// Quantises the weight to FP8 E4M3 with `scaling`'s scales (the 16-bit weight is
    /// dropped). A no-op when it already is.
    pub fn quantize_fp8(&mut self, scaling: Fp8Scaling) -> Result<(), KernelError> {
        if self.fp8_scales.is_none() {
            let q = Fp8Rows::quantize(self.weight.val(), scaling)?;
            self.weight = Param::from_tensor(q.codes);
            self.fp8_scales = Some(Param::from_tensor(q.scales));
            self.fp8_scaling = scaling;
        }
        Ok(())
    }

    /// The FP8 weight, when quantised.
    pub fn fp8_weight(&self) -> Option<Fp8Rows> {
        self.fp8_scales.as_ref().map(|s| Fp8Rows {
            codes: self.weight.val(),
            scales: s.val(),
            scaling: self.fp8_scaling,
        })
    }

    /// `x [M, in]` → `[M, out]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let bias = self.bias.as_ref().map(Param::val);
        match self.fp8_weight() {
            Some(w) => cubecl_kernels::fp8_linear(x, &w, bias, None, self.order),
            None => cubecl_kernels::linear_ordered(x, self.weight.val(), bias, self.order),
        }
    }

    /// `x · Wᵀ` `[M, out]` without the bias (for callers that add it later).
    pub fn product(&self, x: Tensor<2>) -> Tensor<2> {
        match self.fp8_weight() {
            Some(w) => cubecl_kernels::fp8_linear(x, &w, None, None, self.order),
            None => cubecl_kernels::linear_ordered(x, self.weight.val(), None, self.order),
        }
    }

    /// `x · Wᵀ + residual` `[M, out]` without the bias, the sum in the product's epilogue.
    pub fn product_add(&self, x: Tensor<2>, residual: Tensor<2>) -> Tensor<2> {
        match self.fp8_weight() {
            Some(w) => cubecl_kernels::fp8_linear(x, &w, None, Some(residual), self.order),
            None => {
                cubecl_kernels::linear_add_ordered(x, self.weight.val(), None, residual, self.order)
            }
        }
    }

    /// `out` features.
    pub fn out_features(&self) -> usize {
        self.weight.dims()[0]
    }
}
