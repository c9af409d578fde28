//! Timing with device synchronisation: medians over many batches of back-to-back calls, after a
//! warm-up that covers autotuning and kernel compilation.

use std::time::Instant;

use burn::tensor::Device;

/// Median microseconds per call of `f`: `reps` batches of `per_batch` calls, each batch followed
/// by a device sync. Outputs stay alive until the sync (a lazy backend may skip work whose
/// result is dropped early).
pub fn median_us<T>(
    device: &Device,
    per_batch: usize,
    reps: usize,
    mut f: impl FnMut() -> T,
) -> f64 {
    let batch = |f: &mut dyn FnMut() -> T| {
        let start = Instant::now();
        let outs: Vec<T> = (0..per_batch).map(|_| f()).collect();
        device.sync().expect("device sync");
        let us = start.elapsed().as_secs_f64() * 1e6 / per_batch as f64;
        drop(outs);
        us
    };
    for _ in 0..3 {
        batch(&mut f);
    }
    let mut samples: Vec<f64> = (0..reps).map(|_| batch(&mut f)).collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// Median microseconds per call of `f`, measured by replaying a device graph that holds
/// `calls` back-to-back calls (so host and launch overhead drop out, as in a decode step replayed
/// with CUDA graphs). Backends without graphs re-run the closure.
pub fn graph_us<T>(device: &Device, calls: usize, reps: usize, mut f: impl FnMut() -> T) -> f64 {
    let mut graph = burn::tensor::capture(device, || (0..calls).map(|_| f()).collect::<Vec<T>>());
    // SAFETY: the closure only reads tensors its caller keeps alive for the whole measurement,
    // and nothing else runs on the device meanwhile.
    median_us(device, 10, reps, || unsafe {
        graph.replay();
    }) / calls as f64
}
