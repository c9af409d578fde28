//! Tensor parallelism in the engine: rank 0 is the [`crate::LLMEngine`] (scheduler, block
//! manager, sampler decisions, outputs); ranks `1..size` are workers that hold their share of
//! the model and of the KV cache and replay each step rank 0 plans.
//!
//! Layout, as nano-vLLM and vLLM: one worker process per GPU. Each process's CubeCL runtime
//! sees one device, so its CUDA-graph captures stay as they are on one GPU (CubeCL captures in
//! CUDA's global mode, where another thread's driver call — another device's allocation —
//! would invalidate a capture). A worker starts up exactly as rank 0 does (the same warm-ups,
//! KV-pool sizing and graph captures, so both issue the same collectives in the same order;
//! the pool takes the smallest of the ranks' sizes), then replays steps. Each step rank 0 sends
//! the workers the step's sequences ([`PlannedSeq`]: new token ids, positions, block tables,
//! which rows sample and which take the previous step's draws) before it enqueues its own
//! forward, and the sampling plan ([`SamplePlan`]: penalties, token masks, each row's seeded
//! draw) once it has made it. Every rank computes the same logits (the row-split products are
//! summed over the ranks, and the LM head is whole on every rank) and draws with the same plan,
//! so every rank's standing draws buffer holds the same tokens and the next step's device-fed
//! tokens agree without any exchange. With `EngineConfig::vocab_parallel` each rank computes
//! its columns of the logits (the embedding and LM head split by vocabulary rows) and draws
//! each row over them with the same plan; the ranks sum
//! their (score, token) pairs (`cubecl_kernels::sample_shard`: `2 · size` floats a row instead
//! of `[rows, V]` logits) and each picks the best, so every rank's standing draws buffer holds
//! the same tokens and the next step's device-fed tokens agree; rows that need whole rows
//! (top-k/top-p/min-p, log-probabilities) gather the logits instead. Only rank 0 reads the
//! draws back.
//!
//! Two transports: processes on CUDA ([`processes`]: the NCCL id and the options in the first
//! message, then MessagePack frames on the worker's stdin; a watchdog per worker ends the
//! group when one exits), threads on CPU devices ([`threads`]: the host collective,
//! [`model_qwen2::HostAllReduce`], which tests the split through the engine). A rank that
//! fails aborts the group, so that the others' collectives fail (a panicking forward, which the
//! engine counts as a failed device) instead of waiting for it.
//!
//! Beyond one host (a plan, not built): the same design holds with the NCCL id sent over TCP
//! instead of a pipe (NCCL's bootstrap already runs over sockets) and the step messages on
//! that socket; NCCL picks InfiniBand or sockets between hosts, where an all-reduce costs tens
//! of microseconds more, so a layer's two all-reduces would favour pipeline stages (layers
//! split across hosts, activations sent once per stage) over tensor parallelism across hosts,
//! as vLLM does with `--pipeline-parallel-size`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use burn::tensor::{Device, Tensor};
use model_qwen2::{AllReduce, Checkpoint, Parallel, Qwen2Config, Qwen2Model, TpRank};
use serde::{Deserialize, Serialize};

use crate::config::EngineConfig;
use crate::error::{EngineError, Result};
use crate::sampler::{LogitsShard, SamplePlan};
use crate::start_up::{self, StartUp};
use crate::step::{PlannedSeq, StepSeq};

pub mod processes;
pub mod threads;
mod watchdog;

pub use processes::serve_if_worker;

/// What rank 0 sends a worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) enum ToWorker {
    /// Run this step's forward.
    Forward(Vec<PlannedSeq>),
    /// Sample the last forward's logits with this plan.
    Sample(Box<SamplePlan>),
    /// Do nothing for this long (tests: a rank that hangs).
    Stall(Duration),
    /// Leave.
    Stop,
}

/// How far a worker got: the step messages rank 0 sent it and those it finished (its host
/// part: enqueueing the step's device work). Rank 0's watchdog reads both.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    sent: AtomicU64,
    done: AtomicU64,
}

impl Progress {
    /// The worker finished one more message.
    pub(crate) fn finished(&self) {
        self.done.fetch_add(1, Ordering::AcqRel);
    }

