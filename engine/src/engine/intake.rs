//! Request intake: a prompt checked (vocabulary, length, the pool), its constraint compiled
//! or taken compiled, queued; aborts and the end of a request.

use std::sync::Arc;

use cubecl_kernels::AttentionMetadata;
use model_qwen2::{KvCache, LogitsRows};
use rand::Rng;

use super::LLMEngine;
use crate::error::{EngineError, Result};
use crate::output::RequestOutput;
use crate::sampler;
use crate::sampling_params::SamplingParams;
use crate::sequence::{FinishReason, RequestId, Sequence};
use crate::structured_output::GrammarMatcher;

impl LLMEngine {
    /// Text of `prompt` as token ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .tokenizer()
            .ok_or(EngineError::NoTokenizer)?
            .encode(text)?)
    }

    /// Queues a request for `prompt` (token ids). Fails, without queueing, on an empty
    /// prompt, an id outside the vocabulary, a prompt of `max_model_len` tokens or more, a
    /// prompt larger than the whole KV pool, or invalid parameters.
    pub fn add_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestId> {
        self.add_compiled_request(prompt, params, None)
    }

    /// [`Self::add_request`] with the request's constraint already compiled (by
    /// [`Self::grammar_compiler`], off the engine's thread: a server compiles on a pool of its
    /// own, so that no compile ever holds up a step). `matcher` must be a fresh matcher of
    /// `params.structured_output`; without one the engine compiles it here.
    pub fn add_compiled_request(
        &mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
        matcher: Option<GrammarMatcher>,
    ) -> Result<RequestId> {
        self.check_alive()?;
        params.validate()?;
        if self.tokenizer().is_none() && !params.stop.is_empty() {
            return Err(EngineError::param(
                "stop",
                "stop strings need the model's tokenizer.json, which this model folder lacks"
                    .into(),
            ));
        }
        self.check_prompt(&prompt)?;
        let vocab_size = self.model_config.vocab_size;
        if let Some((field, t)) = params.token_ids().find(|&(_, t)| t as usize >= vocab_size) {
            return Err(EngineError::param(
                field,
                format!("token {t} is outside the vocabulary of {vocab_size}"),
            ));
        }
        let matcher = match (&params.structured_output, matcher) {
            (Some(_), Some(m)) => Some(m),
            (Some(constraint), None) => Some(self.structured.compiler()?.compile(constraint)?),
            (None, _) => None,
        };
        let bm = self.scheduler.block_manager();
        let needed = bm.blocks_for(prompt.len() + 1);
        if needed > bm.num_blocks() {
            return Err(EngineError::OutOfKvBlocks {
                tokens: prompt.len() + 1,
                needed,
                block_size: bm.block_size(),
                available: bm.num_blocks(),
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        if let Some(matcher) = matcher {
            self.structured.insert(id, matcher);
        }
        let seed = params.seed.unwrap_or_else(|| self.rng.random());
        // Text is tracked only where there is a tokenizer (stop strings without one were
        // refused above): token-id requests on such models stream ids alone.
        if self.tokenizer().is_some() && (self.stream_text || !params.stop.is_empty()) {
            self.outputs.track_text(id, &params);
        }
        self.scheduler
            .add(Sequence::new(id, prompt, Arc::new(params), seed));
        Ok(id)
    }

    /// The logits of every position of `prompt` (token ids), `[prompt.len(), vocab]` row-major
    /// f32 on the host: one scoring forward in a KV cache of its own, outside the engine's pool
    /// and schedule (parity checks, prompt scoring). Fails as `add_request` does on a bad prompt.
    pub fn prompt_logits(&self, prompt: &[u32]) -> Result<Vec<f32>> {
        if self.workers.is_some() {
            return Err(EngineError::config(
                "tensor_parallel_size",
                "prompt_logits runs the model on rank 0 alone; use one rank".into(),
            ));
        }
        self.check_prompt(prompt)?;
        let (model, device) = (self.runner.model(), self.runner.device());
        let bs = self.limits.block_size;
        let blocks = prompt.len().div_ceil(bs);
        let table: Vec<u32> = (0..blocks as u32).collect();
        let mut cache = KvCache::with_dtype(
            &self.model_config,
            blocks,
            bs,
            model.dtype(),
            self.limits.kv_cache_dtype,
            device,
        )?
        .with_scales(self.limits.kv_scales.as_ref())?;
        let meta = AttentionMetadata::prefill(vec![prompt.len()], vec![table], bs, device)?;
        let logits = model.forward(
            model.input_ids(prompt, device)?,
            &meta,
            &mut cache,
            LogitsRows::All,
        );
        sampler::read(logits.try_into_data(), "prompt logits")?
            .try_into_vec_as::<f32>()
            .map_err(|e| EngineError::Device(format!("prompt logits: {e:?}")))
    }

    /// [`EngineError::DeviceFailed`] once a step has failed.
    pub(super) fn check_alive(&self) -> Result<()> {
        match &self.failure {
            Some(cause) => Err(EngineError::DeviceFailed(cause.clone())),
            None => Ok(()),
        }
    }

    /// An empty prompt, an id outside the vocabulary or a prompt of `max_model_len` tokens or
    /// more, as an error naming it.
    pub(super) fn check_prompt(&self, prompt: &[u32]) -> Result<()> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let vocab_size = self.model_config.vocab_size;
        if let Some(&id) = prompt.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(EngineError::TokenOutOfVocab { id, vocab_size });
        }
        let max_model_len = self.limits.max_model_len;
        if prompt.len() >= max_model_len {
            return Err(EngineError::PromptTooLong {
                len: prompt.len(),
                max_model_len,
            });
        }
        Ok(())
    }

    /// Ends a request; its output (finish reason `abort`) comes with the next step.
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        match self.scheduler.get(id) {
            Some(seq) if !seq.is_finished() => {}
            _ => return Err(EngineError::UnknownRequest(id)),
        }
        let out = self.end_request(id, FinishReason::Abort);
        self.pending.extend(out);
        Ok(())
    }

    /// Ends `id` for `reason` (its blocks freed, its grammar dropped, draws in flight for it
    /// dropped): its final output.
    pub(super) fn end_request(
        &mut self,
        id: RequestId,
        reason: FinishReason,
    ) -> Option<RequestOutput> {
        self.scheduler.finish(id, reason);
        self.structured.remove(id);
        self.outputs
            .finished_output(&mut self.scheduler, id, Vec::new(), Vec::new())
    }
}
