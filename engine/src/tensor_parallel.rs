//! Tensor parallelism in the engine: rank 0 is the [`crate::LLMEngine`] (scheduler, block
//! manager, sampler decisions, outputs); ranks `1..size` are workers that hold their share of
//! the model and of the KV cache and replay each step rank 0 plans.
//!
//! Layout: a worker starts up exactly as rank 0 does (the same warm-ups, KV-pool sizing and
//! graph captures, so both issue the same collectives in the same order), then waits for
//! steps. Each step rank 0 sends the worker what its runner needs — the step's sequences
//! ([`PlannedSeq`]: new token ids, positions, block tables, which rows sample and which take
//! the previous step's draws) before it enqueues its own forward, and the sampling plan
//! ([`SamplePlan`]: penalties, token masks, each row's seeded draw) once it has made it. Every
//! rank computes the same logits (the row-split products are summed over the ranks, and the
//! LM head is whole on every rank) and draws with the same plan, so every rank's standing
//! draws buffer holds the same tokens and the next step's device-fed tokens agree without any
//! exchange. Only rank 0 reads the draws back.
//!
//! Here the workers are threads of this process over the host collective
//! ([`model_qwen2::HostAllReduce`]): the CPU path, which tests the split through the engine.
//! A worker that fails aborts the group, so that rank 0's next collective fails (its forward
//! panics, which the engine counts as a failed device) instead of waiting for it.

use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use burn::tensor::{Device, Tensor};
use model_qwen2::{AllReduce, Checkpoint, Parallel, Qwen2Config, Qwen2Model, TpRank};

use crate::config::EngineConfig;
use crate::error::{EngineError, Result};
use crate::sampler::SamplePlan;
use crate::start_up::{self, StartUp};
use crate::step::{PlannedSeq, StepSeq};

/// What rank 0 sends a worker.
enum ToWorker {
    /// Run this step's forward.
    Forward(Vec<PlannedSeq>),
    /// Sample the last forward's logits with this plan.
    Sample(SamplePlan),
    /// Leave.
    Stop,
}

/// Rank 0's handle on the other ranks.
pub(crate) struct Workers {
    senders: Vec<Sender<ToWorker>>,
    threads: Vec<JoinHandle<()>>,
    /// Rank 0's collective, aborted when rank 0 fails.
    all_reduce: Arc<dyn AllReduce>,
}

/// Loads rank `rank`'s share of the checkpoint in `dir` (of a group of `size` summed by
/// `all_reduce`) in `config`'s dtype on `device`.
pub(crate) fn load_rank(
    dir: &Path,
    config: &EngineConfig,
    rank: usize,
    all_reduce: Arc<dyn AllReduce>,
    device: &Device,
) -> Result<Qwen2Model> {
    let size = config.tensor_parallel_size;
    let model_config = Qwen2Config::from_file(dir.join("config.json"))?;
    let tp = TpRank::new(rank, size, &model_config)
        .map_err(|e| EngineError::config("tensor_parallel_size", e.to_string()))?;
    let mut ckpt = Checkpoint::open(dir)?;
    let parallel = Parallel {
        rank: tp,
        all_reduce,
    };
    let model = Qwen2Model::from_checkpoint_part(
        model_config,
        &mut ckpt,
        Some(parallel),
        config.dtype(),
        device,
    )?;
    ckpt.finish()?;
    Ok(model)
}