    /// The worker has finished `n` messages (a count it reported).
    pub(crate) fn set_done(&self, n: u64) {
        self.done.fetch_max(n, Ordering::AcqRel);
    }
}

/// Rank 0's handle on the other ranks.
pub(crate) struct Workers {
    links: Vec<Box<dyn Link>>,
    /// Rank 0's collective, aborted when rank 0 fails.
    all_reduce: Arc<dyn AllReduce>,
    /// Set when the workers are stopped: the watchdog leaves.
    stopped: Arc<AtomicBool>,
}

/// A message on its way to every worker, encoded (MessagePack) at most once for all the links
/// that send bytes.
pub(crate) struct Outgoing<'a> {
    message: &'a ToWorker,
    encoded: std::cell::OnceCell<Vec<u8>>,
}

impl<'a> Outgoing<'a> {
    pub(crate) fn new(message: &'a ToWorker) -> Self {
        Self {
            message,
            encoded: std::cell::OnceCell::new(),
        }
    }

    /// The message.
    pub(crate) fn message(&self) -> &ToWorker {
        self.message
    }

    /// Its MessagePack encoding (made on the first call).
    pub(crate) fn encoded(&self) -> Result<&[u8]> {
        if let Some(bytes) = self.encoded.get() {
            return Ok(bytes);
        }
        let bytes = rmp_serde::to_vec(self.message)
            .map_err(|e| EngineError::Device(format!("encoding a step: {e}")))?;
        Ok(self.encoded.get_or_init(|| bytes))
    }
}

/// One worker, as rank 0 reaches it.
pub(crate) trait Link: Send {
    /// Sends `message`; an error names the rank and why it cannot be reached.
    fn send(&mut self, message: &Outgoing<'_>) -> Result<()>;
    /// Waits (boundedly) for the worker to leave after `Stop`.
    fn join(&mut self);
    /// The worker's rank.
    fn rank(&self) -> usize;
    /// How far the worker got.
    fn progress(&self) -> &Arc<Progress>;
    /// What ends the worker when the watchdog finds it hung (`reason`), if anything can.
    fn stopper(&self) -> Box<dyn Fn(&str) + Send>;
}

impl Workers {
    /// Rank 0's handle on `links`, with a watchdog that ends the group (aborting
    /// `all_reduce`) when a worker has not finished a step message for `timeout`.
    pub(crate) fn new(
        links: Vec<Box<dyn Link>>,
        all_reduce: Arc<dyn AllReduce>,
        timeout: Duration,
    ) -> Self {
        let stopped = Arc::new(AtomicBool::new(false));
        watchdog::spawn(&links, all_reduce.clone(), timeout, stopped.clone());
        Self {
            links,
            all_reduce,
            stopped,
        }
    }

    /// Makes worker `rank` do nothing for `duration` before its next message (tests: a rank
    /// that hangs).
    pub(crate) fn stall(&mut self, rank: usize, duration: Duration) -> Result<()> {
        let link = self
            .links
            .iter_mut()
            .find(|l| l.rank() == rank)
            .ok_or_else(|| EngineError::Device(format!("no tensor-parallel rank {rank}")))?;
        send_step(link, &Outgoing::new(&ToWorker::Stall(duration)))
    }

    /// Sends the step's sequences to every worker (before rank 0 enqueues its own forward).
    pub(crate) fn forward(&mut self, seqs: &[StepSeq<'_>]) -> Result<()> {
        self.send(&ToWorker::Forward(
            seqs.iter().map(PlannedSeq::of).collect(),
        ))
    }

    /// Sends the step's sampling plan to every worker.
    pub(crate) fn sample(&mut self, plan: &SamplePlan) -> Result<()> {
        self.send(&ToWorker::Sample(Box::new(plan.clone())))
    }

    /// Ends the group: rank 0 failed with `reason`.
    pub(crate) fn abort(&self, reason: &str) {
        self.all_reduce.abort(reason);
    }

    fn send(&mut self, message: &ToWorker) -> Result<()> {
        let outgoing = Outgoing::new(message);
        self.links
            .iter_mut()
            .try_for_each(|l| send_step(l, &outgoing))
    }
}

/// Sends a step message to one worker, counted for the watchdog.
fn send_step(link: &mut Box<dyn Link>, message: &Outgoing<'_>) -> Result<()> {
    link.progress().sent.fetch_add(1, Ordering::AcqRel);
    link.send(message)
}

impl Drop for Workers {
    /// Stops the workers (each leaves after its current step; a worker that does not within
    /// its link's bound is killed). The group is not aborted: NCCL's abort waits for the
    /// device, which blocked rank 0's shutdown on 2 × H200.
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Release);
        for link in &mut self.links {
            let _ = link.send(&Outgoing::new(&ToWorker::Stop));
        }
        for link in &mut self.links {
            link.join();
        }
    }
}

