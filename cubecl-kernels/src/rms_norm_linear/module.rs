//! [`FusedRmsNormLinear`]: the fused op as a Burn module, for models that had an RMSNorm
//! followed by a linear layer.

use burn::module::{Module, Param};
use burn::nn::{Linear, RmsNorm};
use burn::tensor::Tensor;

/// `y = rms_norm(x) · Wᵀ (+ b)` in one op: an RMSNorm followed by a linear layer, without the
/// normalised activations ever reaching memory on CubeCL devices (plain Burn elsewhere).
///
/// Swapping it into a model that used Burn's `RmsNorm` then `Linear`:
///
/// ```
/// use burn::nn::{LinearConfig, RmsNormConfig};
/// use burn::tensor::{Device, Distribution, Tensor};
/// use cubecl_kernels::FusedRmsNormLinear;
///
/// let device = Device::flex(); // or Device::cuda(0): then the CubeCL kernels run
/// let norm = RmsNormConfig::new(64).init(&device);
/// let proj = LinearConfig::new(64, 96).with_bias(true).init(&device);
/// let x = Tensor::<3>::random([2, 5, 64], Distribution::Default, &device);
///
/// let before = proj.forward(norm.forward(x.clone()));   // two modules, two passes
/// let fused = FusedRmsNormLinear::from_modules(&norm, &proj);
/// let after = fused.forward(x);                         // one op, same result
/// assert!(after.all_close(before, Some(1e-5), Some(1e-5)));
/// ```
#[derive(Module, Debug)]
pub struct FusedRmsNormLinear {
    /// RMSNorm weight, `[K]`.
    pub norm_weight: Param<Tensor<1>>,
    /// Linear weight in the Hugging Face layout, `[N, K]` (row `n` = output feature `n`).
    pub weight: Param<Tensor<2>>,
    /// Bias, `[N]`.
    pub bias: Option<Param<Tensor<1>>>,
    /// RMSNorm epsilon.
    pub eps: f64,
}

impl FusedRmsNormLinear {
    /// From tensors: `norm_weight [K]`, `weight [N, K]`, `bias [N]`.
    pub fn new(
        norm_weight: Tensor<1>,
        weight: Tensor<2>,
        bias: Option<Tensor<1>>,
        eps: f64,
    ) -> Self {
        Self {
            norm_weight: Param::from_tensor(norm_weight),
            weight: Param::from_tensor(weight),
            bias: bias.map(Param::from_tensor),
            eps,
        }
    }

    /// From Burn's `RmsNorm` and `Linear` modules (any `LinearLayout`): the weight is stored once
    /// as a contiguous `[N, K]` matrix, the layout the kernels stream row by row.
    pub fn from_modules(norm: &RmsNorm, linear: &Linear) -> Self {
        let weight = linear.weight.val(); // [K, N], possibly a transposed view
        let device = weight.device();
        let dtype = weight.dtype();
        let weight = Tensor::<2>::from_data(weight.transpose().into_data(), (&device, dtype));
        Self::new(
            norm.gamma.val(),
            weight,
            linear.bias.as_ref().map(Param::val),
            norm.epsilon,
        )
    }

    /// `x [..., K]` → `[..., N]`.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let mut dims = x.dims();
        let k = dims[D - 1];
        let rows = x.shape().num_elements() / k.max(1);
        let y = super::rms_norm_linear(
            x.reshape([rows, k]),
            self.norm_weight.val(),
            self.weight.val(),
            self.bias.as_ref().map(Param::val),
            self.eps,
        );
        dims[D - 1] = y.dims()[1];
        y.reshape(dims)
    }

    /// Residual variant: `h = x + residual`, `y = rms_norm(h) · Wᵀ (+ b)`; returns `(y, h)`.
    /// `x`, `residual`: `[M, K]` → `(y [M, N], h [M, K])`.
    pub fn forward_residual(&self, x: Tensor<2>, residual: Tensor<2>) -> (Tensor<2>, Tensor<2>) {
        super::add_rms_norm_linear(
            x,
            residual,
            self.norm_weight.val(),
            self.weight.val(),
            self.bias.as_ref().map(Param::val),
            self.eps,
        )
    }
}