impl Workers {
    /// Starts ranks `1..group.len()` as threads, each loading its share of `dir` and starting
    /// up as rank 0 does; `group[r]` is rank `r`'s collective.
    pub(crate) fn spawn_threads(
        dir: &Path,
        config: &EngineConfig,
        group: &[Arc<dyn AllReduce>],
    ) -> Result<Self> {
        if !matches!(
            config.device,
            cubecl_kernels::DeviceKind::Cpu | cubecl_kernels::DeviceKind::CubeclCpu
        ) {
            return Err(EngineError::config(
                "tensor_parallel_size",
                format!(
                    "ranks as threads run on CPU devices only (device {:?})",
                    config.device
                ),
            ));
        }
        let mut senders = Vec::new();
        let mut threads = Vec::new();
        for (rank, all_reduce) in group.iter().enumerate().skip(1) {
            let (tx, rx) = channel();
            let (dir, config, all_reduce) = (dir.to_path_buf(), config.clone(), all_reduce.clone());
            let thread = std::thread::Builder::new()
                .name(format!("tp-rank-{rank}"))
                .spawn(move || run_worker(dir, config, rank, all_reduce, rx))
                .map_err(|e| EngineError::Device(format!("tensor-parallel rank {rank}: {e}")))?;
            senders.push(tx);
            threads.push(thread);
        }
        Ok(Self {
            senders,
            threads,
            all_reduce: group[0].clone(),
        })
    }

    /// Sends the step's sequences to every worker (before rank 0 enqueues its own forward).
    pub(crate) fn forward(&self, seqs: &[StepSeq<'_>]) -> Result<()> {
        let planned: Vec<PlannedSeq> = seqs.iter().map(PlannedSeq::of).collect();
        self.send(|| ToWorker::Forward(planned.clone()))
    }

    /// Sends the step's sampling plan to every worker.
    pub(crate) fn sample(&self, plan: &SamplePlan) -> Result<()> {
        self.send(|| ToWorker::Sample(plan.clone()))
    }

    /// Ends the group: rank 0 failed with `reason`.
    pub(crate) fn abort(&self, reason: &str) {
        self.all_reduce.abort(reason);
    }

    fn send(&self, message: impl Fn() -> ToWorker) -> Result<()> {
        for (i, tx) in self.senders.iter().enumerate() {
            tx.send(message()).map_err(|_| {
                EngineError::Device(format!("tensor-parallel rank {} has stopped", i + 1))
            })?;
        }
        Ok(())
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for tx in &self.senders {
            let _ = tx.send(ToWorker::Stop);
        }
        // A worker inside a collective (rank 0 stopped mid-step) leaves it too.
        self.all_reduce.abort("rank 0 has stopped");
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// A worker's life: start-up as rank 0's, then the steps it is sent, until `Stop` or rank 0
/// leaves. A failure (an error or a panic) aborts the group with its reason.
fn run_worker(
    dir: PathBuf,
    config: EngineConfig,
    rank: usize,
    all_reduce: Arc<dyn AllReduce>,
    steps: Receiver<ToWorker>,
) {
    let group = all_reduce.clone();
    let run = std::panic::catch_unwind(AssertUnwindSafe(|| {
        serve_steps(&dir, config, rank, all_reduce, steps)
    }));
    let reason = match run {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e.to_string(),
        Err(panic) => panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panicked".into()),
    };
    group.abort(&reason);
}

fn serve_steps(
    dir: &Path,
    config: EngineConfig,
    rank: usize,
    all_reduce: Arc<dyn AllReduce>,
    steps: Receiver<ToWorker>,
) -> Result<()> {
    let device = config.device.device()?;
    let model = load_rank(dir, &config, rank, all_reduce, &device)?;
    let StartUp { mut runner, .. } = start_up::start(model, Some(dir), device, config)?;
    let mut logits: Option<Tensor<2>> = None;
    while let Ok(message) = steps.recv() {
        match message {
            ToWorker::Forward(seqs) => {
                let seqs: Vec<StepSeq<'_>> = seqs.iter().map(PlannedSeq::as_step).collect();
                logits = runner.forward(&seqs)?;
            }
            ToWorker::Sample(plan) => {
                let logits = logits
                    .take()
                    .ok_or_else(|| EngineError::Device("a sampling plan without logits".into()))?;
                plan.enqueue(logits, runner.draws())?;
            }
            ToWorker::Stop => break,
        }
    }
    Ok(())
}
