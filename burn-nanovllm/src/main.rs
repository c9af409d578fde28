//! The `burn-nanovllm` command line: `generate` completions, `chat` in the terminal, `serve` an
//! OpenAI-compatible API, or dump `logits` for parity checks.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::DType;
use burn_nanovllm::hub::resolve_model;
use burn_nanovllm::server::{Server, ServerConfig, shutdown_signal};
use burn_nanovllm::{
    DeviceKind, EngineConfig, FinishReason, LLM, Prompt, SamplingParams, StructuredOutput,
};
use clap::{Args, Parser, Subcommand};

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

#[derive(Args)]
struct ModelArgs {
    /// Checkpoint folder (config.json, *.safetensors, tokenizer.json) or Hugging Face repo id
    /// (ORG/NAME, from the local Hugging Face cache, downloaded when online); by default the
    /// 7 M-parameter English model trained by scripts/tiny-model (served as `tiny-english`).
    #[arg(long)]
    model: Option<String>,
    /// Branch, tag or commit of a repo id.
    #[arg(long)]
    revision: Option<String>,
    /// cpu (pure-Rust reference backend), cubecl-cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: DeviceKind,
    /// Compute dtype: f32, bf16 or f16 (default: f32 on CPUs, bf16 on CUDA).
    #[arg(long, value_parser = parse_dtype)]
    dtype: Option<DType>,
}

/// Engine options (vLLM's names).
#[derive(Args)]
struct EngineArgs {
    /// Most sequences running at once (default: vLLM's, 1,024 on GPUs of at least 70 GiB, else
    /// 256; a default of 1,024 shrinks to what the KV pool holds at 1,024 tokens a sequence).
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// Most tokens computed per step.
    #[arg(long, default_value_t = EngineConfig::default().max_num_batched_tokens)]
    max_num_batched_tokens: usize,
    /// Longest prompt + completion (default: the model's max_position_embeddings).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV blocks in the pool (default: sized from free GPU memory, or 256 MiB on CPUs).
    #[arg(long)]
    num_kv_blocks: Option<usize>,
    /// Fraction of GPU memory the engine may use.
    #[arg(long, default_value_t = 0.9)]
    gpu_memory_utilization: f32,
    /// Run decode steps eagerly (no CUDA graphs).
    #[arg(long)]
    enforce_eager: bool,
    /// Synchronous steps: no overlapped scheduling (on by default on CUDA; for debugging).
    #[arg(long)]
    sync_steps: bool,
    /// Turn prefix caching off.
    #[arg(long)]
    no_prefix_caching: bool,
    /// Prompt tokens that waiting prompts must fill before they join a busy batch (0: at
    /// once; default: --max-num-batched-tokens).
    #[arg(long)]
    admission_tokens: Option<usize>,
    /// Ranks the model is split over (tensor parallelism; also `-tp`): on CUDA one process per
    /// GPU, --device's GPU and the ones after it; on CPU devices, threads.
    #[arg(long, default_value_t = 1)]
    tensor_parallel_size: usize,
    /// Under tensor parallelism, split the embedding and LM head by vocabulary rows (less
    /// memory per GPU; see docs/BENCHMARKS.md for its speed).
    #[arg(long)]
    vocab_parallel: bool,
    /// Batch-invariant inference: a request's tokens do not depend on what else runs with it
    /// (one reduction order per row, at some cost in speed).
    #[arg(long)]
    batch_invariant: bool,
}

/// Sampling options (vLLM's names); unset ones come from the model's generation_config.json.
#[derive(Args)]
struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Tokens to generate before end-of-sequence may stop.
    #[arg(long, default_value_t = 0)]
    min_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long)]
    temperature: Option<f32>,
    /// Nucleus sampling mass.
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep the k most likely tokens (0 = all).
    #[arg(long)]
    top_k: Option<u32>,
    /// Drop tokens below min_p × the top probability.
    #[arg(long)]
    min_p: Option<f32>,
    /// Repetition penalty (1 = off).
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Presence penalty.
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Frequency penalty.
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Sampling seed (each request gets it).
    #[arg(long)]
    seed: Option<u64>,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep going past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print the log-probability of each token and this many alternatives.
    #[arg(long)]
    logprobs: Option<usize>,
    /// Constrain the output to JSON valid under the JSON schema in this file.
    #[arg(long, value_name = "FILE", group = "structured")]
    json_schema: Option<PathBuf>,
    /// Constrain the output to any JSON object.
    #[arg(long, group = "structured")]
    json_object: bool,
    /// Constrain the output to this regular expression.
    #[arg(long, group = "structured")]
    regex: Option<String>,
    /// Constrain the output to one of these strings (repeatable).
    #[arg(long, group = "structured")]
    choice: Vec<String>,
    /// Constrain the output to the Lark grammar (llguidance's dialect) in this file.
    #[arg(long, value_name = "FILE", group = "structured")]
    grammar: Option<PathBuf>,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// A prompt (repeatable).
    #[arg(long)]
    prompt: Vec<String>,
    /// A file of prompts, one per line: a JSON string, or an object with a "prompt" field.
    #[arg(long)]
    prompts_file: Option<PathBuf>,
    /// Wrap each prompt in the chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// Hide the progress bar.
    #[arg(long)]
    no_progress: bool,
}

