//! Per-request sampling parameters and stop conditions (vLLM's `SamplingParams`).

use crate::error::{EngineError, Result};
use crate::structured_output::StructuredOutput;

/// Most top-`n` log-probabilities a request may ask for.
pub const MAX_LOGPROBS: usize = 20;

/// Most stop strings a request may give (OpenAI allows 4; vLLM sets no bound).
pub const MAX_STOP_STRINGS: usize = 256;

/// Most bytes a request's stop strings may hold together: their search runs on the engine
/// thread at every token, and the longest sets how much streamed text is held back.
pub const MAX_STOP_BYTES: usize = 16 << 10;

/// Most stop token ids a request may give.
pub const MAX_STOP_TOKEN_IDS: usize = 1024;

/// Most `logit_bias` entries a request may give (OpenAI's bound).
pub const MAX_LOGIT_BIAS: usize = 300;

/// Most `bad_words` a request may give, and most tokens in all of them.
pub const MAX_BAD_WORDS: usize = 256;
/// Most tokens of a request's `bad_words` together.
pub const MAX_BAD_WORD_TOKENS: usize = 4096;

/// How to pick tokens and when to stop, per request.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax), and so does any below 1e-5 (vLLM's rule:
    /// `cubecl_kernels::sampling::GREEDY_BELOW`).
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
    /// Added to these tokens' logits before sampling (OpenAI's `logit_bias`): token id and
    /// bias in [−100, 100], at most [`MAX_LOGIT_BIAS`] of them.
    pub logit_bias: Vec<(u32, f32)>,
    /// Only these tokens may be drawn (vLLM's `allowed_token_ids`); `None` allows every one.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// Token sequences never generated (vLLM's `bad_words`, as token ids): a one-token word is
    /// never drawn, a longer one's last token not when the output ends with the rest of it.
    pub bad_words: Vec<Vec<u32>>,
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
            logit_bias: Vec::new(),
            allowed_token_ids: None,
            bad_words: Vec::new(),
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

    /// The tokens a row may not draw next after `output` (a one-token bad word always; a longer
    /// one's last token when `output` ends with the rest of it).
    pub fn bad_word_bans(&self, output: &[u32]) -> Vec<u32> {
        self.bad_words
            .iter()
            .filter_map(|w| {
                let (last, rest) = w.split_last()?;
                output.ends_with(rest).then_some(*last)
            })
            .collect()
    }

    /// True if the bans depend on the output so far (a bad word of several tokens).
    pub fn bans_follow_output(&self) -> bool {
        self.bad_words.iter().any(|w| w.len() > 1)
    }

    /// Every token id the request names (logit bias, allowed, bad words, stop ids): each must
    /// be in the model's vocabulary.
    pub fn token_ids(&self) -> impl Iterator<Item = (&'static str, u32)> + '_ {
        let bias = self.logit_bias.iter().map(|&(t, _)| ("logit_bias", t));
        let allowed = self
            .allowed_token_ids
            .iter()
            .flatten()
            .map(|&t| ("allowed_token_ids", t));
        let bad = self.bad_words.iter().flatten().map(|&t| ("bad_words", t));
        let stop = self.stop_token_ids.iter().map(|&t| ("stop_token_ids", t));
        bias.chain(allowed).chain(bad).chain(stop)
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
        let stop_bytes: usize = self.stop.iter().map(String::len).sum();
        if self.stop.len() > MAX_STOP_STRINGS || stop_bytes > MAX_STOP_BYTES {
            return Err(p(
                "stop",
                format!(
                    "{} stop strings of {stop_bytes} bytes: at most {MAX_STOP_STRINGS} strings \
                     of {MAX_STOP_BYTES} bytes together",
                    self.stop.len()
                ),
            ));
        }
        for (field, unit, n, most) in [
            (
                "stop_token_ids",
                "ids",
                self.stop_token_ids.len(),
                MAX_STOP_TOKEN_IDS,
            ),
            (
                "logit_bias",
                "entries",
                self.logit_bias.len(),
                MAX_LOGIT_BIAS,
            ),
        ] {
            if n > most {
                return Err(p(field, format!("{n} {unit}: at most {most}")));
            }
        }
        if let Some((t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(p(
                "logit_bias",
                format!("token {t}: the bias must be in [-100, 100], got {b}"),
            ));
        }
        if self.allowed_token_ids.as_ref().is_some_and(Vec::is_empty) {
            return Err(p(
                "allowed_token_ids",
                "must hold at least one token".to_string(),
            ));
        }
        let bad_tokens: usize = self.bad_words.iter().map(Vec::len).sum();
        if self.bad_words.len() > MAX_BAD_WORDS || bad_tokens > MAX_BAD_WORD_TOKENS {
            return Err(p(
                "bad_words",
                format!(
                    "{} words of {bad_tokens} tokens: at most {MAX_BAD_WORDS} words of \
                     {MAX_BAD_WORD_TOKENS} tokens together",
                    self.bad_words.len()
                ),
            ));
        }
        if self.bad_words.iter().any(Vec::is_empty) {
            return Err(p("bad_words", "a bad word must not be empty".to_string()));
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
