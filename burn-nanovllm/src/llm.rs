//! `LLM`: load a checkpoint folder once, then generate for batches of prompts.

use std::path::{Path, PathBuf};

use burn::tensor::{DType, Device};
use cubecl_kernels::DeviceKind;
use model_qwen2::{
    AttentionMetadata, ChatMessage, KvCache, LogitsRows, Qwen2Model, Qwen2Tokenizer,
};

use crate::error::{LlmError, Result};
use crate::sampling::{Sampler, SamplingParams};

/// Engine options fixed at load time.
#[derive(Clone, Debug)]
pub struct LlmOptions {
    /// Where the model runs.
    pub device: DeviceKind,
    /// Compute dtype; default f32 on CPUs, bf16 on GPUs.
    pub dtype: Option<DType>,
    /// Tokens per KV-cache block.
    pub block_size: usize,
    /// Longest prompt + completion; default the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
}

impl Default for LlmOptions {
    fn default() -> Self {
        Self {
            device: DeviceKind::Cpu,
            dtype: None,
            block_size: 16,
            max_model_len: None,
        }
    }
}

/// A prompt as text or as token ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Raw text, tokenized as is.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
}

impl From<&str> for Prompt {
    fn from(s: &str) -> Self {
        Self::Text(s.to_string())
    }
}

/// Why a completion stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was generated.
    Stop,
    /// `max_tokens` or `max_model_len` was reached.
    Length,
}

/// The result of one prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// The prompt's token ids.
    pub prompt_token_ids: Vec<u32>,
    /// Generated ids (the end-of-sequence token included when it stopped generation).
    pub token_ids: Vec<u32>,
    /// Decoded text of `token_ids` without special tokens, when a tokenizer is present.
    pub text: Option<String>,
    /// Why generation stopped.
    pub finish_reason: FinishReason,
}

/// A loaded model with its tokenizer, ready to generate (vLLM's `LLM`).
pub struct LLM {
    model: Qwen2Model,
    tokenizer: Option<Qwen2Tokenizer>,
    device: Device,
    eos_ids: Vec<u32>,
    block_size: usize,
    max_model_len: usize,
}

impl LLM {
    /// Loads the checkpoint folder `dir` (config, weights, tokenizer when present).
    pub fn new(dir: impl AsRef<Path>, options: LlmOptions) -> Result<Self> {
        let dir = dir.as_ref();
        let device = options.device.device()?;
        let dtype = options.dtype.unwrap_or(match options.device {
            DeviceKind::Cuda(_) => DType::BF16,
            _ => DType::F32,
        });
        let model = Qwen2Model::from_pretrained(dir, dtype, &device)?;
        Self::with_model(model, dir, device, options)
    }