#[derive(Args)]
struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// A system message at the head of the conversation.
    #[arg(long)]
    system: Option<String>,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    /// Address to bind (loopback by default; 0.0.0.0 exposes the server).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* (default: $BURN_NANOVLLM_API_KEY).
    #[arg(long)]
    api_key: Option<String>,
    /// The model name clients send (default: the --model argument).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Most requests queued and running at once; past it, 503 with Retry-After.
    #[arg(long, default_value_t = 1024)]
    max_pending: usize,
    /// Seconds in-flight requests may run after SIGINT/SIGTERM before they are aborted.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
    /// Largest request body, bytes; larger ones are refused (413).
    #[arg(long, default_value_t = ServerConfig::default().max_body_bytes)]
    max_request_bytes: usize,
    /// Constraints (JSON schemas, regexes, grammars, tools) compiled at once.
    #[arg(long, default_value_t = ServerConfig::default().grammar_threads)]
    grammar_threads: usize,
    /// Seconds a constraint may take to compile before its request is refused (400).
    #[arg(long, default_value_t = ServerConfig::default().grammar_timeout.as_secs_f64())]
    grammar_timeout: f64,
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

impl ModelArgs {
    /// The checkpoint folder: `--model` resolved, or the default model's.
    fn dir(&self) -> Result<PathBuf> {
        match &self.model {
            Some(model) => Ok(resolve_model(model, self.revision.as_deref())?),
            None => Ok(burn_nanovllm::default_model_dir()),
        }
    }

    /// The name a server gives the model: the `--model` argument as given (vLLM's rule), or
    /// `tiny-english` for the default model.
    fn served_name(&self) -> String {
        self.model.clone().unwrap_or_else(|| "tiny-english".into())
    }
}

fn load(model: &ModelArgs, config: EngineConfig) -> Result<LLM> {
    let start = Instant::now();
    let dir = model.dir()?;
    let llm = LLM::new(&dir, config).with_context(|| format!("loading {}", dir.display()))?;
    let limits = llm.engine().limits();
    eprintln!(
        "loaded {} in {:.2?} on {:?} ({:?}): {} KV blocks of {} tokens, max_model_len {}, {}",
        dir.display(),
        start.elapsed(),
        model.device,
        limits.dtype,
        limits.num_kv_blocks,
        limits.block_size,
        limits.max_model_len,
        if limits.graph_sizes.is_empty() {
            "eager".to_string()
        } else {
            format!("{} decode graphs", limits.graph_sizes.len())
        }
    );
    Ok(llm)
}

fn engine_config(model: &ModelArgs, e: &EngineArgs) -> EngineConfig {
    EngineConfig {
        device: model.device,
        dtype: model.dtype,
        max_num_seqs: e.max_num_seqs,
        max_num_batched_tokens: e.max_num_batched_tokens,
        max_model_len: e.max_model_len,
        block_size: e.block_size,
        num_kv_blocks: e.num_kv_blocks,
        gpu_memory_utilization: e.gpu_memory_utilization,
        enforce_eager: e.enforce_eager,
        async_scheduling: e.sync_steps.then_some(false),
        admission_min_tokens: e.admission_tokens,
        enable_prefix_caching: !e.no_prefix_caching,
        tensor_parallel_size: e.tensor_parallel_size,
        vocab_parallel: e.vocab_parallel,
        batch_invariant: e.batch_invariant,
        ..EngineConfig::default()
    }
}

