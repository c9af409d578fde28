//! Continuous batching with chunked prefill (vLLM V1's policy): every step first gives each
//! running sequence its tokens — one for a decoding sequence, a chunk of the remaining prompt
//! for one still prefilling — then admits waiting sequences in arrival order with chunks of
//! what is left of the token budget. One step therefore mixes decode tokens and prefill chunks,
//! and a long prompt never stalls the running decodes.
//!
//! With step sizes (the engine's CUDA-graph buckets, [`Scheduler::with_step_sizes`]), the token
//! budget of a step is shaped to them: the step's demand (its decodes, the running prompts'
//! remaining tokens, the prompts waiting for a free place) is cut to the largest size at or
//! below it while that still computes at least half of the step's prefill tokens, so that a
//! step fills a graph exactly — chunked prefill lets a prompt stop anywhere; other steps run
//! whole, padded to the next size.
//!
//! Admission batching (an [`Admission`] policy; TGI's `waiting_served_ratio` and
//! `max_waiting_tokens` in spirit): while at least half of `max_num_seqs` sequences decode, more
//! prompts wait than there are free places and places keep freeing (one freed within the last
//! [`STALL_STEPS`] steps), the waiting prompts are held back until the free places' prompts
//! fill `min_tokens` prompt tokens, or the head of the queue has been held `max_wait_steps`
//! steps. Prompts then arrive in a few larger mixed steps instead of one or two
//! at a time in every step (a prefill chunk's tokens cost ~30 % more in a step of ~1,500 tokens
//! than in one of ~7,000). A prompt already running goes on while the others wait (admitting
//! beside every remainder of a cut prompt would start the trickle again).
//!
//! When the pool has no block for a running sequence, the newest running sequence is preempted
//! (its blocks freed — full ones stay in the prefix cache — and it goes back to the front of
//! the queue, to be recomputed). A sequence that cannot fit even alone fails with an
//! out-of-blocks error; the others go on.

use std::collections::{HashMap, VecDeque};

use crate::block_manager::BlockManager;
use crate::error::EngineError;
use crate::sequence::{FinishReason, RequestId, Sequence, SequenceStatus};

/// Batch limits of one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerLimits {
    /// Most sequences in a step (and running at once).
    pub max_num_seqs: usize,
    /// Most tokens computed in a step.
    pub max_num_batched_tokens: usize,
}

/// Steps without a freed place after which held prompts are admitted: nothing more is coming
/// (the places left over after a wave of admissions, when equal lengths finish together).
/// Places free about every step with varied lengths; requiring a freed place in every step
/// cut the holds short (±90 %: 47.6k out tok/s against 48.5k on the H100).
pub const STALL_STEPS: usize = 3;

/// When waiting prompts are admitted while the batch is busy decoding (module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    /// Prompt tokens the free places' prompts must fill before they are admitted (0: admit
    /// as soon as a place is free).
    pub min_tokens: usize,
    /// Most consecutive steps the waiting prompts are held back.
    pub max_wait_steps: usize,
}

impl Admission {
    /// Admit as soon as a place and the budget allow (vLLM's and nano-vLLM's policy).
    pub const IMMEDIATE: Self = Self {
        min_tokens: 0,
        max_wait_steps: 0,
    };
}

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledSeq {
    /// The sequence.
    pub id: RequestId,
    /// Tokens computed for it in this step.
    pub num_new_tokens: usize,
    /// The step reaches the end of its tokens and samples the next one.
    pub samples: bool,
}

/// What one step computes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    /// One-token rows (decodes) first, then longer prefill chunks, in scheduling order.
    pub seqs: Vec<ScheduledSeq>,
    /// How many of `seqs` are one-token rows (they lead the list and take the decode kernel).
    pub num_decodes: usize,
    /// Sequences preempted while scheduling this step.
    pub preempted: Vec<RequestId>,
    /// Sequences that failed while scheduling (finished with an error; report them).
    pub failed: Vec<RequestId>,
}

impl SchedulerOutput {
    /// Tokens computed in the step.
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.num_new_tokens).sum()
    }

    /// True if nothing is computed.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}

