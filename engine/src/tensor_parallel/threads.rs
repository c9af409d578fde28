//! Ranks as threads of this process on CPU devices, over the host collective
//! ([`model_qwen2::HostAllReduce`]): the CPU path of tensor parallelism, which runs the split
//! through the engine in tests.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cubecl_kernels::DeviceKind;
use model_qwen2::AllReduce;

use super::{Link, ModelSource, Outgoing, Progress, ToWorker, Workers, load_rank, serve_steps};
use crate::config::EngineConfig;
use crate::error::{EngineError, Result, panic_text};

/// Longest a worker thread may take to leave after `Stop` before it is left running (a hung
/// thread cannot be ended).
const LEAVE_TIMEOUT: Duration = Duration::from_secs(10);

/// A worker thread.
struct ThreadLink {
    rank: usize,
    tx: Sender<ToWorker>,
    thread: Option<JoinHandle<()>>,
    progress: Arc<Progress>,
}

impl Link for ThreadLink {
    fn send(&mut self, message: &Outgoing<'_>) -> Result<()> {
        self.tx.send(message.message().clone()).map_err(|_| {
            EngineError::Device(format!("tensor-parallel rank {} has stopped", self.rank))
        })
    }

    fn join(&mut self) {
        let Some(thread) = self.thread.take() else {
            return;
        };
        let deadline = Instant::now() + LEAVE_TIMEOUT;
        while !thread.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        if thread.is_finished() {
            let _ = thread.join();
        }
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn progress(&self) -> &Arc<Progress> {
        &self.progress
    }

    fn stopper(&self) -> Box<dyn Fn(&str) + Send> {
        // A thread cannot be ended from outside: the aborted group fails its collectives.
        Box::new(|_| {})
    }
}

/// Starts ranks `1..group.len()` as threads, each loading its share of `dir` and starting up
/// as rank 0 does; `group[r]` is rank `r`'s collective.
pub(crate) fn spawn(
    source: &ModelSource,
    config: &EngineConfig,
    group: &[Arc<dyn AllReduce>],
) -> Result<Workers> {
    if !matches!(config.device, DeviceKind::Cpu | DeviceKind::CubeclCpu) {
        return Err(EngineError::config(
            "tensor_parallel_size",
            format!(
                "ranks as threads run on CPU devices only (device {:?})",
                config.device
            ),
        ));
    }
    let mut links: Vec<Box<dyn Link>> = Vec::new();
    for (rank, all_reduce) in group.iter().enumerate().skip(1) {
        let (tx, rx) = channel();
        let progress = Arc::new(Progress::default());
        let (source, config, all_reduce, p) = (
            source.clone(),
            config.clone(),
            all_reduce.clone(),
            progress.clone(),
        );
        let thread = std::thread::Builder::new()
            .name(format!("tp-rank-{rank}"))
            .spawn(move || run(source, config, rank, all_reduce, rx, p))
            .map_err(|e| EngineError::Device(format!("tensor-parallel rank {rank}: {e}")))?;
        links.push(Box::new(ThreadLink {
            rank,
            tx,
            thread: Some(thread),
            progress,
        }));
    }
    Ok(Workers::new(
        links,
        group[0].clone(),
        config.tensor_parallel_step_timeout,
    ))
}

/// A worker thread's life; a failure (an error or a panic) aborts the group with its reason.
fn run(
    source: ModelSource,
    config: EngineConfig,
    rank: usize,
    all_reduce: Arc<dyn AllReduce>,
    steps: Receiver<ToWorker>,
    progress: Arc<Progress>,
) {
    let group = all_reduce.clone();
    let run = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let device = config.device.device()?;
        let model = load_rank(&source, &config, rank, all_reduce, &device)?;
        serve_steps(
            model,
            source.dir(),
            device,
            config,
            || Ok(steps.recv().ok()),
            || progress.finished(),
        )
    }));
    let reason = match run {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e.to_string(),
        Err(panic) => panic_text(panic.as_ref()),
    };
    group.abort(&reason);
}