/// The structured-output constraint of `--json-schema`, `--json-object`, `--regex`, `--choice`
/// or `--grammar` (at most one of them: clap checks).
fn structured_output(s: &SamplingArgs) -> Result<Option<StructuredOutput>> {
    let read = |path: &PathBuf| {
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
    };
    Ok(if let Some(path) = &s.json_schema {
        let schema = serde_json::from_str(&read(path)?)
            .with_context(|| format!("--json-schema {}: not JSON", path.display()))?;
        Some(StructuredOutput::JsonSchema(schema))
    } else if s.json_object {
        Some(StructuredOutput::JsonObject)
    } else if let Some(rx) = &s.regex {
        Some(StructuredOutput::Regex(rx.clone()))
    } else if !s.choice.is_empty() {
        Some(StructuredOutput::Choice(s.choice.clone()))
    } else if let Some(path) = &s.grammar {
        Some(StructuredOutput::Grammar(read(path)?))
    } else {
        None
    })
}

fn sampling_params(defaults: SamplingParams, s: &SamplingArgs) -> Result<SamplingParams> {
    Ok(SamplingParams {
        temperature: s.temperature.unwrap_or(defaults.temperature),
        top_p: s.top_p.unwrap_or(defaults.top_p),
        top_k: s.top_k.unwrap_or(defaults.top_k),
        min_p: s.min_p.unwrap_or(defaults.min_p),
        repetition_penalty: s.repetition_penalty.unwrap_or(defaults.repetition_penalty),
        presence_penalty: s.presence_penalty,
        frequency_penalty: s.frequency_penalty,
        seed: s.seed,
        max_tokens: s.max_tokens,
        min_tokens: s.min_tokens,
        stop: s.stop.clone(),
        ignore_eos: s.ignore_eos,
        logprobs: s.logprobs,
        structured_output: structured_output(s)?,
        ..defaults
    })
}

/// Prompts from `--prompt` and `--prompts-file` (JSON lines: a string or `{"prompt": …}`).
fn read_prompts(args: &GenerateArgs) -> Result<Vec<String>> {
    let mut prompts = args.prompt.clone();
    if let Some(path) = &args.prompts_file {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let value: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("{}:{}: not JSON", path.display(), n + 1))?;
            match value {
                serde_json::Value::String(s) => prompts.push(s),
                serde_json::Value::Object(o) => match o.get("prompt") {
                    Some(serde_json::Value::String(s)) => prompts.push(s.clone()),
                    _ => bail!("{}:{}: no string field \"prompt\"", path.display(), n + 1),
                },
                _ => bail!(
                    "{}:{}: expected a string or an object",
                    path.display(),
                    n + 1
                ),
            }
        }
    }
    if prompts.is_empty() {
        bail!("no prompt: give --prompt or --prompts-file");
    }
    Ok(prompts)
}

fn generate(args: GenerateArgs) -> Result<()> {
    let texts = read_prompts(&args)?;
    let mut llm = load(&args.model, engine_config(&args.model, &args.engine))?;
    llm.set_progress(!args.no_progress);
    let params = sampling_params(llm.engine().default_sampling_params(), &args.sampling)?;
    let prompts: Vec<Prompt> = texts
        .iter()
        .map(|t| {
            if args.chat {
                llm.chat_prompt(t)
            } else {
                Prompt::Text(t.clone())
            }
        })
        .collect();
    let start = Instant::now();
    let outs = llm.generate(&prompts, &params)?;
    let secs = start.elapsed().as_secs_f64();
    let tokenizer = llm.engine().tokenizer().cloned();
    for (i, out) in outs.iter().enumerate() {
        if outs.len() > 1 {
            println!("--- [{i}] {:?}", texts[i]);
        }
        match &out.finish_reason {
            FinishReason::Error(e) => println!("error: {e}"),
            _ => println!("{}", out.text.as_deref().unwrap_or_default()),
        }
        for lp in &out.logprobs {
            let name = |id: u32| {
                tokenizer
                    .as_ref()
                    .and_then(|t| t.decode(&[id], false).ok())
                    .unwrap_or_else(|| id.to_string())
            };
            let top: Vec<String> = lp
                .top
                .iter()
                .map(|&(id, l)| format!("{:?} {l:.3}", name(id)))
                .collect();
            println!(
                "  {:?} {:.3}  [{}]",
                name(lp.token_id),
                lp.logprob,
                top.join(", ")
            );
        }
    }
    let prompt_tokens: usize = outs.iter().map(|o| o.prompt_token_ids.len()).sum();
    let generated: usize = outs.iter().map(|o| o.token_ids.len()).sum();
    let stats = llm.engine().stats();
    eprintln!(
        "{} requests, {prompt_tokens} prompt + {generated} generated tokens in {secs:.2} s \
         ({:.1} generated tokens/s; {} steps, {} preemptions, {} prefix-cache hit tokens)",
        outs.len(),
        generated as f64 / secs,
        stats.steps,
        stats.preemptions,
        stats.prefix_hit_tokens
    );
    Ok(())
}