/// The waiting queue, the running set and the block pool.
#[derive(Debug)]
pub struct Scheduler {
    limits: SchedulerLimits,
    /// Every live sequence (waiting or running) and the finished ones not yet taken.
    seqs: HashMap<RequestId, Sequence>,
    waiting: VecDeque<RequestId>,
    running: Vec<RequestId>,
    block_manager: BlockManager,
    num_preemptions: u64,
    /// Token counts steps are shaped to, ascending (empty: no shaping).
    step_sizes: Vec<usize>,
    /// Most prefill chunks (of two tokens or more) in one step.
    max_prefill_chunks: usize,
    admission: Admission,
    /// Consecutive steps the waiting prompts have been held back.
    held_steps: usize,
    /// Free places when the previous step was scheduled (after its admissions).
    free_after_last: usize,
    /// Consecutive steps in which no place freed.
    stalled_steps: usize,
}

impl Scheduler {
    /// A scheduler over `block_manager`'s pool.
    pub fn new(limits: SchedulerLimits, block_manager: BlockManager) -> Self {
        assert!(limits.max_num_seqs > 0 && limits.max_num_batched_tokens > 0);
        Self {
            limits,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            block_manager,
            num_preemptions: 0,
            step_sizes: Vec::new(),
            max_prefill_chunks: usize::MAX,
            admission: Admission::IMMEDIATE,
            held_steps: 0,
            free_after_last: 0,
            stalled_steps: 0,
        }
    }

    /// Batches admissions by `admission` (module doc); default [`Admission::IMMEDIATE`].
    pub fn with_admission(mut self, admission: Admission) -> Self {
        self.admission = admission;
        self
    }

    /// Shapes every step's token budget to `sizes` and holds at most `max_prefill_chunks`
    /// prefill chunks (the graphs' capacity; module doc).
    pub fn with_step_sizes(mut self, mut sizes: Vec<usize>, max_prefill_chunks: usize) -> Self {
        sizes.sort_unstable();
        sizes.dedup();
        self.step_sizes = sizes;
        self.max_prefill_chunks = max_prefill_chunks.max(1);
        self
    }

    /// Queues a new sequence.
    pub fn add(&mut self, seq: Sequence) {
        let id = seq.id;
        debug_assert_eq!(seq.status, SequenceStatus::Waiting);
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
    }

