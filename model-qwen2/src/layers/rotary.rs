use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use cubecl_kernels::Rope;

/// Rotary position embedding in the rotate-half (GPT-NeoX) layout used by Qwen: element `j`
/// pairs with `j + head_dim/2`, angle `p · θ^(−2j/head_dim)`.
///
/// The tables are computed the way Hugging Face does in f32 (inverse frequencies and angles
/// rounded to f32), so positions far into the context match it too.
#[derive(Module, Debug)]
pub struct RotaryEmbedding {
    /// `cos(p · inv_freq_j)`, `[max_positions, head_dim / 2]`, f32.
    cos: Tensor<2>,
    /// `sin(p · inv_freq_j)`, `[max_positions, head_dim / 2]`, f32.
    sin: Tensor<2>,
}

impl RotaryEmbedding {
    /// Tables for positions `0..max_positions`.
    pub fn new(head_dim: usize, max_positions: usize, theta: f64, device: &Device) -> Self {
        let half = head_dim / 2;
        let inv_freq = Self::inv_freq(head_dim, theta);
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            for &f in &inv_freq {
                let angle = (p as f32 * f) as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let table = |v: Vec<f32>| {
            Tensor::from_data(
                TensorData::new(v, [max_positions, half]),
                (device, burn::tensor::DType::F32),
            )
        };
        Self {
            cos: table(cos),
            sin: table(sin),
        }
    }

    /// `1 / θ^(2j / head_dim)` for `j < head_dim / 2`, rounded as f32 (Hugging Face's `inv_freq`).
    pub fn inv_freq(head_dim: usize, theta: f64) -> Vec<f32> {
        (0..head_dim / 2)
            .map(|j| 1.0f32 / (theta as f32).powf((2 * j) as f32 / head_dim as f32))
            .collect()
    }

    /// The `(cos, sin)` tables, each `[max_positions, head_dim / 2]`, f32.
    pub fn tables(&self) -> (&Tensor<2>, &Tensor<2>) {
        (&self.cos, &self.sin)
    }

    /// Longest supported position + 1.
    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// The tables as the attention ops take them.
    pub fn rope(&self) -> Rope<'_> {
        Rope {
            cos: &self.cos,
            sin: &self.sin,
        }
    }

    /// Rotates `x [num_tokens, heads, head_dim]` by each token's position (`positions [num_tokens]`).
    pub fn apply(&self, x: Tensor<3>, positions: Tensor<1, Int>) -> Tensor<3> {
        cubecl_kernels::attention::reference::apply_rope(x, self.rope(), positions)
    }
}
