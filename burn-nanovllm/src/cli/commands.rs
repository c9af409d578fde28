//! The commands: `generate`, `chat`, `serve` and `logits`, each with its own options.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn_nanovllm::server::{Server, ServerConfig, shutdown_signal};
use burn_nanovllm::{EngineConfig, FinishReason, LLM, Prompt, Quantization, SamplingParams};
use clap::Args;

use super::options::{EngineArgs, ModelArgs, SamplingArgs, engine_config, sampling_params};

#[derive(Args)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
    #[command(flatten)]
    pub(crate) sampling: SamplingArgs,
    /// A prompt (repeatable).
    #[arg(long)]
    pub(crate) prompt: Vec<String>,
    /// A file of prompts, one per line: a JSON string, or an object with a "prompt" field.
    #[arg(long)]
    pub(crate) prompts_file: Option<PathBuf>,
    /// Wrap each prompt in the chat template as a user message.
    #[arg(long)]
    pub(crate) chat: bool,
    /// Hide the progress bar.
    #[arg(long)]
    pub(crate) no_progress: bool,
}

#[derive(Args)]
pub(crate) struct ChatArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
    #[command(flatten)]
    pub(crate) sampling: SamplingArgs,
    /// A system message at the head of the conversation.
    #[arg(long)]
    pub(crate) system: Option<String>,
}

#[derive(Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
    /// Address to bind (loopback by default; 0.0.0.0 exposes the server).
    #[arg(long, default_value = "127.0.0.1")]
    pub(crate) host: String,
    #[arg(long, default_value_t = 8000)]
    pub(crate) port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* (default: $BURN_NANOVLLM_API_KEY).
    #[arg(long)]
    pub(crate) api_key: Option<String>,
    /// The model name clients send (default: the --model argument).
    #[arg(long)]
    pub(crate) served_model_name: Option<String>,
    /// Most requests queued and running at once; past it, 503 with Retry-After.
    #[arg(long, default_value_t = 1024)]
    pub(crate) max_pending: usize,
    /// Seconds in-flight requests may run after SIGINT/SIGTERM before they are aborted.
    #[arg(long, default_value_t = 30)]
    pub(crate) shutdown_timeout: u64,
    /// Largest request body, bytes; larger ones are refused (413).
    #[arg(long, default_value_t = ServerConfig::default().max_body_bytes)]
    pub(crate) max_request_bytes: usize,
    /// Constraints (JSON schemas, regexes, grammars, tools) compiled at once.
    #[arg(long, default_value_t = ServerConfig::default().grammar_threads)]
    pub(crate) grammar_threads: usize,
    /// Seconds a constraint may take to compile before its request is refused (400).
    #[arg(long, default_value_t = ServerConfig::default().grammar_timeout.as_secs_f64())]
    pub(crate) grammar_timeout: f64,
}

#[derive(Args)]
pub(crate) struct LogitsArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// JSON file holding a list of prompts, each a list of token ids.
    #[arg(long)]
    pub(crate) ids: PathBuf,
    /// Output safetensors file: `prompt.{i}.logits [L, V]` (f32) and `prompt.{i}.greedy_ids [N]`.
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// Greedy tokens to generate after each prompt (with the KV cache).
    #[arg(long, default_value_t = 64)]
    pub(crate) greedy: usize,
}

/// The LLM over `model`'s checkpoint under `config`; what was loaded goes to stderr.
fn load(model: &ModelArgs, config: EngineConfig) -> Result<LLM> {
    let start = Instant::now();
    let dir = model.dir()?;
    let llm = LLM::new(&dir, config).with_context(|| format!("loading {}", dir.display()))?;
    let limits = llm.engine().limits();
    eprintln!(
        "loaded {} in {:.2?} on {:?} ({:?}{}): {} KV blocks of {} tokens ({}), max_model_len {}, {}",
        dir.display(),
        start.elapsed(),
        model.device,
        limits.dtype,
        match limits.quantization {
            Quantization::None => "",
            Quantization::Fp8 => ", fp8 weights",
        },
        limits.num_kv_blocks,
        limits.block_size,
        limits.kv_cache_dtype.name(),
        limits.max_model_len,
        if limits.graph_sizes.is_empty() {
            "eager".to_string()
        } else {
            format!("{} decode graphs", limits.graph_sizes.len())
        }
    );
    Ok(llm)
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

/// `generate`: every prompt through the engine at once, each completion printed.
pub(crate) fn generate(args: GenerateArgs) -> Result<()> {
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

/// `chat`: a conversation in the terminal.
pub(crate) fn chat(args: ChatArgs) -> Result<()> {
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

/// `serve`: the OpenAI-compatible server until SIGINT or SIGTERM.
pub(crate) fn serve(args: ServeArgs) -> Result<()> {
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

/// `logits`: prompt logits and greedy continuations written to safetensors.
pub(crate) fn logits(args: LogitsArgs) -> Result<()> {
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
