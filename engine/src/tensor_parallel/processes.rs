//! Ranks as processes, one per CUDA GPU, over NCCL: rank 0 (the engine's process) starts this
//! same executable once per other rank with [`WORKER_ENV`] set and `CUDA_VISIBLE_DEVICES`
//! naming the rank's GPU; the worker's `main` must call [`serve_if_worker`] first (the CLI and
//! the benches do; a program that builds a tensor-parallel engine on CUDA must too, as
//! Python programs guard `__main__` for vLLM's spawned workers).
//!
//! Messages: on the worker's stdin, each a little-endian `u32` length and a MessagePack body;
//! first a `Hello` (where the weights come from, the options, the NCCL id, the rank), then
//! `ToWorker` steps. The end of stdin (rank 0 gone) ends the worker, and so does a thread that
//! sees rank 0's process gone while the worker waits elsewhere (NCCL's set-up, a load). The
//! worker reports each finished message on its stderr (a line `ACK_PREFIX` + count; rank 0
//! passes every other line on to its own stderr), which rank 0's watchdog reads to find a hung
//! worker (killed).
//! A thread per worker notices its exit and aborts rank 0's communicator, so that rank 0's
//! pending and later collectives fail at once instead of waiting for it; rank 0's next message
//! to it then fails naming the rank and its exit status (or the hang it was killed for).

use std::io::{BufRead, Read, Write};
use std::process::{Child, ChildStderr, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use model_qwen2::AllReduce;
use serde::{Deserialize, Serialize};

use super::{Link, ModelSource, Outgoing, Progress, ToWorker, Workers, load_rank, serve_steps};
use crate::config::EngineConfig;
use crate::error::{EngineError, Result};

/// Set in a worker process's environment (to its rank).
pub const WORKER_ENV: &str = "BURN_NANOVLLM_TP_WORKER";

/// Longest a worker may take to leave after `Stop` before it is killed.
const LEAVE_TIMEOUT: Duration = Duration::from_secs(10);

/// The start of a worker's stderr line that reports how many step messages it has finished.
const ACK_PREFIX: &str = "\u{1}burn-nanovllm-tp-done ";

/// The first message to a worker.
#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    source: ModelSource,
    /// The options, the device being the worker's one visible GPU.
    config: EngineConfig,
    /// [`cubecl_kernels::NcclId::to_hex`].
    nccl_id: String,
    /// The id of the group's second communicator, for the collectives outside the step
    /// graphs (with the vocabulary split: the sampler's exchange).
    outside_graphs_id: Option<String>,
    rank: usize,
}

/// In a worker process (started by rank 0 with [`WORKER_ENV`] set): serves as that rank and
/// exits the process (status 1 on failure, with the error on stderr). Elsewhere returns at
/// once. Call it first in `main` of any program that builds a tensor-parallel engine on CUDA.
pub fn serve_if_worker() {
    let Some(rank) = std::env::var_os(WORKER_ENV) else {
        return;
    };
    leave_with_parent(rank.to_string_lossy().into_owned());
    let code = match serve() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!(
                "burn-nanovllm: tensor-parallel rank {}: {e}",
                rank.to_string_lossy()
            );
            1
        }
    };
    std::process::exit(code);
}

/// Ends this worker process when rank 0's process is gone (the worker was re-parented), even
/// while it waits inside NCCL's set-up or a long load, where it reads no message and would not
/// see its stdin end.
fn leave_with_parent(rank: String) {
    #[cfg(unix)]
    {
        let parent = std::os::unix::process::parent_id();
        let _ = std::thread::Builder::new()
            .name("tp-parent-watch".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(Duration::from_millis(200));
                    if std::os::unix::process::parent_id() != parent {
                        eprintln!("burn-nanovllm: tensor-parallel rank {rank}: rank 0 is gone");
                        std::process::exit(1);
                    }
                }
            });
    }
    #[cfg(not(unix))]
    let _ = rank;
}

/// True in a worker process.
pub(crate) fn is_worker() -> bool {
    std::env::var_os(WORKER_ENV).is_some()
}