    /// Wraps an already built model (e.g. [`Qwen2Model::dummy`]); `dir` is searched for the
    /// tokenizer and `generation_config.json`.
    pub fn with_model(
        model: Qwen2Model,
        dir: &Path,
        device: Device,
        options: LlmOptions,
    ) -> Result<Self> {
        let tokenizer = if dir.join("tokenizer.json").exists() {
            Some(Qwen2Tokenizer::from_dir(dir)?)
        } else {
            None
        };
        let mut eos_ids = model.config.eos_token_ids.clone();
        for id in generation_eos_ids(&dir.join("generation_config.json"))? {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let limit = model.config.max_position_embeddings;
        let max_model_len = options.max_model_len.unwrap_or(limit);
        if max_model_len > limit {
            return Err(LlmError::Invalid(format!(
                "max_model_len {max_model_len} exceeds the model's max_position_embeddings {limit}"
            )));
        }
        if options.block_size == 0 {
            return Err(LlmError::Invalid("block_size must be positive".into()));
        }
        Ok(Self {
            model,
            tokenizer,
            device,
            eos_ids,
            block_size: options.block_size,
            max_model_len,
        })
    }

    /// The model.
    pub fn model(&self) -> &Qwen2Model {
        &self.model
    }

    /// The tokenizer, when the folder has one.
    pub fn tokenizer(&self) -> Option<&Qwen2Tokenizer> {
        self.tokenizer.as_ref()
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Renders a single user message through the chat template, ready to generate from.
    pub fn chat_prompt(&self, user: &str) -> Result<Prompt> {
        let tok = self.tokenizer.as_ref().ok_or(LlmError::NoTokenizer)?;
        Ok(Prompt::Text(tok.apply_chat_template(
            &[ChatMessage::new("user", user)],
            true,
        )?))
    }

    /// Generates a completion for every prompt (one batch: prefill together, then decode the
    /// unfinished sequences together).
    pub fn generate(&self, prompts: &[Prompt], params: &SamplingParams) -> Result<Vec<Completion>> {
        let prompt_ids = prompts
            .iter()
            .map(|p| self.tokenize(p))
            .collect::<Result<Vec<_>>>()?;
        for (i, ids) in prompt_ids.iter().enumerate() {
            if ids.is_empty() {
                return Err(LlmError::Invalid(format!("prompt {i} is empty")));
            }
            if ids.len() >= self.max_model_len {
                return Err(LlmError::PromptTooLong {
                    index: i,
                    len: ids.len(),
                    max_model_len: self.max_model_len,
                });
            }
        }
        if prompt_ids.is_empty() {
            return Ok(Vec::new());
        }
        let bs = self.block_size;
        let budget = |len: usize| (len + params.max_tokens).min(self.max_model_len);
        let mut next_block = 0u32;
        let mut seqs: Vec<Running> = prompt_ids
            .into_iter()
            .map(|ids| {
                let n = budget(ids.len()).div_ceil(bs) as u32;
                let table = (next_block..next_block + n).collect();
                next_block += n;
                Running {
                    prompt_len: ids.len(),
                    tokens: ids,
                    table,
                    cached: 0,
                    finish: None,
                }
            })
            .collect();
        let mut cache = KvCache::new(
            &self.model.config,
            next_block as usize,
            bs,
            self.model.dtype(),
            &self.device,
        )?;
        let mut sampler = Sampler::new(params.seed);
        loop {
            let active: Vec<usize> = (0..seqs.len())
                .filter(|&i| seqs[i].finish.is_none())
                .collect();
            if active.is_empty() || params.max_tokens == 0 {
                break;
            }
            let ids: Vec<u32> = active
                .iter()
                .flat_map(|&i| seqs[i].tokens[seqs[i].cached..].to_vec())
                .collect();
            let meta = AttentionMetadata::new(
                active
                    .iter()
                    .map(|&i| seqs[i].tokens.len() - seqs[i].cached)
                    .collect(),
                active.iter().map(|&i| seqs[i].tokens.len()).collect(),
                active.iter().map(|&i| seqs[i].table.clone()).collect(),
                bs,
                &self.device,
            )?;
            let input = self.model.input_ids(&ids, &self.device)?;
            let logits = self
                .model
                .forward(input, &meta, &mut cache, LogitsRows::LastPerSequence);
            let next = sampler.sample(logits, params.temperature);
            for (&i, token) in active.iter().zip(next) {
                let s = &mut seqs[i];
                s.cached = s.tokens.len();
                s.tokens.push(token);
                let generated = s.tokens.len() - s.prompt_len;
                if !params.ignore_eos && self.eos_ids.contains(&token) {
                    s.finish = Some(FinishReason::Stop);
                } else if generated >= params.max_tokens || s.tokens.len() >= self.max_model_len {
                    s.finish = Some(FinishReason::Length);
                }
            }
        }
        seqs.into_iter()
            .map(|s| {
                let token_ids = s.tokens[s.prompt_len..].to_vec();
                let text = match &self.tokenizer {
                    Some(t) => Some(t.decode(&token_ids, true)?),
                    None => None,
                };
                Ok(Completion {
                    prompt_token_ids: s.tokens[..s.prompt_len].to_vec(),
                    token_ids,
                    text,
                    finish_reason: s.finish.unwrap_or(FinishReason::Length),
                })
            })
            .collect()
    }

    fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        match prompt {
            Prompt::Tokens(ids) => Ok(ids.clone()),
            Prompt::Text(text) => Ok(self
                .tokenizer
                .as_ref()
                .ok_or(LlmError::NoTokenizer)?
                .encode(text)?),
        }
    }
}

struct Running {
    prompt_len: usize,
    tokens: Vec<u32>,
    table: Vec<u32>,
    cached: usize,
    finish: Option<FinishReason>,
}

/// `eos_token_id` of `generation_config.json` (a number or a list), if the file exists.
fn generation_eos_ids(path: &PathBuf) -> Result<Vec<u32>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| LlmError::Invalid(format!("{}: {e}", path.display())))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| LlmError::Invalid(format!("{}: {e}", path.display())))?;
    Ok(match &json["eos_token_id"] {
        serde_json::Value::Number(n) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
        serde_json::Value::Array(a) => a
            .iter()
            .filter_map(|v| v.as_u64())
            .map(|v| v as u32)
            .collect(),
        _ => Vec::new(),
    })
}
