//! `LLM`: vLLM's offline entry point. Loads a model once, then generates for batches of
//! prompts through the engine's step loop, with one `SamplingParams` for all prompts or one
//! each, and a progress bar on terminals.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::Path;

use engine::{
    EngineConfig, FinishReason, LLMEngine, RequestId, RequestMetrics, RequestOutput,
    SamplingParams, TokenLogprobs,
};
use indicatif::{ProgressBar, ProgressStyle};
use model_qwen2::ChatMessage;

use crate::error::{LlmError, Result};

/// A prompt as text, token ids, or a conversation (rendered with the chat template).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Raw text, tokenized as is.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Messages, rendered through the checkpoint's chat template with a generation prompt.
    Chat(Vec<ChatMessage>),
}

impl From<&str> for Prompt {
    fn from(s: &str) -> Self {
        Self::Text(s.to_string())
    }
}

impl From<String> for Prompt {
    fn from(s: String) -> Self {
        Self::Text(s)
    }
}

impl From<Vec<u32>> for Prompt {
    fn from(ids: Vec<u32>) -> Self {
        Self::Tokens(ids)
    }
}

/// Sampling parameters for a `generate` call: one set for every prompt, or one per prompt.
#[derive(Clone, Copy, Debug)]
pub enum ParamsFor<'a> {
    /// The same parameters for every prompt.
    All(&'a SamplingParams),
    /// One set per prompt, in order.
    Each(&'a [SamplingParams]),
}

impl<'a> From<&'a SamplingParams> for ParamsFor<'a> {
    fn from(p: &'a SamplingParams) -> Self {
        Self::All(p)
    }
}

impl<'a> From<&'a [SamplingParams]> for ParamsFor<'a> {
    fn from(p: &'a [SamplingParams]) -> Self {
        Self::Each(p)
    }
}

impl<'a> From<&'a Vec<SamplingParams>> for ParamsFor<'a> {
    fn from(p: &'a Vec<SamplingParams>) -> Self {
        Self::Each(p)
    }
}

/// The result of one prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// The prompt's token ids (empty if it could not be tokenized).
    pub prompt_token_ids: Vec<u32>,
    /// Generated ids (a stop or end-of-sequence token included).
    pub token_ids: Vec<u32>,
    /// Text of the generated tokens (cut at a stop string), when the model has a tokenizer.
    pub text: Option<String>,
    /// Why generation stopped; `Error` holds this request's own failure.
    pub finish_reason: FinishReason,
    /// Log-probabilities of each generated token, when asked for.
    pub logprobs: Vec<TokenLogprobs>,
    /// Prompt tokens served from the prefix cache.
    pub num_cached_tokens: usize,
    /// Time to first token and total time.
    pub metrics: Option<RequestMetrics>,
}

/// A loaded model and its engine, ready to generate.
pub struct LLM {
    engine: LLMEngine,
    progress: bool,
}

impl LLM {
    /// Loads the checkpoint folder `dir` with the engine options `config`.
    pub fn new(dir: impl AsRef<Path>, config: EngineConfig) -> Result<Self> {
        Ok(Self::from_engine(LLMEngine::new(dir, config)?))
    }

    /// Wraps an engine (e.g. one built over a dummy model).
    pub fn from_engine(engine: LLMEngine) -> Self {
        Self {
            engine,
            progress: std::io::stderr().is_terminal(),
        }
    }

    /// Shows (or hides) the progress bar of `generate`; on by default on a terminal.
    pub fn set_progress(&mut self, on: bool) {
        self.progress = on;
    }

    /// The engine (streaming API, limits, statistics).
    pub fn engine(&self) -> &LLMEngine {
        &self.engine
    }

    /// The engine, mutably (streaming API).
    pub fn engine_mut(&mut self) -> &mut LLMEngine {
        &mut self.engine
    }

    /// A single user message, rendered through the chat template.
    pub fn chat_prompt(&self, user: &str) -> Prompt {
        Prompt::Chat(vec![ChatMessage::new("user", user)])
    }