fn chat(args: ChatArgs) -> Result<()> {
    let mut llm = load(&args.model, engine_config(&args.model, &args.engine))?;
    llm.set_progress(false);
    let params = sampling_params(llm.engine().default_sampling_params(), &args.sampling)?;
    eprintln!("chat: /reset clears the history, /exit or Ctrl-D ends");
    let stdin = std::io::stdin();
    burn_nanovllm::chat_loop(
        &mut llm,
        &params,
        args.system.as_deref(),
        stdin.lock(),
        std::io::stdout(),
    )?;
    Ok(())
}

fn serve(args: ServeArgs) -> Result<()> {
    let dir = args.model.dir()?;
    let engine_config = engine_config(&args.model, &args.engine);
    let config = ServerConfig {
        model_name: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| args.model.served_name()),
        api_key: args
            .api_key
            .clone()
            .or_else(|| std::env::var("BURN_NANOVLLM_API_KEY").ok()),
        max_pending: args.max_pending,
        shutdown_timeout: std::time::Duration::from_secs(args.shutdown_timeout),
        max_body_bytes: args.max_request_bytes,
        grammar_threads: args.grammar_threads,
        grammar_timeout: std::time::Duration::try_from_secs_f64(args.grammar_timeout)
            .map_err(|e| anyhow::anyhow!("--grammar-timeout {}: {e}", args.grammar_timeout))?,
        ..ServerConfig::default()
    };
    let name = config.model_name.clone();
    let load_dir = dir.clone();
    let server = Server::new(
        move || Ok(burn_nanovllm::LLMEngine::new(&load_dir, engine_config)?),
        config,
    )
    .with_context(|| format!("loading {}", dir.display()))?;
    let max_model_len = server.model_info().max_model_len;
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let bound = listener.local_addr()?;
        eprintln!(
            "serving `{name}` (max_model_len {}) on http://{bound} (/v1/completions, \
             /v1/chat/completions)",
            max_model_len
        );
        server.serve(listener, shutdown_signal()).await?;
        eprintln!("server stopped");
        Ok(())
    })
}

fn logits(args: LogitsArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.ids)
        .with_context(|| format!("reading {}", args.ids.display()))?;
    let prompts: Vec<Vec<u32>> =
        serde_json::from_str(&text).context("ids file must be a JSON list of lists of ids")?;
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        bail!("prompt {i} is empty");
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(1);
    let config = EngineConfig {
        device: args.model.device,
        dtype: args.model.dtype,
        max_num_seqs: Some(prompts.len().max(1)),
        max_num_batched_tokens: (longest * prompts.len()).max(prompts.len()).max(256),
        max_model_len: Some(longest + args.greedy + 1),
        ..EngineConfig::default()
    };
    let mut llm = load(&args.model, config)?;
    llm.set_progress(false);
    // Greedy continuations through the engine (prefill, then decode steps: graphs on CUDA).
    let greedy: Vec<Prompt> = prompts.iter().cloned().map(Prompt::Tokens).collect();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(args.greedy.max(1))
    };
    let continuations = llm.generate(&greedy, &params)?;
    // Prompt logits at every position: one scoring forward per prompt.
    let engine = llm.engine();
    let vocab = engine.model_config().vocab_size;
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (i, ids) in prompts.iter().enumerate() {
        let host = engine.prompt_logits(ids)?;
        tensors.push((
            format!("prompt.{i}.logits"),
            safetensors::Dtype::F32,
            vec![ids.len(), vocab],
            host.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
        let out = &continuations[i];
        if let FinishReason::Error(e) = &out.finish_reason {
            bail!("prompt {i}: {e}");
        }
        let greedy: Vec<i64> = out
            .token_ids
            .iter()
            .take(args.greedy)
            .map(|&t| t as i64)
            .collect();
        tensors.push((
            format!("prompt.{i}.greedy_ids"),
            safetensors::Dtype::I64,
            vec![greedy.len()],
            greedy.iter().flat_map(|v| v.to_le_bytes()).collect(),
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
