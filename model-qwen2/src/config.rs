//! `config.json` of a Hugging Face Qwen2 / Qwen2.5 / Qwen3 checkpoint, read once and checked.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::{ModelError, Result};

/// The smallest head dimension the attention kernels take.
pub const MIN_HEAD_DIM: usize = 8;
/// The largest head dimension the attention kernels take.
pub const MAX_HEAD_DIM: usize = 256;

/// The model family, from `architectures[0]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Architecture {
    /// `Qwen2ForCausalLM` (Qwen2, Qwen2.5): q/k/v bias, no q/k norm.
    Qwen2,
    /// `Qwen3ForCausalLM`: per-head q/k RMSNorm before RoPE, explicit `head_dim`, no bias.
    Qwen3,
}

/// The hyper-parameters of a Qwen2-family checkpoint.
///
/// Parsed from `config.json` by [`Qwen2Config::from_file`] / [`Qwen2Config::from_json`], which
/// refuse settings this implementation does not support (another architecture, sliding-window
/// attention switched on, RoPE scaling, an activation other than SiLU), naming the field.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Qwen2Config {
    /// Model family.
    pub architecture: Architecture,
    /// Vocabulary rows of the embedding and LM head.
    pub vocab_size: usize,
    /// Residual stream width `H`.
    pub hidden_size: usize,
    /// MLP width `I`.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA).
    pub num_key_value_heads: usize,
    /// Per-head width (explicit in Qwen3; `hidden_size / num_attention_heads` otherwise).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Longest sequence the model supports.
    pub max_position_embeddings: usize,
    /// LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias.
    pub attention_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Token ids that end generation (from `config.json`; `generation_config.json` may add more).
    pub eos_token_ids: Vec<u32>,
    /// Begin-of-sequence id, if any.
    pub bos_token_id: Option<u32>,
    /// dtype the checkpoint was saved in (`torch_dtype`/`dtype`), if stated.
    pub torch_dtype: Option<String>,
}

#[derive(Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    attention_bias: Option<bool>,
    #[serde(default)]
    use_sliding_window: bool,
    hidden_act: Option<String>,
    eos_token_id: Option<Value>,
    bos_token_id: Option<Value>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
}

fn default_eps() -> f64 {
    1e-6
}

fn default_max_pos() -> usize {
    32768
}