    /// A live or finished-but-not-taken sequence.
    pub fn get(&self, id: RequestId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    /// Mutable access (for the engine's post-processing).
    pub fn get_mut(&mut self, id: RequestId) -> Option<&mut Sequence> {
        self.seqs.get_mut(&id)
    }

    /// Removes a finished sequence and returns it.
    pub fn take_finished(&mut self, id: RequestId) -> Option<Sequence> {
        if self.seqs.get(&id)?.is_finished() {
            self.seqs.remove(&id)
        } else {
            None
        }
    }

    /// The pool.
    pub fn block_manager(&self) -> &BlockManager {
        &self.block_manager
    }

    /// Queued sequences.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Running sequences.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// True while any sequence is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Every waiting and running sequence, running first.
    pub fn unfinished(&self) -> Vec<RequestId> {
        self.running.iter().chain(&self.waiting).copied().collect()
    }

    /// Preemptions so far.
    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    /// The block tables of every sequence holding blocks (for invariant checks).
    pub fn block_tables(&self) -> impl Iterator<Item = &[u32]> {
        self.running
            .iter()
            .map(|id| self.seqs[id].block_table.as_slice())
    }

    /// Decides the next step.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut decodes = Vec::new();
        let mut chunks = Vec::new();
        let num_decoding = self
            .running
            .iter()
            .filter(|id| self.seqs[id].num_new_tokens() == 1 && !self.seqs[id].final_token_pending)
            .count();
        let places = self.free_places();
        if places > self.free_after_last {
            self.stalled_steps = 0;
        } else {
            self.stalled_steps += 1;
        }
        let hold = self.holds_admissions(num_decoding, places);
        // Decodes first: the prefill chunks get what the running decodes leave.
        let mut prefill_budget = self
            .step_budget(num_decoding, if hold { 0 } else { places })
            .saturating_sub(num_decoding);
        let mut i = 0;
        while i < self.running.len() {
            let id = self.running[i];
            let num_new = self.seqs[&id].num_new_tokens();
            // A sequence whose token in flight is its last computes nothing more.
            let chunk = if self.seqs[&id].final_token_pending {
                0
            } else if num_new == 1 {
                1
            } else if chunks.len() >= self.max_prefill_chunks {
                0
            } else {
                num_new.min(prefill_budget)
            };
            if chunk == 0 {
                i += 1;
                continue;
            }
            // Make room, preempting the newest running sequences.
            let mut fits = true;
            loop {
                let need = self.block_manager.blocks_to_grow(&self.seqs[&id], chunk);
                if need <= self.block_manager.num_free_blocks() {
                    break;
                }
                let victim = *self.running.last().expect("the current sequence runs");
                if victim != id {
                    self.running.pop();
                    self.preempt(victim, &mut out);
                    continue;
                }
                fits = false;
                if i == 0 {
                    // Alone (every newer one is preempted, no older one exists) and still
                    // too big: it can never run.
                    self.running.pop();
                    self.fail_out_of_blocks(id, chunk, &mut out);
                } else {
                    self.running.pop();
                    self.preempt(id, &mut out);
                }
                break;
            }
            if !fits {
                break;
            }
            let seq = self.seqs.get_mut(&id).expect("running sequence");
            self.block_manager.grow(seq, chunk);
            let scheduled = ScheduledSeq {
                id,
                num_new_tokens: chunk,
                samples: chunk == num_new,
            };
            if num_new > 1 {
                prefill_budget -= chunk;
            }
            // One-token rows (decodes, and chunks the budget cut to one) lead the batch.
            if chunk == 1 {
                decodes.push(scheduled);
            } else {
                chunks.push(scheduled);
            }
            i += 1;
        }
        // Admit waiting sequences in order while the budget, the batch and the pool allow (not
        // in a step that had to preempt: the pool is short; not while admissions are held).
        if hold {
            self.held_steps += 1;
        } else {
            self.held_steps = 0;
        }
        while !hold
            && out.preempted.is_empty()
            && self.running.len() < self.limits.max_num_seqs
            && prefill_budget > 0
            && chunks.len() < self.max_prefill_chunks
        {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let seq = &self.seqs[&id];
            let hit = self.block_manager.find_prefix(&seq.token_ids);
            let remaining = seq.num_tokens() - hit.blocks.len() * self.block_manager.block_size();
            let chunk = remaining.min(prefill_budget);
            if self.block_manager.blocks_to_admit(&hit, chunk)
                > self.block_manager.num_free_blocks()
            {
                break;
            }
            self.waiting.pop_front();
            let seq = self.seqs.get_mut(&id).expect("waiting sequence");
            self.block_manager.admit(seq, hit, chunk);
            seq.status = SequenceStatus::Running;
            self.running.push(id);
            let scheduled = ScheduledSeq {
                id,
                num_new_tokens: chunk,
                samples: chunk == remaining,
            };
            prefill_budget -= chunk;
            if chunk == 1 {
                decodes.push(scheduled);
            } else {
                chunks.push(scheduled);
            }
        }
        self.free_after_last = self.free_places();
        if !crate::knobs::Knobs::get().arrival_order {
            // Longest contexts first. The decode kernels launch one cube per (kv head, row) in
            // row order and the device deals a launch's cubes out over its multiprocessors in
            // turn, so in this order every multiprocessor gets a share of the long and the short
            // contexts, where arrival order gives a few of them several long ones (the launch
            // lasts as long as its busiest multiprocessor). A stable sort: equal contexts keep
            // their order.
            decodes.sort_by_key(|s| std::cmp::Reverse(self.seqs[&s.id].num_computed_tokens));
        }
        out.num_decodes = decodes.len();
        out.seqs = decodes;
        out.seqs.extend(chunks);
        out
    }

    /// Places in the batch no running sequence holds.
    fn free_places(&self) -> usize {
        self.limits.max_num_seqs.saturating_sub(self.running.len())
    }

    /// True if this step holds the waiting prompts back ([`Admission`], module doc).
    /// `num_decoding`: running sequences with one token to compute; `places`: free places.
    fn holds_admissions(&self, num_decoding: usize, places: usize) -> bool {
        let Admission {
            min_tokens,
            max_wait_steps,
        } = self.admission;
        // Nothing more comes by waiting when places stopped freeing or every waiting prompt
        // fits already.
        if min_tokens == 0
            || self.held_steps >= max_wait_steps
            || 2 * num_decoding < self.limits.max_num_seqs
            || self.stalled_steps >= STALL_STEPS
            || self.waiting.len() <= places
        {
            return false;
        }
        let tokens: usize = self
            .waiting
            .iter()
            .take(places)
            .map(|id| self.seqs[id].num_tokens())
            .sum();
        tokens < min_tokens
    }

