//! `downstream smoke [DEVICE]`: greedy generation through burn-nanovllm's `LLM` with its default
//! model, printed.
//! `downstream swap [DEVICE] [DTYPE] [TOKENS] [REPS]`: [`Block`] and [`FusedBlock`] on the same
//! input: their difference, then the time of each forward (after a warm-up).
//! DEVICE: `cpu` (default), `cubecl-cpu`, `cuda`; DTYPE: `f32` (default), `bf16`, `f16`.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::{DType, Distribution, Tensor};
use burn_nanovllm::{DeviceKind, EngineConfig, LLM, Prompt, SamplingParams};
use downstream::{Block, BlockConfig, FusedBlock};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or(default.into());
    let device: DeviceKind = arg(1, "cpu").parse().context("device")?;
    match arg(0, "smoke").as_str() {
        "smoke" => smoke(device),
        "swap" => {
            let dtype = match arg(2, "f32").as_str() {
                "f32" => DType::F32,
                "bf16" => DType::BF16,
                "f16" => DType::F16,
                other => bail!("dtype {other}: expected f32, bf16 or f16"),
            };
            swap(device, dtype, arg(3, "512").parse()?, arg(4, "20").parse()?)
        }
        other => bail!("unknown command {other}: smoke or swap"),
    }
}

fn smoke(device: DeviceKind) -> Result<()> {
    let config = EngineConfig {
        device,
        ..EngineConfig::default()
    };
    let mut llm = LLM::new(burn_nanovllm::default_model_dir(), config)?;
    let out = llm.generate(
        &[Prompt::from("It was a dark and stormy night, and")],
        &SamplingParams::greedy(24),
    )?;
    let text = out[0].text.as_deref().unwrap_or_default();
    println!("{:?} on {device:?}: {text}", out[0].token_ids);
    // Decided when cubecl-kernels was built: the published cubecl-cuda (a plain dependency) or
    // the patched one (the `[patch]` lines of the README's "As a library").
    let route = if cubecl_kernels::cublas_stream_ordered() {
        "on CubeCL's stream, inside CUDA graphs (patched cubecl-cuda)"
    } else {
        "fenced on a stream of its own, outside CUDA graphs (published cubecl-cuda)"
    };
    println!("cuBLASLt route of this build: {route}");
    Ok(())
}

/// A Qwen2-0.5B-sized block (H = 896, 14 heads, I = 4864) over one sequence of `tokens`.
fn swap(device: DeviceKind, dtype: DType, tokens: usize, reps: usize) -> Result<()> {
    let dev = device.device()?;
    let config = BlockConfig {
        hidden: 896,
        heads: 14,
        intermediate: 4864,
    };
    let block = Block::random(config, dtype, &dev);
    let fused = FusedBlock::from_block(&block);
    let x = Tensor::<3>::random([1, tokens, config.hidden], Distribution::Default, (&dev, dtype));
    let a = block.forward(x.clone()).cast(DType::F32);
    let b = fused.forward(x.clone()).cast(DType::F32);
    let err = ((a.clone() - b).square().sum().into_scalar::<f32>()
        / a.square().sum().into_scalar::<f32>())
    .sqrt();
    println!("{device:?} {dtype:?} {tokens} tokens: relative difference {err:.2e}");
    let burn_ms = time(&dev, reps, || block.forward(x.clone()))?;
    let fused_ms = time(&dev, reps, || fused.forward(x.clone()))?;
    println!(
        "block forward, mean of {reps} after 3 warm-ups: Burn modules {burn_ms:.3} ms, fused ops \
         {fused_ms:.3} ms ({:.2}×)",
        burn_ms / fused_ms
    );
    Ok(())
}

/// Milliseconds per call of `forward` over `reps` calls, after 3 warm-ups (the outputs are kept
/// until the device is synchronised: a lazy backend skips work whose result is dropped).
fn time(dev: &burn::tensor::Device, reps: usize, forward: impl Fn() -> Tensor<3>) -> Result<f64> {
    let warm: Vec<_> = (0..3).map(|_| forward()).collect();
    dev.sync()?;
    drop(warm);
    let start = Instant::now();
    let outs: Vec<_> = (0..reps).map(|_| forward()).collect();
    dev.sync()?;
    drop(outs);
    Ok(start.elapsed().as_secs_f64() * 1e3 / reps as f64)
}
