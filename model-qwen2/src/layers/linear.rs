use burn::module::{Module, Param};
use burn::tensor::Tensor;

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
}

impl Linear {
    /// Wraps loaded tensors.
    pub fn new(weight: Tensor<2>, bias: Option<Tensor<1>>) -> Self {
        Self {
            weight: Param::from_tensor(weight),
            bias: bias.map(Param::from_tensor),
        }
    }

    /// `x [M, in]` → `[M, out]`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        cubecl_kernels::linear(x, self.weight.val(), self.bias.as_ref().map(Param::val))
    }

    /// `out` features.
    pub fn out_features(&self) -> usize {
        self.weight.dims()[0]
    }
}
