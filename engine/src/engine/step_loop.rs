//! The step loop: schedule, enqueue the forward and the sampler (overlapped with the previous
//! step's draws on their way back), then finish the previous step: its tokens through the
//! grammars and the stop conditions into outputs. A device failure ends every request.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use cubecl_kernels::UploadBuffer;

use super::{Forward, InFlight, LLMEngine, ModelRun};
use crate::error::{EngineError, Result};
use crate::output::{RequestOutput, StepRecord};
use crate::sampler::TokenMasks;
use crate::scheduler::SchedulerOutput;
use crate::sequence::{FinishReason, RequestId};
use crate::step::StepSeq;

impl LLMEngine {
    /// Runs one step: schedules, runs the model, samples, applies stop conditions. Returns an
    /// output for every request that got a token, finished, failed or was aborted since the
    /// last step; with overlapped scheduling the tokens are those of the step before (the one
    /// enqueued here is finished by the next call, or by this one when nothing is left to
    /// schedule). An error is [`EngineError::DeviceFailed`]: the forward or the sampling
    /// failed (or panicked), every running and waiting request has ended with it, and the
    /// engine takes no more work.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>> {
        self.check_alive()?;
        let start = Instant::now();
        let mut outputs = std::mem::take(&mut self.pending);
        // Penalties count the tokens drawn so far: their rows need the last one on the host.
        if self
            .in_flight
            .as_ref()
            .is_some_and(|f| f.rows.iter().any(|&(id, _)| self.needs_host_tokens(id)))
        {
            outputs.extend(self.finish_in_flight()?);
        }
        let sched = self.scheduler.schedule();
        for &id in &sched.failed {
            outputs.extend(self.outputs.finished_output(
                &mut self.scheduler,
                id,
                Vec::new(),
                Vec::new(),
            ));
        }
        if sched.is_empty() {
            // Nothing to overlap with: finish the step in flight.
            outputs.extend(self.finish_in_flight()?);
            self.stats.host_time += start.elapsed();
            self.stats.step_time += start.elapsed();
            return Ok(outputs);
        }
        let scheduled_at = Instant::now();
        self.waited = Duration::ZERO;
        // A failure here leaves the device (and the KV cache) in an unknown state: it ends
        // every request and the engine. A panicking backend counts as such a failure.
        let run = std::panic::catch_unwind(AssertUnwindSafe(|| self.run_forward(&sched)));
        let forward = self.device_result(run)?;
        let mut masks = TokenMasks::none(self.model_config.vocab_size);
        // Rows under a token mask: a grammar's, or a fixed set of allowed tokens.
        let constrained: Vec<u32> = (0..forward.rows.len() as u32)
            .filter(|&r| {
                let id = forward.rows[r as usize].0;
                self.structured.contains(id)
                    || self
                        .scheduler
                        .get(id)
                        .is_some_and(|s| s.params.allowed_token_ids.is_some())
            })
            .collect();
        if !constrained.is_empty() {
            // Constrained rows' grammars must have seen the previous step's tokens: finish that
            // step now, while the device runs this one's forward pass, then compute the masks
            // into upload memory taken before the wait.
            let words = cubecl_kernels::mask_words(self.model_config.vocab_size);
            let upload = UploadBuffer::new(self.device(), constrained.len() * words);
            outputs.extend(self.finish_in_flight()?);
            masks = self.token_masks(&forward.rows, constrained, upload, &mut outputs);
        }
        let run = std::panic::catch_unwind(AssertUnwindSafe(|| self.run_sampler(forward, masks)));
        let ModelRun {
            in_flight,
            graph,
            forwarded_at,
        } = self.device_result(run)?;
        let enqueued_at = Instant::now();
        let flushed = self.waited;
        let mut prefill = false;
        for s in &sched.seqs {
            if s.num_new_tokens > 1 || !s.samples || self.is_prompt_token(s.id) {
                prefill = true;
                self.stats.prefill_tokens += s.num_new_tokens as u64;
            } else {
                self.stats.decode_tokens += 1;
            }
        }
        self.hold_places(&in_flight);
        // Finish the previous step (its draws were copied behind it, while this one was
        // being built), then record what this one computes: every token it computes is known
        // on the host by now, so the prefix cache hashes real tokens only.
        let previous = self.in_flight.replace(in_flight);
        if let Some(previous) = previous {
            outputs.extend(self.finish(previous)?);
        }
        for s in &sched.seqs {
            self.scheduler.on_computed(s);
        }
        if !self.config.overlap() {
            outputs.extend(self.finish_in_flight()?);
        }
        for o in outputs.iter().filter(|o| o.finish_reason.is_some()) {
            self.structured.remove(o.id);
        }
        let waited = self.waited;
        let end = Instant::now();
        self.stats.sample_time += (enqueued_at - forwarded_at) + (waited - flushed);
        self.stats.steps += 1;
        self.stats.generated_tokens += outputs
            .iter()
            .map(|o| o.new_token_ids.len() as u64)
            .sum::<u64>();
        self.stats.host_time +=
            (scheduled_at - start) + (end - enqueued_at).saturating_sub(waited - flushed);
        self.stats.step_time += end - start;
        if prefill {
            self.stats.prefill_steps += 1;
            self.stats.prefill_time += end - start;
        } else {
            self.stats.decode_time += end - start;
        }
        if self.config.record_steps {
            self.records.push(StepRecord {
                num_seqs: sched.seqs.len(),
                num_decodes: sched.num_decodes,
                num_tokens: sched.num_tokens(),
                graph,
                schedule: scheduled_at - start,
                forward: forwarded_at - scheduled_at,
                sample: (enqueued_at - forwarded_at).saturating_sub(flushed),
                wait: waited,
                post: (end - enqueued_at).saturating_sub(waited - flushed),
            });
        }
        Ok(outputs)
    }

    /// True if `id` is scheduled and has not finished (stopped, failed or aborted).
    pub(super) fn is_running(&self, id: RequestId) -> bool {
        self.scheduler.get(id).is_some_and(|s| !s.is_finished())
    }

    /// True if `id`'s penalties need its drawn tokens on the host.
    pub(super) fn needs_host_tokens(&self, id: RequestId) -> bool {
        self.scheduler.get(id).is_some_and(|s| {
            let p = &s.params;
            p.repetition_penalty != 1.0
                || p.presence_penalty != 0.0
                || p.frequency_penalty != 0.0
                || p.bans_follow_output()
        })
    }

    /// Places the step's draws in their sequences as placeholders (the next step reads them
    /// on the device); a sequence whose placeholder is its last token is scheduled no more.
    pub(super) fn hold_places(&mut self, in_flight: &InFlight) {
        let max_model_len = self.limits.max_model_len;
        for &(id, _) in &in_flight.rows {
            // A request that ended while its step's forward ran gets no placeholder.
            let Some(seq) = self.scheduler.get_mut(id) else {
                continue;
            };
            seq.token_ids.push(0);
            seq.num_pending_tokens += 1;
            seq.final_token_pending = seq.num_output_tokens() >= seq.params.max_tokens
                || seq.num_tokens() >= max_model_len;
        }
    }

    /// Finishes the step in flight, if any: its outputs.
    pub(super) fn finish_in_flight(&mut self) -> Result<Vec<RequestOutput>> {
        match self.in_flight.take() {
            Some(step) => self.finish(step),
            None => Ok(Vec::new()),
        }
    }

    /// Waits for a step's draws and applies them: each replaces its placeholder and goes
    /// through the stop conditions. Draws of requests that ended meanwhile are dropped.
    pub(super) fn finish(&mut self, step: InFlight) -> Result<Vec<RequestOutput>> {
        let wait_start = Instant::now();
        let sampled = std::panic::catch_unwind(AssertUnwindSafe(|| step.draws.wait()));
        self.waited += wait_start.elapsed();
        let sampled = self.device_result(sampled)?;
        // Constrained requests' grammars take their tokens first, all at once (in parallel).
        let grammar_start = Instant::now();
        let drawn: Vec<(RequestId, u32)> = step
            .rows
            .iter()
            .zip(&sampled)
            .filter(|((id, _), _)| self.structured.contains(*id))
            .filter(|((id, _), _)| self.is_running(*id))
            .map(|(&(id, _), s)| (id, s.token_id))
            .collect();
        let mut advanced = match drawn.is_empty() {
            true => HashMap::new(),
            false => self.structured.advance(&drawn),
        };
        self.stats.mask_time += grammar_start.elapsed();
        let vocab_size = self.runner.model().config.vocab_size;
        let mut outputs = Vec::new();
        for ((id, position), sample) in step.rows.into_iter().zip(sampled) {
            let Some(seq) = self.scheduler.get_mut(id) else {
                continue; // aborted or stopped: its output is out already
            };
            if seq.is_finished() {
                continue;
            }
            if sample.token_id as usize >= vocab_size {
                // The sampler's winner is always a token of the vocabulary; should a draw ever
                // not be, only its request ends.
                let reason = FinishReason::Error(format!(
                    "the sampler drew token {}, outside the vocabulary of {vocab_size}",
                    sample.token_id
                ));
                outputs.extend(self.end_request(id, reason));
                continue;
            }
            seq.token_ids[position] = sample.token_id;
            seq.num_pending_tokens -= 1;
            let grammar_complete = match advanced.remove(&id) {
                None => false,
                Some(advance) => match advance {
                    Ok(complete) => complete,
                    Err(e) => {
                        let reason = FinishReason::Error(format!(
                            "structured output: token {} breaks the constraint: {e}",
                            sample.token_id
                        ));
                        outputs.extend(self.end_request(id, reason));
                        continue;
                    }
                },
            };
            outputs.extend(self.outputs.accept_token(
                &mut self.scheduler,
                id,
                position,
                sample.logprobs,
                grammar_complete,
            )?);
        }
        Ok(outputs)
    }

    /// The step's forward pass, enqueued.
    pub(super) fn run_forward(&mut self, sched: &SchedulerOutput) -> Result<Forward> {
        let prev = self.in_flight.as_ref();
        let seqs: Vec<StepSeq<'_>> = sched
            .seqs
            .iter()
            .map(|s| {
                let seq = self.scheduler.get(s.id).expect("scheduled sequence");
                let pending_row = match seq.num_pending_tokens {
                    0 => None,
                    _ => Some(*prev.and_then(|p| p.row_of.get(&s.id)).ok_or_else(|| {
                        EngineError::Device(format!(
                            "request {} waits for a draw no step made",
                            s.id
                        ))
                    })?),
                };
                let start = seq.num_computed_tokens;
                Ok(StepSeq {
                    new_token_ids: &seq.token_ids[start..start + s.num_new_tokens],
                    num_computed_tokens: seq.num_computed_tokens,
                    block_table: &seq.block_table,
                    samples: s.samples,
                    pending_row,
                })
            })
            .collect::<Result<_>>()?;
        let graph_steps = self.runner.stats().graph_steps;
        if let Some(workers) = &mut self.workers {
            workers.forward(&seqs)?;
        }
        let logits = self.runner.forward(&seqs)?;
        let forwarded_at = Instant::now();
        let graph = self.runner.stats().graph_steps > graph_steps;
        drop(seqs);
        let rows: Vec<(RequestId, usize)> = sched
            .seqs
            .iter()
            .filter(|s| s.samples)
            .map(|s| {
                (
                    s.id,
                    self.scheduler.get(s.id).expect("sampled").num_tokens(),
                )
            })
            .collect();
        Ok(Forward {
            logits,
            rows,
            graph,
            forwarded_at,
        })
    }

    /// The value of device work run under `catch_unwind`; an error or a panic there ends
    /// every request and the engine ([`LLMEngine::fail`]).
    pub(super) fn device_result<T>(&mut self, run: std::thread::Result<Result<T>>) -> Result<T> {
        match run {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(self.fail(e.to_string())),
            Err(panic) => Err(self.fail(panic_message(panic.as_ref()))),
        }
    }

    /// Ends every request and the engine after a failed step; returns the error to report.
    pub(super) fn fail(&mut self, cause: String) -> EngineError {
        let reason = FinishReason::Error(format!("the device failed: {cause}"));
        for id in self.scheduler.unfinished() {
            self.scheduler.finish(id, reason.clone());
            self.scheduler.take_finished(id);
        }
        self.pending.clear();
        self.outputs.clear();
        self.structured.clear();
        self.in_flight = None;
        if let Some(workers) = &self.workers {
            workers.abort(&cause);
        }
        self.failure = Some(cause.clone());
        EngineError::DeviceFailed(cause)
    }

    /// The cause of the device failure that stopped the engine, if one did.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// True if `id`'s next computed token is still part of its prompt.
    pub(super) fn is_prompt_token(&self, id: RequestId) -> bool {
        self.scheduler
            .get(id)
            .is_some_and(|s| s.num_computed_tokens < s.num_prompt_tokens)
    }
}

/// The text a panic carried.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    format!("a step panicked: {}", crate::error::panic_text(panic))
}
