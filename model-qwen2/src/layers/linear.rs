use burn::module::{Module, Param};
use burn::tensor::Tensor;
use cubecl_kernels::ReductionOrder;

/// A linear layer in the Hugging Face layout: `y = x · Wᵀ (+ b)`.
///
/// `weight [out, in]` (the checkpoint's layout, read row by row by the fused kernels),
/// `bias [out]`.
#[derive(Module, Debug)]
pub struct Linear {
    /// `[out, in]`.
    pub weight: Param<Tensor<2>>,
    /// `[out]`.
    pub bias: Option<Param<Tensor<1>>>,
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
            order: ReductionOrder::Fastest,
        }
    }

    /// `x [M, in]` → `[M, out]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let bias = self.bias.as_ref().map(Param::val);
        cubecl_kernels::linear_ordered(x, self.weight.val(), bias, self.order)
    }

    /// `x · Wᵀ` `[M, out]` without the bias (for callers that add it later).
    pub fn product(&self, x: Tensor<2>) -> Tensor<2> {
        cubecl_kernels::linear_ordered(x, self.weight.val(), None, self.order)
    }

    /// `x · Wᵀ + residual` `[M, out]` without the bias, the sum in the product's epilogue.
    pub fn product_add(&self, x: Tensor<2>, residual: Tensor<2>) -> Tensor<2> {
        cubecl_kernels::linear_add_ordered(x, self.weight.val(), None, residual, self.order)
    }

    /// `out` features.
    pub fn out_features(&self) -> usize {
        self.weight.dims()[0]
    }
}