/// Where every rank's weights come from.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ModelSource {
    /// A checkpoint folder: each rank reads its share.
    Checkpoint(PathBuf),
    /// Random weights of this config (benchmarks; each rank draws its own share), with the
    /// folder of the tokenizer and `generation_config.json`, if any.
    Random(Qwen2Config, Option<PathBuf>),
}

impl ModelSource {
    /// The folder of the tokenizer and `generation_config.json`.
    pub fn dir(&self) -> Option<&Path> {
        match self {
            Self::Checkpoint(dir) => Some(dir),
            Self::Random(_, dir) => dir.as_deref(),
        }
    }
}

/// Loads rank `rank`'s share of `source` (of a group of `config.tensor_parallel_size` summed by
/// `all_reduce`) in `config`'s dtype on `device`.
pub(crate) fn load_rank(
    source: &ModelSource,
    config: &EngineConfig,
    rank: usize,
    all_reduce: Arc<dyn AllReduce>,
    device: &Device,
) -> Result<Qwen2Model> {
    let size = config.tensor_parallel_size;
    let model_config = match source {
        ModelSource::Checkpoint(dir) => Qwen2Config::from_file(dir.join("config.json"))?,
        ModelSource::Random(c, _) => c.clone(),
    };
    let tp = TpRank::new(rank, size, &model_config)
        .map_err(|e| EngineError::config("tensor_parallel_size", e.to_string()))?;
    let parallel = Some(Parallel {
        rank: tp,
        all_reduce,
        vocab_parallel: config.vocab_parallel,
    });
    let model = match source {
        ModelSource::Checkpoint(dir) => {
            let mut ckpt = Checkpoint::open(dir)?;
            let model = Qwen2Model::from_checkpoint_part(
                model_config,
                &mut ckpt,
                parallel,
                config.dtype(),
                device,
            )?;
            ckpt.finish()?;
            model
        }
        ModelSource::Random(..) => {
            Qwen2Model::dummy_part(model_config, parallel, config.dtype(), device)?
        }
    };
    Ok(model)
}

/// A worker after loading its share: start-up as rank 0's, then the steps `next` yields until
/// `Stop` or the end of the messages, calling `finished` after each.
pub(crate) fn serve_steps(
    model: Qwen2Model,
    dir: Option<&Path>,
    device: Device,
    config: EngineConfig,
    mut next: impl FnMut() -> Result<Option<ToWorker>>,
    mut finished: impl FnMut(),
) -> Result<()> {
    let StartUp { mut runner, .. } = start_up::start(model, dir, device, config)?;
    let shard = LogitsShard::of(runner.model());
    let mut logits: Option<Tensor<2>> = None;
    while let Some(message) = next()? {
        match message {
            ToWorker::Forward(seqs) => {
                let seqs: Vec<StepSeq<'_>> = seqs.iter().map(PlannedSeq::as_step).collect();
                logits = runner.forward(&seqs)?;
            }
            ToWorker::Sample(plan) => {
                let logits = logits
                    .take()
                    .ok_or_else(|| EngineError::Device("a sampling plan without logits".into()))?;
                (*plan).enqueue(logits, runner.draws(), shard.as_ref(), false)?;
            }
            ToWorker::Stall(duration) => std::thread::sleep(duration),
            ToWorker::Stop => break,
        }
        finished();
    }
    Ok(())
}
