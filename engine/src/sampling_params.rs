//! Per-request sampling parameters and stop conditions (vLLM's `SamplingParams`).

use crate::error::{EngineError, Result};
use crate::structured_output::StructuredOutput;

/// Most top-`n` log-probabilities a request may ask for.
pub const MAX_LOGPROBS: usize = 20;

/// How to pick tokens and when to stop, per request.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the smallest set of most likely tokens holding this much probability, in (0, 1].
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: u32,
    /// Drop tokens less likely than `min_p` × the most likely one's probability, in [0, 1].
    pub min_p: f32,
    /// Divides positive logits (multiplies negative ones) of tokens in the prompt or the output;
    /// 1 is off, must be positive.
    pub repetition_penalty: f32,
    /// Subtracted from the logits of tokens already generated, in [−2, 2].
    pub presence_penalty: f32,
    /// Subtracted once per earlier occurrence in the output, in [−2, 2].
    pub frequency_penalty: f32,
    /// Seed of this request's draws: the same seed gives the same tokens whatever else runs.
    /// `None` draws one from the engine's seed.
    pub seed: Option<u64>,
    /// Most tokens to generate (at least 1).
    pub max_tokens: usize,
    /// Tokens to generate before end-of-sequence and stop tokens may end the request.
    pub min_tokens: usize,
    /// Strings that end generation; the text is cut before them.
    pub stop: Vec<String>,
    /// Token ids that end generation (kept in the output ids).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Keep the matched stop string in the text.
    pub include_stop_str_in_output: bool,
    /// Log-probabilities of each sampled token and the `n` most likely ones (up to
    /// [`MAX_LOGPROBS`]); `None` computes none.
    pub logprobs: Option<usize>,
    /// Leave special tokens out of the text.
    pub skip_special_tokens: bool,
    /// Constrain the output to a JSON schema, a regular expression, a choice or a grammar
    /// (see [`crate::structured_output`]); the request ends when the constraint is complete.
    pub structured_output: Option<StructuredOutput>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: 16,
            min_tokens: 0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            include_stop_str_in_output: false,
            logprobs: None,
            skip_special_tokens: true,
            structured_output: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of up to `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> Self {
        Self {
            temperature: 0.0,
            max_tokens,
            ..Self::default()
        }
    }

    /// Checks every field against its range; the error names the field.
    pub fn validate(&self) -> Result<()> {
        let p = EngineError::param;
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(p(
                "temperature",
                format!("must be a finite number ≥ 0, got {}", self.temperature),
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(p("top_p", format!("must be in (0, 1], got {}", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(p("min_p", format!("must be in [0, 1], got {}", self.min_p)));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(p(
                "repetition_penalty",
                format!("must be positive, got {}", self.repetition_penalty),
            ));
        }
        for (field, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(p(field, format!("must be in [-2, 2], got {v}")));
            }
        }
        if self.max_tokens == 0 {
            return Err(p("max_tokens", "must be at least 1".to_string()));
        }
        if self.min_tokens > self.max_tokens {
            return Err(p(
                "min_tokens",
                format!(
                    "{} is more than max_tokens = {}",
                    self.min_tokens, self.max_tokens
                ),
            ));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(p("stop", "stop strings must not be empty".to_string()));
        }
        if let Some(n) = self.logprobs
            && n > MAX_LOGPROBS
        {
            return Err(p(
                "logprobs",
                format!("at most {MAX_LOGPROBS} top log-probabilities, got {n}"),
            ));
        }
        Ok(())
    }

    /// True if any penalty is active (the sampler then needs the token history).
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}
