//! The output side of a step (vLLM's output processor): a request's drawn token through its
//! stop conditions (end-of-sequence and stop ids, stop strings, `min_tokens`, `max_tokens`,
//! `max_model_len`) and its incremental text into a [`RequestOutput`]. With overlapped
//! scheduling it runs one step behind the step loop (`engine.rs`), on tokens whose sequences
//! already hold a placeholder for the next draw.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use model_qwen2::Qwen2Tokenizer;

use crate::detokenizer::Detokenizer;
use crate::error::{EngineError, Result};
use crate::output::{RequestMetrics, RequestOutput};
use crate::sampler::TokenLogprobs;
use crate::sampling_params::SamplingParams;
use crate::scheduler::Scheduler;
use crate::sequence::{FinishReason, RequestId};

/// Stop conditions and text of the engine's requests.
pub(crate) struct OutputProcessor {
    tokenizer: Option<Arc<Qwen2Tokenizer>>,
    eos_token_ids: Vec<u32>,
    max_model_len: usize,
    /// Requests whose text is tracked (streaming, or stop strings).
    detokenizers: HashMap<RequestId, Detokenizer>,
}

impl OutputProcessor {
    pub(crate) fn new(
        tokenizer: Option<Arc<Qwen2Tokenizer>>,
        eos_token_ids: Vec<u32>,
        max_model_len: usize,
    ) -> Self {
        Self {
            tokenizer,
            eos_token_ids,
            max_model_len,
            detokenizers: HashMap::new(),
        }
    }

    /// The tokenizer, when the model folder has one.
    pub(crate) fn tokenizer(&self) -> Option<&Arc<Qwen2Tokenizer>> {
        self.tokenizer.as_ref()
    }

    /// End-of-sequence ids.
    pub(crate) fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Tracks `id`'s text from now on.
    pub(crate) fn track_text(&mut self, id: RequestId, params: &SamplingParams) {
        self.detokenizers.insert(id, Detokenizer::new(params));
    }

    /// Forgets every request (the engine failed).
    pub(crate) fn clear(&mut self) {
        self.detokenizers.clear();
    }

    /// Applies the stop conditions to the token drawn at `position` (in place already; later
    /// entries are placeholders of draws in flight). `grammar_complete`: the request's
    /// structured output is complete with this token (it stops).
    pub(crate) fn accept_token(
        &mut self,
        scheduler: &mut Scheduler,
        id: RequestId,
        position: usize,
        logprobs: Option<TokenLogprobs>,
        grammar_complete: bool,
    ) -> Result<Option<RequestOutput>> {
        let max_model_len = self.max_model_len;
        let seq = scheduler.get_mut(id).expect("sampled sequence");
        let token = seq.token_ids[position];
        seq.first_token_time.get_or_insert_with(Instant::now);
        let params = seq.params.clone();
        let n_out = position + 1 - seq.num_prompt_tokens;
        let may_stop = n_out >= params.min_tokens;
        let mut reason = None;
        if may_stop
            && ((!params.ignore_eos && self.eos_token_ids.contains(&token))
                || params.stop_token_ids.contains(&token))
        {
            reason = Some(FinishReason::Stop);
        }
        if let Some(detok) = self.detokenizers.get_mut(&id) {
            let tokenizer = self.tokenizer.as_ref().ok_or(EngineError::NoTokenizer)?;
            let seq = scheduler.get(id).expect("sampled sequence");
            let output = &seq.token_ids[seq.num_prompt_tokens..=position];
            let stopped = detok.update(tokenizer, output, &params)?;
            if stopped && may_stop && reason.is_none() {
                reason = Some(FinishReason::Stop);
            }
        }
        if reason.is_none() && grammar_complete {
            reason = Some(FinishReason::Stop);
        }
        if reason.is_none() && (n_out >= params.max_tokens || position + 1 >= max_model_len) {
            reason = Some(FinishReason::Length);
        }
        let new_text = match (&reason, self.detokenizers.get_mut(&id)) {
            (None, Some(detok)) => detok.take_delta(false),
            _ => String::new(),
        };
        let logprobs: Vec<_> = logprobs.into_iter().collect();
        match reason {
            Some(reason) => {
                scheduler.finish(id, reason);
                Ok(self.finished_output(scheduler, id, vec![token], logprobs))
            }
            None => {
                let seq = scheduler.get(id).expect("sampled sequence");
                Ok(Some(RequestOutput {
                    id,
                    new_token_ids: vec![token],
                    new_text,
                    new_logprobs: logprobs,
                    finish_reason: None,
                    num_prompt_tokens: seq.num_prompt_tokens,
                    num_output_tokens: n_out,
                    num_cached_tokens: seq.num_cached_tokens,
                    metrics: None,
                }))
            }
        }
    }

    /// The final output of a finished request (taking it from the scheduler): its text's last
    /// delta, its metrics; draws still in flight for it are dropped.
    pub(crate) fn finished_output(
        &mut self,
        scheduler: &mut Scheduler,
        id: RequestId,
        new_token_ids: Vec<u32>,
        new_logprobs: Vec<TokenLogprobs>,
    ) -> Option<RequestOutput> {
        let mut seq = scheduler.take_finished(id)?;
        // Draws still in flight never become its tokens.
        let kept = seq.num_tokens() - seq.num_pending_tokens;
        seq.token_ids.truncate(kept);
        seq.num_pending_tokens = 0;
        let mut new_text = String::new();
        if let Some(mut d) = self.detokenizers.remove(&id) {
            if let Some(tokenizer) = &self.tokenizer {
                // The text is best effort here: the request has ended either way.
                let _ = d.flush(tokenizer, seq.output_token_ids(), &seq.params);
            }
            new_text = d.take_delta(true);
        }
        let now = Instant::now();
        Some(RequestOutput {
            id,
            new_token_ids,
            new_text,
            new_logprobs,
            finish_reason: seq.finish_reason.clone(),
            num_prompt_tokens: seq.num_prompt_tokens,
            num_output_tokens: seq.num_output_tokens(),
            num_cached_tokens: seq.num_cached_tokens,
            metrics: Some(RequestMetrics {
                time_to_first_token: seq.first_token_time.map(|t| t - seq.arrival),
                total_time: now - seq.arrival,
                num_preemptions: seq.num_preemptions,
            }),
        })
    }
}
