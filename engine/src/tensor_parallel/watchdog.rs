//! Rank 0's watchdog over its workers' progress: a worker that has not finished a step message
//! for the step timeout is hung (its host blocked: a device that stopped, a deadlock); the
//! watchdog ends it where it can (a process is killed) and aborts the group with a reason
//! naming the rank, so that rank 0's pending and later collectives fail instead of waiting.
//! A worker exiting is the transports' own watch ([`super::processes`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use model_qwen2::AllReduce;

use super::{Link, Progress};

/// How often the watchdog looks.
const PERIOD: Duration = Duration::from_millis(50);

/// One worker as the watchdog sees it.
struct Watched {
    rank: usize,
    progress: Arc<Progress>,
    stop: Box<dyn Fn(&str) + Send>,
    /// Since when the worker has had unfinished messages, and how many it had finished then.
    behind_since: Option<(Instant, u64)>,
}

/// Starts the watchdog over `links` (until `stopped`).
pub(super) fn spawn(
    links: &[Box<dyn Link>],
    group: Arc<dyn AllReduce>,
    timeout: Duration,
    stopped: Arc<AtomicBool>,
) {
    let mut watched: Vec<Watched> = links
        .iter()
        .map(|l| Watched {
            rank: l.rank(),
            progress: l.progress().clone(),
            stop: l.stopper(),
            behind_since: None,
        })
        .collect();
    let _ = std::thread::Builder::new()
        .name("tp-watchdog".into())
        .spawn(move || {
            while !stopped.load(Ordering::Acquire) {
                std::thread::sleep(PERIOD);
                let now = Instant::now();
                for w in &mut watched {
                    let sent = w.progress.sent.load(Ordering::Acquire);
                    let done = w.progress.done.load(Ordering::Acquire);
                    w.behind_since = match w.behind_since {
                        _ if done >= sent => None,
                        Some((since, at)) if at == done => Some((since, at)),
                        _ => Some((now, done)),
                    };
                    let Some((since, _)) = w.behind_since else {
                        continue;
                    };
                    if now - since >= timeout && !stopped.load(Ordering::Acquire) {
                        let reason = format!(
                            "tensor-parallel rank {} hung: it has not finished a step in {:.1} s",
                            w.rank,
                            timeout.as_secs_f64()
                        );
                        group.abort(&reason);
                        (w.stop)(&reason);
                        return;
                    }
                }
            }
        });
}