    /// Tokens the next step may compute: `max_num_batched_tokens`, or shaped to the step sizes
    /// (module doc). `num_decoding`: running sequences with one token to compute; `places`:
    /// free places whose waiting prompts add to the step's demand (0 while admissions are
    /// held).
    fn step_budget(&self, num_decoding: usize, mut places: usize) -> usize {
        let max = self.limits.max_num_batched_tokens;
        let Some(&largest) = self.step_sizes.last() else {
            return max;
        };
        let cap = max.min(largest);
        if num_decoding >= cap {
            // No size holds the decodes alone: the step runs unshaped.
            return max;
        }
        let mut demand = num_decoding;
        let mut chunks = 0;
        for id in &self.running {
            let n = self.seqs[id].num_new_tokens();
            if n > 1 && chunks < self.max_prefill_chunks {
                demand += n;
                chunks += 1;
            }
        }
        let bs = self.block_manager.block_size();
        for id in &self.waiting {
            if places == 0 || demand >= cap || chunks >= self.max_prefill_chunks {
                break;
            }
            let seq = &self.seqs[id];
            let hit = self.block_manager.find_prefix(&seq.token_ids);
            demand += seq.num_tokens() - hit.blocks.len() * bs;
            places -= 1;
            chunks += 1;
        }
        let demand = demand.min(cap);
        // A cut must still compute at least half the step's prefill tokens: cutting to a size
        // just above the decodes would trickle the last prompt over many steps (bench.py's
        // last prompt took 20 steps of 2-6 tokens); a step that no such cut fits runs whole,
        // padded to the next size.
        match self.step_sizes.iter().rev().find(|&&s| s <= demand) {
            Some(&size)
                if size > num_decoding && 2 * (size - num_decoding) >= demand - num_decoding =>
            {
                size
            }
            _ => demand,
        }
    }

    /// Moves a running sequence (already out of `running`) back to the front of the queue.
    fn preempt(&mut self, id: RequestId, out: &mut SchedulerOutput) {
        let seq = self.seqs.get_mut(&id).expect("preempted sequence");
        self.block_manager.free(seq);
        seq.status = SequenceStatus::Waiting;
        seq.num_preemptions += 1;
        self.num_preemptions += 1;
        self.waiting.push_front(id);
        out.preempted.push(id);
    }

    fn fail_out_of_blocks(&mut self, id: RequestId, chunk: usize, out: &mut SchedulerOutput) {
        let bm = &self.block_manager;
        let seq = &self.seqs[&id];
        let tokens = seq.num_computed_tokens + chunk;
        let message = EngineError::OutOfKvBlocks {
            tokens,
            needed: bm.blocks_for(tokens),
            block_size: bm.block_size(),
            available: bm.num_blocks(),
        }
        .to_string();
        self.finish(id, FinishReason::Error(message));
        out.failed.push(id);
    }

    /// Records that the step computed the scheduled tokens, and registers full blocks in the
    /// prefix cache.
    pub fn on_computed(&mut self, scheduled: &ScheduledSeq) {
        if let Some(seq) = self.seqs.get_mut(&scheduled.id) {
            seq.num_computed_tokens += scheduled.num_new_tokens;
            self.block_manager.cache_full_blocks(seq);
        }
    }

    /// Ends a waiting or running sequence: frees its blocks and leaves it to be taken.
    pub fn finish(&mut self, id: RequestId, reason: FinishReason) {
        let Some(seq) = self.seqs.get_mut(&id) else {
            return;
        };
        if seq.is_finished() {
            return;
        }
        match seq.status {
            SequenceStatus::Waiting => self.waiting.retain(|&w| w != id),
            SequenceStatus::Running => self.running.retain(|&r| r != id),
            SequenceStatus::Finished => {}
        }
        self.block_manager.free(seq);
        seq.status = SequenceStatus::Finished;
        seq.finish_reason = Some(reason);
    }
}
