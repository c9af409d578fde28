//! The `burn-nanovllm` command line: `generate` completions, `chat` in the terminal, `serve` an
//! OpenAI-compatible API, or dump `logits` for parity checks.

mod cli;

use anyhow::Result;
use clap::{Parser, Subcommand};

use cli::commands::{ChatArgs, GenerateArgs, LogitsArgs, ServeArgs, chat, generate, logits, serve};

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
    /// Generate completions for one or more prompts and print them.
    Generate(GenerateArgs),
    /// Chat in the terminal (history kept, replies streamed; /reset, /exit, Ctrl-D).
    Chat(ChatArgs),
    /// Serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models,
    /// /health, /metrics).
    Serve(ServeArgs),
    /// Write the prompt logits and greedy continuations of token-id prompts to a safetensors
    /// file (used by scripts/hf_parity.py to compare with transformers).
    Logits(LogitsArgs),
}

fn main() -> Result<()> {
    // A tensor-parallel worker process serves its rank and exits here.
    burn_nanovllm::serve_if_worker();
    // vLLM's `-tp`.
    let args = std::env::args().map(|a| match a.as_str() {
        "-tp" => "--tensor-parallel-size".to_string(),
        _ => a,
    });
    match Cli::parse_from(args).command {
        Command::Generate(args) => generate(args),
        Command::Chat(args) => chat(args),
        Command::Serve(args) => serve(args),
        Command::Logits(args) => logits(args),
    }
}
