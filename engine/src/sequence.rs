//! A request as the scheduler sees it: its tokens, how many of them are in the KV cache, and
//! the blocks that hold them.

use std::sync::Arc;
use std::time::Instant;

pub use crate::request_id::RequestId;
use crate::sampling_params::SamplingParams;

/// Where a sequence is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SequenceStatus {
    /// Queued: holds no blocks (new, or preempted and waiting to be recomputed).
    Waiting,
    /// Scheduled in steps: holds the blocks of its computed tokens.
    Running,
    /// Done: holds nothing.
    Finished,
}

/// Why a request stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token or a stop string.
    Stop,
    /// `max_tokens` or `max_model_len` was reached.
    Length,
    /// The caller aborted it.
    Abort,
    /// It could not run; the message says why (its own error only: others go on).
    Error(String),
}

impl FinishReason {
    /// The OpenAI name of the reason (`stop`, `length`, `abort`, `error`).
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
            Self::Error(_) => "error",
        }
    }
}

/// One request being served.
///
/// Its tokens are `token_ids` (prompt, then output); the first `num_computed_tokens` of them
/// have keys and values in the cache, in the blocks of `block_table` (logical block `i` holds
/// tokens `i·block_size..(i + 1)·block_size`). A step computes tokens
/// `num_computed_tokens..num_computed_tokens + chunk`; when that reaches the end of
/// `token_ids`, the step samples the next token.
#[derive(Clone, Debug)]
pub struct Sequence {
    /// The request's id.
    pub id: RequestId,
    /// Waiting, running or finished.
    pub status: SequenceStatus,
    /// Prompt then generated tokens.
    pub token_ids: Vec<u32>,
    /// Length of the prompt.
    pub num_prompt_tokens: usize,
    /// Tokens whose keys and values are in the cache.
    pub num_computed_tokens: usize,
    /// Physical KV blocks, in logical order.
    pub block_table: Vec<u32>,
    /// Chained hashes of the first full blocks (`block_hashes[i]` covers tokens up to
    /// `(i + 1)·block_size`), computed as blocks fill.
    pub block_hashes: Vec<u64>,
    /// Prompt tokens served from the prefix cache at the last admission.
    pub num_cached_tokens: usize,
    /// How many times it was preempted.
    pub num_preemptions: u32,
    /// Sampling parameters and stop conditions.
    pub params: Arc<SamplingParams>,
    /// The seed of its draws.
    pub seed: u64,
    /// Why it finished.
    pub finish_reason: Option<FinishReason>,
    /// When it was added.
    pub arrival: Instant,
    /// When its first token was sampled.
    pub first_token_time: Option<Instant>,
    /// Trailing entries of `token_ids` that are placeholders for draws still on the device
    /// (overlapped scheduling: 0 or 1).
    pub num_pending_tokens: usize,
    /// Its pending token will be its last (`max_tokens` or `max_model_len`): the scheduler
    /// gives it no more tokens.
    pub final_token_pending: bool,
}

impl Sequence {
    /// A waiting sequence for `prompt`.
    pub fn new(id: RequestId, prompt: Vec<u32>, params: Arc<SamplingParams>, seed: u64) -> Self {
        Self {
            id,
            status: SequenceStatus::Waiting,
            num_prompt_tokens: prompt.len(),
            token_ids: prompt,
            num_computed_tokens: 0,
            block_table: Vec::new(),
            block_hashes: Vec::new(),
            num_cached_tokens: 0,
            num_preemptions: 0,
            params,
            seed,
            finish_reason: None,
            arrival: Instant::now(),
            first_token_time: None,
            num_pending_tokens: 0,
            final_token_pending: false,
        }
    }

    /// All tokens (prompt + output).
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// Generated tokens.
    pub fn num_output_tokens(&self) -> usize {
        self.token_ids.len() - self.num_prompt_tokens
    }

    /// Tokens still to compute before the next sample (1 for a decoding sequence).
    pub fn num_new_tokens(&self) -> usize {
        self.token_ids.len() - self.num_computed_tokens
    }

    /// The generated tokens.
    pub fn output_token_ids(&self) -> &[u32] {
        &self.token_ids[self.num_prompt_tokens..]
    }

    /// True once finished.
    pub fn is_finished(&self) -> bool {
        self.status == SequenceStatus::Finished
    }
}