fn serve() -> Result<()> {
    let mut stdin = std::io::stdin().lock();
    let hello: Hello = read_message(&mut stdin)?
        .ok_or_else(|| EngineError::Device("rank 0 left before the first message".into()))?;
    let device = hello.config.device.device()?;
    let all_reduce = join_group(
        &hello.config,
        &hello.nccl_id,
        hello.outside_graphs_id.as_deref(),
        hello.rank,
        &device,
    )?;
    let model = load_rank(
        &hello.source,
        &hello.config,
        hello.rank,
        all_reduce,
        &device,
    )?;
    let mut done = 0u64;
    serve_steps(
        model,
        hello.source.dir(),
        device,
        hello.config,
        || read_message(&mut stdin),
        || {
            done += 1;
            eprintln!("{ACK_PREFIX}{done}");
        },
    )
}

/// This process's member of the group named by `nccl_id` (and of its second communicator,
/// `outside_graphs_id`, joined after it as every rank does).
#[cfg(feature = "cuda")]
fn join_group(
    config: &EngineConfig,
    nccl_id: &str,
    outside_graphs_id: Option<&str>,
    rank: usize,
    device: &burn::tensor::Device,
) -> Result<Arc<dyn AllReduce>> {
    let cubecl_kernels::DeviceKind::Cuda(index) = config.device else {
        return Err(EngineError::config(
            "tensor_parallel_size",
            format!(
                "worker processes run on CUDA devices (device {:?})",
                config.device
            ),
        ));
    };
    let size = config.tensor_parallel_size;
    let id = cubecl_kernels::NcclId::from_hex(nccl_id)?;
    let comm = cubecl_kernels::NcclComm::join(id, rank, size, index)?;
    let outside_graphs = match outside_graphs_id {
        Some(hex) => {
            let id = cubecl_kernels::NcclId::from_hex(hex)?;
            Some(cubecl_kernels::NcclComm::join(id, rank, size, index)?)
        }
        None => None,
    };
    Ok(Arc::new(model_qwen2::NcclAllReduce {
        comm,
        outside_graphs,
        device: device.clone(),
    }))
}

#[cfg(not(feature = "cuda"))]
fn join_group(
    _: &EngineConfig,
    _: &str,
    _: Option<&str>,
    _: usize,
    _: &burn::tensor::Device,
) -> Result<Arc<dyn AllReduce>> {
    Err(EngineError::config(
        "tensor_parallel_size",
        "this build has no CUDA runtime".into(),
    ))
}

/// The `CUDA_VISIBLE_DEVICES` of rank `rank`'s process when rank 0 runs on this process's CUDA
/// device `first`: the GPU `rank` places after it, as this process's own `CUDA_VISIBLE_DEVICES`
/// names it (if set). Every process that starts ranks as processes places them so.
pub fn worker_gpu(first: usize, rank: usize) -> Result<String> {
    let gpu = first + rank;
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(list) => {
            let list: Vec<&str> = list.split(',').map(str::trim).collect();
            list.get(gpu).map(|name| name.to_string()).ok_or_else(|| {
                EngineError::config(
                    "tensor_parallel_size",
                    format!(
                        "rank {rank} needs GPU {gpu}, but CUDA_VISIBLE_DEVICES lists {}",
                        list.len()
                    ),
                )
            })
        }
        Err(_) => Ok(gpu.to_string()),
    }
}

