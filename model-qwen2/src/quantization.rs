//! Weight quantisation at load (vLLM's `quantization`): [`Quantization`] and
//! [`Qwen2Model::quantize_weights`].

use crate::error::{ModelError, Result};
use crate::model::Qwen2Model;

/// How a model's linear layers store their weights (vLLM's `--quantization`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum Quantization {
    /// The checkpoint's weights in the model's dtype.
    #[default]
    #[serde(rename = "none")]
    None,
    /// FP8 E4M3 weights with one scale per weight tensor (vLLM's online FP8; per output
    /// feature with `BURN_NANOVLLM_FP8_SCALES=row`), quantised from the 16-bit checkpoint at
    /// load; activations quantised on the fly, per tensor (per token in one-row,
    /// batch-invariant and over-1,024-row products; [`cubecl_kernels::fp8_linear()`]). The
    /// layers' q/k/v, o, gate/up and down products; the embedding and the LM head stay in the
    /// model's dtype.
    #[serde(rename = "fp8")]
    Fp8,
}

impl std::str::FromStr for Quantization {
    type Err = ModelError;

    /// vLLM's names: `none` (no quantisation) or `fp8`.
    fn from_str(name: &str) -> Result<Self> {
        match name {
            "none" => Ok(Self::None),
            "fp8" => Ok(Self::Fp8),
            _ => Err(ModelError::unsupported(
                "quantization",
                name,
                "expected none or fp8",
            )),
        }
    }
}

impl Quantization {
    /// vLLM's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Fp8 => "fp8",
        }
    }
}

impl Qwen2Model {
    /// Quantises the layers' products as `quantization` says, layer by layer (each layer's
    /// 16-bit weights are dropped as its FP8 ones are made; the codes go to persistent memory
    /// like the weights, [`cubecl_kernels::persistent`]). Errors, before touching a weight,
    /// where the device cannot run FP8 products ([`cubecl_kernels::fp8_linear_support`]).
    pub fn quantize_weights(&mut self, quantization: Quantization) -> Result<()> {
        if quantization == Quantization::None {
            return Ok(());
        }
        let device = self.embed_tokens.val().device();
        cubecl_kernels::fp8_linear_support(&device)?;
        let scaling = cubecl_kernels::Fp8Scaling::for_weights();
        for layer in &mut self.layers {
            cubecl_kernels::persistent(&device, layer, |layer| {
                for linear in [
                    &mut layer.self_attn.qkv_proj,
                    &mut layer.self_attn.o_proj,
                    &mut layer.mlp.gate_up_proj,
                    &mut layer.mlp.down_proj,
                ] {
                    linear.quantize_fp8(scaling)?;
                }
                Ok::<_, ModelError>(())
            })?;
        }
        // The 16-bit weights' buffers go back to the device.
        device
            .sync()
            .map_err(|e| ModelError::Input(format!("device: {e:?}")))?;
        device.memory_cleanup();
        Ok(())
    }

    /// How the layers' products store their weights.
    pub fn quantization(&self) -> Quantization {
        match self.layers.first() {
            Some(l) if l.self_attn.qkv_proj.fp8_scales.is_some() => Quantization::Fp8,
            _ => Quantization::None,
        }
    }
}