    /// Token ids of a prompt.
    pub fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let tokenizer = || self.engine.tokenizer().ok_or(LlmError::NoTokenizer);
        Ok(match prompt {
            Prompt::Tokens(ids) => ids.clone(),
            Prompt::Text(text) => tokenizer()?.encode(text)?,
            Prompt::Chat(messages) => {
                let t = tokenizer()?;
                t.encode(&t.apply_chat_template(messages, true)?)?
            }
        })
    }

    /// Generates a completion for every prompt, in order. A prompt that cannot run (too
    /// long, invalid parameters, …) gets a completion with [`FinishReason::Error`]; the others
    /// go on. An `Err` is a device or model failure.
    pub fn generate<'a>(
        &mut self,
        prompts: &[Prompt],
        params: impl Into<ParamsFor<'a>>,
    ) -> Result<Vec<Completion>> {
        self.generate_streaming(prompts, params, |_, _| {})
    }

    /// [`generate`](Self::generate), calling `on_output(prompt index, output)` with every
    /// step's output as it comes (new tokens; new text too after
    /// `engine_mut().set_stream_text(true)`).
    pub fn generate_streaming<'a>(
        &mut self,
        prompts: &[Prompt],
        params: impl Into<ParamsFor<'a>>,
        mut on_output: impl FnMut(usize, &RequestOutput),
    ) -> Result<Vec<Completion>> {
        let params = params.into();
        if let ParamsFor::Each(each) = params
            && each.len() != prompts.len()
        {
            return Err(LlmError::Invalid(format!(
                "{} prompts but {} sampling parameter sets",
                prompts.len(),
                each.len()
            )));
        }
        let mut results: Vec<Completion> = Vec::with_capacity(prompts.len());
        let mut index: HashMap<RequestId, usize> = HashMap::new();
        let mut tracked = Vec::with_capacity(prompts.len());
        for (i, prompt) in prompts.iter().enumerate() {
            let p = match params {
                ParamsFor::All(p) => p,
                ParamsFor::Each(each) => &each[i],
            };
            let mut completion = Completion {
                prompt_token_ids: Vec::new(),
                token_ids: Vec::new(),
                text: None,
                finish_reason: FinishReason::Length,
                logprobs: Vec::new(),
                num_cached_tokens: 0,
                metrics: None,
            };
            let added = self.tokenize(prompt).and_then(|ids| {
                completion.prompt_token_ids = ids.clone();
                Ok(self.engine.add_request(ids, p.clone())?)
            });
            match added {
                Ok(id) => {
                    index.insert(id, i);
                }
                Err(e) => completion.finish_reason = FinishReason::Error(e.to_string()),
            }
            tracked.push(!p.stop.is_empty());
            results.push(completion);
        }
        let bar = self.progress_bar(index.len());
        let mut left = index.len();
        while left > 0 {
            let outputs = match self.engine.step() {
                Ok(o) => o,
                Err(e) => {
                    for &id in index.keys() {
                        let _ = self.engine.abort(id);
                    }
                    return Err(e.into());
                }
            };
            for out in outputs {
                let Some(&i) = index.get(&out.id) else {
                    continue;
                };
                on_output(i, &out);
                let c = &mut results[i];
                c.token_ids.extend(&out.new_token_ids);
                c.logprobs.extend(out.new_logprobs);
                if tracked[i] {
                    c.text
                        .get_or_insert_with(String::new)
                        .push_str(&out.new_text);
                }
                c.num_cached_tokens = out.num_cached_tokens;
                if let Some(reason) = out.finish_reason {
                    c.finish_reason = reason;
                    c.metrics = out.metrics;
                    left -= 1;
                    if let Some(bar) = &bar {
                        bar.inc(1);
                    }
                }
            }
            if let Some(bar) = &bar {
                let s = self.engine.stats();
                let secs = |d: std::time::Duration| d.as_secs_f64().max(1e-9);
                bar.set_message(format!(
                    "prefill {:.0} tok/s, decode {:.0} tok/s",
                    s.prefill_tokens as f64 / secs(s.prefill_time),
                    s.decode_tokens as f64 / secs(s.decode_time)
                ));
            }
        }
        if let Some(bar) = bar {
            bar.finish_and_clear();
        }
        if let Some(tokenizer) = self.engine.tokenizer().cloned() {
            for (i, c) in results.iter_mut().enumerate() {
                if c.text.is_none() {
                    let skip = match params {
                        ParamsFor::All(p) => p.skip_special_tokens,
                        ParamsFor::Each(each) => each[i].skip_special_tokens,
                    };
                    c.text = Some(tokenizer.decode(&c.token_ids, skip)?);
                }
            }
        }
        Ok(results)
    }

    fn progress_bar(&self, n: usize) -> Option<ProgressBar> {
        if !self.progress || n == 0 {
            return None;
        }
        let bar = ProgressBar::new(n as u64);
        bar.set_style(
            ProgressStyle::with_template("Generating {bar:30} {pos}/{len} [{elapsed}<{eta}] {msg}")
                .expect("progress template"),
        );
        Some(bar)
    }
}