/// Rank 0 on CUDA device `index`: starts the other ranks' processes on the GPUs after it,
/// joins the NCCL group with them, and returns its collective and the workers.
#[cfg(feature = "cuda")]
pub(crate) fn spawn(
    source: &ModelSource,
    config: &EngineConfig,
    index: usize,
    device: &burn::tensor::Device,
) -> Result<(Arc<dyn AllReduce>, Workers)> {
    let size = config.tensor_parallel_size;
    let id = cubecl_kernels::NcclId::new()?;
    // With the vocabulary split, the sampler's exchange runs outside the step graphs every
    // step: on a communicator of its own.
    let outside_graphs_id = match config.vocab_parallel {
        true => Some(cubecl_kernels::NcclId::new()?),
        false => None,
    };
    let exe = std::env::current_exe()
        .map_err(|e| EngineError::Device(format!("tensor parallelism: this executable: {e}")))?;
    let mut links: Vec<Box<dyn Link>> = Vec::new();
    let mut workers = Vec::new();
    for rank in 1..size {
        let gpu_name = worker_gpu(index, rank)?;
        let mut child = Command::new(&exe)
            .env(WORKER_ENV, rank.to_string())
            .env("CUDA_VISIBLE_DEVICES", &gpu_name)
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| EngineError::Device(format!("tensor-parallel rank {rank}: {e}")))?;
        let mut stdin = child.stdin.take().expect("piped stdin");
        let hello = Hello {
            source: source.clone(),
            config: EngineConfig {
                device: cubecl_kernels::DeviceKind::Cuda(0),
                ..config.clone()
            },
            nccl_id: id.to_hex(),
            outside_graphs_id: outside_graphs_id.as_ref().map(|id| id.to_hex()),
            rank,
        };
        write_message(&mut stdin, &hello)
            .map_err(|e| EngineError::Device(format!("tensor-parallel rank {rank}: {e}")))?;
        workers.push((rank, child, stdin));
    }
    let joined = join_watching(&mut workers, move || {
        let comm = cubecl_kernels::NcclComm::join(id, 0, size, index)?;
        let outside_graphs = match outside_graphs_id {
            Some(id) => Some(cubecl_kernels::NcclComm::join(id, 0, size, index)?),
            None => None,
        };
        Ok((comm, outside_graphs))
    });
    let (comm, outside_graphs) = match joined {
        Ok(joined) => joined,
        Err(e) => {
            for (_, child, _) in &mut workers {
                let _ = child.kill();
                let _ = child.wait();
            }
            return Err(e);
        }
    };
    let all_reduce: Arc<dyn AllReduce> = Arc::new(model_qwen2::NcclAllReduce {
        comm,
        outside_graphs,
        device: device.clone(),
    });
    for (rank, child, stdin) in workers {
        links.push(Box::new(ProcessLink::watch(
            rank,
            child,
            stdin,
            all_reduce.clone(),
        )));
    }
    let timeout = config.tensor_parallel_step_timeout;
    Ok((all_reduce.clone(), Workers::new(links, all_reduce, timeout)))
}

/// Runs `join` (rank 0's entry into the group, which NCCL's blocking set-up makes wait for
/// every rank) on a thread of its own while watching the workers: one that exits before the
/// group has formed ends the wait with an error naming its rank and quoting the end of its
/// stderr, instead of a wait without end (the joining thread is then left blocked).
#[cfg(feature = "cuda")]
fn join_watching<T: Send + 'static>(
    workers: &mut [(usize, Child, ChildStdin)],
    join: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    use std::sync::mpsc::RecvTimeoutError;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("tp-join".into())
        .spawn(move || {
            let _ = tx.send(join());
        })
        .map_err(|e| EngineError::Device(format!("tensor parallelism: a thread: {e}")))?;
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(joined) => return joined,
            Err(RecvTimeoutError::Disconnected) => {
                return Err(EngineError::Device(
                    "tensor parallelism: joining the group panicked".into(),
                ));
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
        for (rank, child, _) in workers.iter_mut() {
            if let Ok(Some(status)) = child.try_wait() {
                let mut said = String::new();
                if let Some(mut stderr) = child.stderr.take() {
                    let _ = stderr.read_to_string(&mut said);
                }
                let lines: Vec<&str> = said.lines().collect();
                return Err(EngineError::Device(format!(
                    "tensor-parallel rank {rank} exited before the group formed ({status}): {}",
                    lines[lines.len().saturating_sub(3)..].join(" | ")
                )));
            }
        }
    }
}

/// A worker process and its watchdog.
struct ProcessLink {
    rank: usize,
    stdin: ChildStdin,
    child: Arc<Mutex<Child>>,
    /// Set when the worker exited (its status) or was found hung (why it was killed).
    exited: Arc<Mutex<Option<String>>>,
    stopping: Arc<std::sync::atomic::AtomicBool>,
    progress: Arc<Progress>,
}

