//! What the engine hands back after each step.

use std::time::Duration;

use crate::sampler::TokenLogprobs;
use crate::sequence::{FinishReason, RequestId};

/// The progress of one request in one step (streaming API), or its end.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestOutput {
    /// The request.
    pub id: RequestId,
    /// Tokens generated in this step (usually one).
    pub new_token_ids: Vec<u32>,
    /// Text added in this step (when the request's text is tracked: streaming or stop strings).
    pub new_text: String,
    /// Log-probabilities of the new tokens, when asked for.
    pub new_logprobs: Vec<TokenLogprobs>,
    /// Set once the request is done.
    pub finish_reason: Option<FinishReason>,
    /// Prompt length.
    pub num_prompt_tokens: usize,
    /// Tokens generated so far.
    pub num_output_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub num_cached_tokens: usize,
    /// Timings, when finished.
    pub metrics: Option<RequestMetrics>,
}

/// Timings of a finished request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RequestMetrics {
    /// From arrival to the first generated token.
    pub time_to_first_token: Option<Duration>,
    /// From arrival to the end.
    pub total_time: Duration,
    /// Times it was preempted.
    pub num_preemptions: u32,
}

/// Counters of the engine's work since it started.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineStats {
    /// Steps run.
    pub steps: u64,
    /// Prompt tokens computed (prefix-cache hits excluded).
    pub prefill_tokens: u64,
    /// Tokens computed by decode rows.
    pub decode_tokens: u64,
    /// Tokens generated.
    pub generated_tokens: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Prompt tokens looked up in the prefix cache, and found.
    pub prefix_queried_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub prefix_hit_tokens: u64,
    /// Steps replayed as CUDA graphs.
    pub graph_steps: u64,
    /// Host time in scheduling and post-processing.
    pub host_time: Duration,
    /// Host time in building inputs and enqueueing the forward pass.
    pub prepare_time: Duration,
    /// Time in the sampler (waiting for the step's device work included).
    pub sample_time: Duration,
    /// Of the graph steps' host time: building rows, writing buffers, launching replays.
    pub graph_timings: crate::cuda_graph::GraphTimings,
    /// Wall time inside `step`.
    pub step_time: Duration,
    /// Steps that had prefill tokens.
    pub prefill_steps: u64,
    /// Time spent in steps that had prefill tokens.
    pub prefill_time: Duration,
    /// Time spent in decode-only steps.
    pub decode_time: Duration,
    /// Steps with structured-output rows.
    pub mask_steps: u64,
    /// Structured-output rows masked, over all steps.
    pub masked_rows: u64,
    /// Host time in structured outputs' grammars: advancing them past drawn tokens and
    /// computing the constrained rows' token masks (while the device runs the step's forward
    /// pass).
    pub mask_time: Duration,
}

/// A step's time on the device ([`crate::LLMEngine::gpu_timeline`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GpuStep {
    /// From the start of its device work (right before its graph replay or eager forward) to
    /// the end of its sampling and the draws' copy.
    pub busy: Duration,
    /// Before it: from the end of the previous step's work to the start of this one's, when
    /// the device's stream had nothing of the engine's queued.
    pub idle_before: Duration,
}

/// What one step did and where its time went (kept when `EngineConfig::record_steps` is set).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepRecord {
    /// Sequences in the step.
    pub num_seqs: usize,
    /// Of which one-token rows.
    pub num_decodes: usize,
    /// Tokens computed.
    pub num_tokens: usize,
    /// Replayed as a graph.
    pub graph: bool,
    /// Scheduling.
    pub schedule: Duration,
    /// Building inputs and enqueueing the forward pass.
    pub forward: Duration,
    /// Enqueueing the sampling (and, for rows that ask for log-probabilities, waiting for it).
    pub sample: Duration,
    /// Waiting for the device: flushing the sampling to it (which waits while the previous
    /// step's copy of the draws is pending) and waiting for the draws of the step before
    /// (overlapped scheduling: the device runs this step's work meanwhile) or of this one
    /// (synchronous steps).
    pub wait: Duration,
    /// Stop conditions and outputs.
    pub post: Duration,
}