impl Qwen2Config {
    /// Reads and checks `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                ModelError::MissingFile(path.to_path_buf())
            } else {
                ModelError::Io {
                    path: path.to_path_buf(),
                    source,
                }
            }
        })?;
        Self::from_json(&text).map_err(|e| match e {
            ModelError::Parse { message, .. } => ModelError::Parse {
                path: path.to_path_buf(),
                message,
            },
            other => other,
        })
    }

    /// Parses and checks the text of a `config.json`: every field the kernels depend on is in
    /// a range they support, or the error names it.
    pub fn from_json(text: &str) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| ModelError::Parse {
            path: "config.json".into(),
            message: e.to_string(),
        })?;
        let arch_name = raw
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .ok_or_else(|| {
                ModelError::unsupported(
                    "architectures",
                    "(missing)",
                    "expected Qwen2ForCausalLM or Qwen3ForCausalLM",
                )
            })?;
        let architecture = match arch_name.as_str() {
            "Qwen2ForCausalLM" => Architecture::Qwen2,
            "Qwen3ForCausalLM" => Architecture::Qwen3,
            other => {
                return Err(ModelError::unsupported(
                    "architectures",
                    other,
                    "supported: Qwen2ForCausalLM, Qwen3ForCausalLM",
                ));
            }
        };
        for (field, value) in [
            ("vocab_size", raw.vocab_size),
            ("hidden_size", raw.hidden_size),
            ("intermediate_size", raw.intermediate_size),
            ("num_hidden_layers", raw.num_hidden_layers),
        ] {
            if value == 0 {
                return Err(ModelError::unsupported(field, 0, "must be at least 1"));
            }
        }
        if raw.vocab_size > u32::MAX as usize {
            return Err(ModelError::unsupported(
                "vocab_size",
                raw.vocab_size,
                "token ids are 32-bit",
            ));
        }
        if raw.use_sliding_window {
            return Err(ModelError::unsupported(
                "use_sliding_window",
                true,
                "sliding-window attention is not implemented",
            ));
        }
        if let Some(act) = &raw.hidden_act
            && act != "silu"
        {
            return Err(ModelError::unsupported(
                "hidden_act",
                act,
                "only silu is supported",
            ));
        }
        check_rope_scaling("rope_scaling", raw.rope_scaling.as_ref())?;
        check_rope_scaling("rope_parameters", raw.rope_parameters.as_ref())?;
        let rope_theta = raw
            .rope_theta
            .or_else(|| raw.rope_parameters.as_ref()?.get("rope_theta")?.as_f64())
            .unwrap_or(10000.0);

        let num_key_value_heads = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if raw.num_attention_heads == 0
            || num_key_value_heads == 0
            || !raw.num_attention_heads.is_multiple_of(num_key_value_heads)
        {
            return Err(ModelError::unsupported(
                "num_key_value_heads",
                num_key_value_heads,
                format!(
                    "must divide num_attention_heads = {}",
                    raw.num_attention_heads
                ),
            ));
        }
        let head_dim = match (architecture, raw.head_dim) {
            (_, Some(d)) => d,
            (_, None) => {
                if !raw.hidden_size.is_multiple_of(raw.num_attention_heads) {
                    return Err(ModelError::unsupported(
                        "head_dim",
                        "(missing)",
                        "hidden_size is not a multiple of num_attention_heads",
                    ));
                }
                raw.hidden_size / raw.num_attention_heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(ModelError::unsupported(
                "head_dim",
                head_dim,
                "RoPE needs an even head_dim",
            ));
        }
        // The attention kernels' range, every size of it covered by the shape sweep (8, 16, 18,
        // 24 … 256) on the CPU runtime and CUDA; beyond 256 the tiles outgrow shared memory.
        if !(MIN_HEAD_DIM..=MAX_HEAD_DIM).contains(&head_dim) {
            return Err(ModelError::unsupported(
                "head_dim",
                head_dim,
                format!("the attention kernels take head_dim {MIN_HEAD_DIM} to {MAX_HEAD_DIM}"),
            ));
        }
        let attention_bias = raw
            .attention_bias
            .unwrap_or(architecture == Architecture::Qwen2);
        Ok(Self {
            architecture,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps,
            rope_theta,
            max_position_embeddings: raw.max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings,
            attention_bias,
            qk_norm: architecture == Architecture::Qwen3,
            eos_token_ids: token_ids(raw.eos_token_id.as_ref()),
            bos_token_id: token_ids(raw.bos_token_id.as_ref()).first().copied(),
            torch_dtype: raw.torch_dtype.or(raw.dtype),
        })
    }

    /// Width of the query projection, `num_attention_heads * head_dim`.
    pub fn q_size(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Width of the key (and value) projection, `num_key_value_heads * head_dim`.
    pub fn kv_size(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }
}

/// RoPE scaling (YaRN, dynamic NTK, linear, …) changes the positional encoding; only the
/// plain ("default") rotary embedding is implemented.
fn check_rope_scaling(field: &str, value: Option<&Value>) -> Result<()> {
    let Some(Value::Object(map)) = value else {
        return Ok(());
    };
    for key in ["rope_type", "type"] {
        if let Some(kind) = map.get(key) {
            let kind = kind.as_str().unwrap_or_default();
            if kind != "default" {
                return Err(ModelError::unsupported(
                    format!("{field}.{key}"),
                    kind,
                    "only the default rotary embedding is implemented",
                ));
            }
        }
    }
    Ok(())
}

fn token_ids(value: Option<&Value>) -> Vec<u32> {
    match value {
        Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|v| v.as_u64())
            .map(|v| v as u32)
            .collect(),
        _ => Vec::new(),
    }
}
