//! What the sampler takes for a step's rows: the token masks of constrained rows (grammars,
//! allowed tokens, bans), each row's parameters, seed, tokens and bans; then the sampler
//! enqueued behind the forward.

use std::time::Instant;

use cubecl_kernels::UploadBuffer;

use super::{Forward, InFlight, LLMEngine, ModelRun};
use crate::error::Result;
use crate::output::RequestOutput;
use crate::sampler::{self, LogitsShard, SamplePlan, SamplerRow, TokenMasks};
use crate::sampling_params::SamplingParams;
use crate::sequence::{FinishReason, RequestId, Sequence};

impl LLMEngine {
    /// The token masks of this step's `constrained` rows (of `rows`), written into `upload`
    /// (their grammars have seen every drawn token). A request whose grammar fails ends with
    /// the error (in `outputs`); its row then allows every token, as does the row of a request
    /// that ended meanwhile, and their draws are dropped.
    pub(super) fn token_masks(
        &mut self,
        rows: &[(RequestId, usize)],
        constrained: Vec<u32>,
        mut upload: UploadBuffer,
        outputs: &mut Vec<RequestOutput>,
    ) -> TokenMasks {
        let start = Instant::now();
        let live: Vec<Option<RequestId>> = constrained
            .iter()
            .map(|&r| rows[r as usize].0)
            .map(|id| self.is_running(id).then_some(id))
            .collect();
        let allowed = upload.as_mut_slice();
        let failed = self.structured.masks(&live, allowed);
        // End-of-sequence and stop tokens before `min_tokens` leave the mask, unless nothing
        // else is left in it.
        let words = cubecl_kernels::mask_words(self.model_config.vocab_size);
        for (k, id) in live.iter().enumerate() {
            let Some(seq) = id.and_then(|id| self.scheduler.get(id)) else {
                continue;
            };
            let mask = &mut allowed[k * words..(k + 1) * words];
            if let Some(only) = &seq.params.allowed_token_ids {
                let mut set = vec![0u32; words];
                for &t in only {
                    set[t as usize / 32] |= 1 << (t % 32);
                }
                mask.iter_mut().zip(set).for_each(|(m, s)| *m &= s);
            }
            let banned = self.banned_tokens(seq);
            if banned.is_empty() {
                continue;
            }
            let before: Vec<u32> = banned.iter().map(|&t| mask[t as usize / 32]).collect();
            for &t in &banned {
                mask[t as usize / 32] &= !(1u32 << (t % 32));
            }
            if mask.iter().all(|&w| w == 0) {
                // Nothing else is left: the bans give way.
                for (&t, w) in banned.iter().zip(before) {
                    mask[t as usize / 32] = w;
                }
            }
        }
        for (id, e) in failed {
            let reason = FinishReason::Error(format!("structured output: {e}"));
            outputs.extend(self.end_request(id, reason));
        }
        self.stats.mask_steps += 1;
        self.stats.masked_rows += live.iter().flatten().count() as u64;
        self.stats.mask_time += start.elapsed();
        TokenMasks {
            allowed: upload.into_data([constrained.len(), words]),
            rows: constrained,
        }
    }

    /// The step's sampling (constrained rows under `masks`), enqueued behind its forward.
    pub(super) fn run_sampler(&mut self, forward: Forward, masks: TokenMasks) -> Result<ModelRun> {
        let Forward {
            logits,
            rows,
            graph,
            forwarded_at,
        } = forward;
        let draws = match logits {
            Some(logits) => {
                // Requests that ended while the forward ran (the previous step finished early
                // for structured outputs) draw a greedy token nobody reads.
                let stand_in = SamplingParams::greedy(1);
                // A constrained row's bans are in its mask already.
                let mut masked = vec![false; rows.len()];
                for &r in &masks.rows {
                    masked[r as usize] = true;
                }
                let banned: Vec<Vec<u32>> = (0..rows.len())
                    .map(|r| match self.scheduler.get(rows[r].0) {
                        Some(seq) if !masked[r] => self.banned_tokens(seq),
                        _ => Vec::new(),
                    })
                    .collect();
                let seqs: Vec<Option<&Sequence>> =
                    rows.iter().map(|&(id, _)| self.scheduler.get(id)).collect();
                let sampler_rows: Vec<SamplerRow<'_>> = seqs
                    .iter()
                    .zip(banned)
                    .map(|(seq, banned)| match seq {
                        Some(seq) => SamplerRow {
                            params: &seq.params,
                            seed: seq.seed,
                            prompt: &seq.token_ids[..seq.num_prompt_tokens],
                            output: seq.output_token_ids(),
                            banned,
                        },
                        None => SamplerRow {
                            params: &stand_in,
                            seed: 0,
                            prompt: &[],
                            output: &[],
                            banned,
                        },
                    })
                    .collect();
                let counters: Vec<u32> = rows.iter().map(|&(_, pos)| pos as u32).collect();
                let vocab = self.model_config.vocab_size;
                let mut plan = SamplePlan::new(&sampler_rows, masks, &counters, vocab);
                plan.logprobs_per_row = self.config.batch_invariant;
                if let Some(workers) = &mut self.workers {
                    workers.sample(&plan)?;
                }
                let shard = LogitsShard::of(self.runner.model());
                let (draws, flush) = sampler::sample_planned(
                    logits,
                    &sampler_rows,
                    plan,
                    self.runner.draws(),
                    shard.as_ref(),
                )?;
                // Flushing the sampling to the device waits for it while the previous step's
                // copy of the draws buffer (which this sampling rewrites) is pending.
                self.waited += flush;
                draws
            }
            None => sampler::Draws::Ready(Vec::new()),
        };
        let row_of = rows
            .iter()
            .enumerate()
            .map(|(r, &(id, _))| (id, r))
            .collect();
        if self.config.gpu_timeline && self.config.record_steps {
            let start = self.runner.take_start_mark();
            let end = cubecl_kernels::mark_stream(self.runner.draws())?;
            self.gpu_marks.push(start.zip(end));
        }
        Ok(ModelRun {
            in_flight: InFlight {
                rows,
                row_of,
                draws,
            },
            graph,
            forwarded_at,
        })
    }

    /// End-of-sequence and stop tokens may not be drawn before `min_tokens`.
    pub(super) fn banned_tokens(&self, seq: &Sequence) -> Vec<u32> {
        let p = &seq.params;
        let mut banned = p.bad_word_bans(seq.output_token_ids());
        if seq.num_output_tokens() < p.min_tokens {
            banned.extend(&p.stop_token_ids);
            if !p.ignore_eos {
                banned.extend(self.outputs.eos_token_ids());
            }
        }
        banned.retain(|&t| (t as usize) < self.model_config.vocab_size);
        banned
    }
}
