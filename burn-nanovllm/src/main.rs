//! The `burn-nanovllm` command line: `generate` text, or dump `logits` for parity checks.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::DType;
use burn_nanovllm::{DeviceKind, LLM, LlmOptions, Prompt, SamplingParams};
use clap::{Args, Parser, Subcommand};
use model_qwen2::{AttentionMetadata, KvCache, LogitsRows};

#[derive(Parser)]
#[command(
    name = "burn-nanovllm",
    version,
    about = "Qwen2-family LLM inference on Burn + CubeCL"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a completion for a prompt and print it.
    Generate(GenerateArgs),
    /// Write the prompt logits and greedy continuations of token-id prompts to a safetensors
    /// file (used by scripts/hf_parity.py to compare with transformers).
    Logits(LogitsArgs),
}

#[derive(Args)]
struct ModelArgs {
    /// Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// cpu (pure-Rust reference backend), cubecl-cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: DeviceKind,
    /// Compute dtype: f32, bf16 or f16 (default: f32 on CPUs, bf16 on CUDA).
    #[arg(long, value_parser = parse_dtype)]
    dtype: Option<DType>,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt in the chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Sampling seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Keep going past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
}

#[derive(Args)]
struct LogitsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSON file holding a list of prompts, each a list of token ids.
    #[arg(long)]
    ids: PathBuf,
    /// Output safetensors file: `prompt.{i}.logits [L, V]` (f32) and `prompt.{i}.greedy_ids [N]`.
    #[arg(long)]
    out: PathBuf,
    /// Greedy tokens to generate after each prompt (with the KV cache).
    #[arg(long, default_value_t = 64)]
    greedy: usize,
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    match s {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        "f16" => Ok(DType::F16),
        _ => Err(format!("unknown dtype `{s}` (expected f32, bf16 or f16)")),
    }
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Generate(args) => generate(args),
        Command::Logits(args) => logits(args),
    }
}

fn load(args: &ModelArgs) -> Result<LLM> {
    let options = LlmOptions {
        device: args.device,
        dtype: args.dtype,
        ..LlmOptions::default()
    };
    let start = Instant::now();
    let llm = LLM::new(&args.model, options)
        .with_context(|| format!("loading {}", args.model.display()))?;
    eprintln!(
        "loaded {} in {:.2?} on {:?} ({:?})",
        args.model.display(),
        start.elapsed(),
        args.device,
        llm.model().dtype()
    );
    Ok(llm)
}

fn generate(args: GenerateArgs) -> Result<()> {
    let llm = load(&args.model)?;
    let prompt = if args.chat {
        llm.chat_prompt(&args.prompt)?
    } else {
        Prompt::Text(args.prompt.clone())
    };
    let params = SamplingParams {
        temperature: args.temperature,
        max_tokens: args.max_tokens,
        ignore_eos: args.ignore_eos,
        seed: args.seed,
    };
    let start = Instant::now();
    let out = llm.generate(&[prompt], &params)?.remove(0);
    let secs = start.elapsed().as_secs_f64();
    println!("{}", out.text.unwrap_or_default());
    eprintln!(
        "{} prompt + {} generated tokens in {secs:.2} s ({:.1} tokens/s, finish: {:?})",
        out.prompt_token_ids.len(),
        out.token_ids.len(),
        out.token_ids.len() as f64 / secs,
        out.finish_reason
    );
    Ok(())
}

fn logits(args: LogitsArgs) -> Result<()> {
    let llm = load(&args.model)?;
    let text = std::fs::read_to_string(&args.ids)
        .with_context(|| format!("reading {}", args.ids.display()))?;
    let prompts: Vec<Vec<u32>> =
        serde_json::from_str(&text).context("ids file must be a JSON list of lists of ids")?;
    let model = llm.model();
    let device = llm.device();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (i, ids) in prompts.iter().enumerate() {
        if ids.is_empty() {
            bail!("prompt {i} is empty");
        }
        let block_size = 16;
        let blocks = (ids.len() + args.greedy).div_ceil(block_size);
        let table: Vec<u32> = (0..blocks as u32).collect();
        let mut cache = KvCache::new(&model.config, blocks, block_size, model.dtype(), device)?;
        let meta =
            AttentionMetadata::prefill(vec![ids.len()], vec![table.clone()], block_size, device)?;
        let logits = model.forward(
            model.input_ids(ids, device)?,
            &meta,
            &mut cache,
            LogitsRows::All,
        );
        let [l, v] = logits.dims();
        let host = logits
            .into_data()
            .try_into_vec_as::<f32>()
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let mut next = argmax(&host[(l - 1) * v..]);
        tensors.push((
            format!("prompt.{i}.logits"),
            safetensors::Dtype::F32,
            vec![l, v],
            f32_bytes(&host),
        ));
        let mut greedy = Vec::with_capacity(args.greedy);
        let mut len = ids.len();
        while greedy.len() < args.greedy {
            greedy.push(next as i64);
            len += 1;
            let meta =
                AttentionMetadata::decode(vec![len], vec![table.clone()], block_size, device)?;
            let logits = model.forward(
                model.input_ids(&[next], device)?,
                &meta,
                &mut cache,
                LogitsRows::All,
            );
            next = argmax(
                &logits
                    .into_data()
                    .try_into_vec_as::<f32>()
                    .map_err(|e| anyhow::anyhow!("{e:?}"))?,
            );
        }
        let bytes = greedy.iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push((
            format!("prompt.{i}.greedy_ids"),
            safetensors::Dtype::I64,
            vec![greedy.len()],
            bytes,
        ));
        eprintln!("prompt {i}: {} tokens, {} greedy", ids.len(), greedy.len());
    }
    let views = tensors
        .iter()
        .map(|(n, d, s, b)| {
            Ok((
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, &args.out)?;
    Ok(())
}

fn argmax(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
        )
        .0 as u32
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