/// Reads a worker's stderr: its finished-message counts into `progress`, every other line
/// on to this process's stderr.
fn forward_stderr(stderr: ChildStderr, progress: Arc<Progress>) {
    let _ = std::thread::Builder::new()
        .name("tp-worker-stderr".into())
        .spawn(move || {
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                match line.strip_prefix(ACK_PREFIX).map(str::parse::<u64>) {
                    Some(Ok(n)) => progress.set_done(n),
                    _ => eprintln!("{line}"),
                }
            }
        });
}

impl ProcessLink {
    fn watch(rank: usize, mut child: Child, stdin: ChildStdin, group: Arc<dyn AllReduce>) -> Self {
        let progress = Arc::new(Progress::default());
        if let Some(stderr) = child.stderr.take() {
            forward_stderr(stderr, progress.clone());
        }
        let child = Arc::new(Mutex::new(child));
        let exited = Arc::new(Mutex::new(None));
        let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (c, e, s) = (child.clone(), exited.clone(), stopping.clone());
        std::thread::spawn(move || {
            loop {
                let status = c.lock().unwrap_or_else(|p| p.into_inner()).try_wait();
                match status {
                    Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                    Ok(Some(status)) => {
                        let text = format!("tensor-parallel rank {rank} exited ({status})");
                        // A worker killed as hung keeps that reason.
                        let text = e
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(text)
                            .clone();
                        if !s.load(std::sync::atomic::Ordering::Acquire) {
                            group.abort(&text);
                        }
                        return;
                    }
                    Err(_) => return,
                }
            }
        });
        Self {
            rank,
            stdin,
            child,
            exited,
            stopping,
            progress,
        }
    }
}

impl Link for ProcessLink {
    fn send(&mut self, message: &Outgoing<'_>) -> Result<()> {
        if let Some(status) = self
            .exited
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            return Err(EngineError::Device(status));
        }
        if matches!(message.message(), ToWorker::Stop) {
            self.stopping
                .store(true, std::sync::atomic::Ordering::Release);
        }
        write_frame(&mut self.stdin, message.encoded()?)
            .map_err(|e| EngineError::Device(format!("tensor-parallel rank {}: {e}", self.rank)))
    }

    fn join(&mut self) {
        let deadline = Instant::now() + LEAVE_TIMEOUT;
        while Instant::now() < deadline {
            if self
                .exited
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some()
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.lock().unwrap_or_else(|p| p.into_inner()).kill();
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn progress(&self) -> &Arc<Progress> {
        &self.progress
    }

    fn stopper(&self) -> Box<dyn Fn(&str) + Send> {
        let (child, exited) = (self.child.clone(), self.exited.clone());
        Box::new(move |reason| {
            exited
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert_with(|| format!("{reason}; killed"));
            let _ = child.lock().unwrap_or_else(|p| p.into_inner()).kill();
        })
    }
}

fn write_message<T: Serialize>(out: &mut impl Write, message: &T) -> std::io::Result<()> {
    let body = rmp_serde::to_vec(message).map_err(std::io::Error::other)?;
    write_frame(out, &body)
}

/// One frame: the body's length (`u32`, little-endian), then the body.
fn write_frame(out: &mut impl Write, body: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(body.len()).map_err(std::io::Error::other)?;
    out.write_all(&len.to_le_bytes())?;
    out.write_all(body)?;
    out.flush()
}

/// The next message, or `None` at the end of the stream.
fn read_message<T: for<'de> Deserialize<'de>>(input: &mut impl Read) -> Result<Option<T>> {
    let mut len = [0u8; 4];
    match input.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(EngineError::Device(format!("reading a step: {e}"))),
    }
    let mut body = vec![0u8; u32::from_le_bytes(len) as usize];
    input
        .read_exact(&mut body)
        .map_err(|e| EngineError::Device(format!("reading a step: {e}")))?;
    rmp_serde::from_slice(&body)
        .map(Some)
        .map_err(|e| EngineError::Device(format!("decoding a step: {e}")))
}
