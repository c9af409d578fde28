//! A request's way into the engine: checked, given its places among `max_pending` (one per
//! completion), its constraint compiled on the grammar pool, its prompt tokenized, and handed to
//! the engine. With `n` > 1 (parallel sampling) the first completion goes first and the others
//! follow once its prompt is computed: their prompts then hit the prefix cache, whose blocks
//! they share by reference count, and each computes only its own last, partial block (as vLLM's
//! parallel sampling fans a request out into one per completion). Their seeds are the request's
//! seed plus their index (distinct and reproducible), or the engine's own draws without one.

use axum::http::StatusCode;
use engine::{GrammarMatcher, SamplingParams};
use serde_json::Value;
use tokio::sync::mpsc as tmpsc;

use super::constraints::ToolMarkers;
use super::engine_loop::{Event, Place};
use super::error::ApiError;
use super::protocol::{Endpoint, OpenAiRequest, PromptSpec, ToolMode, log_unknown_fields};
use super::routes::{AppState, Shared};

/// A request the engine took: its completions' events, tagged with their index.
pub struct Admitted {
    /// The first completion's engine id (names the response).
    pub id: engine::RequestId,
    /// `(completion index, event)` of every completion, as they come.
    pub events: tmpsc::UnboundedReceiver<(usize, Event)>,
    /// Completions (`n`).
    pub n: usize,
    pub num_prompt: usize,
    pub tool_mode: ToolMode,
}

/// Checks `req` (a completion or chat request of `endpoint`), takes its places among
/// `max_pending`, compiles its constraint on the grammar pool, tokenizes its prompt and hands
/// it to the engine (module doc).
pub async fn admit(
    s: &Shared,
    endpoint: Endpoint,
    mut req: OpenAiRequest,
) -> Result<Admitted, ApiError> {
    check_model(s, req.model.as_deref())?;
    log_unknown_fields(&req.unknown);
    let info = &s.engine.info;
    let (mut params, max_tokens) = req.sampling_params(endpoint, &info.defaults)?;
    let n = req.n.unwrap_or(1) as usize;
    if let Some(words) = &req.bad_words {
        params.bad_words = bad_word_ids(s, words)?;
    }
    let markers = info.grammars.as_ref().map_or(ToolMarkers::default(), |g| {
        ToolMarkers::of(|text| g.special_token(text).is_some())
    });
    let (constraint, tool_mode) = req.structured_output(endpoint, markers)?;
    // Places among `max_pending` before the costly parts (compile, tokenization).
    let places = (0..n)
        .map(|_| s.engine.reserve())
        .collect::<Result<Vec<Place>, _>>()?;
    let mut matchers: Vec<Option<GrammarMatcher>> = Vec::with_capacity(n);
    match constraint {
        Some((constraint, field)) => {
            // One compile; the others are cache hits (a fresh matcher each).
            for _ in 0..n {
                matchers.push(Some(s.grammars.compile(&constraint, &field).await?));
            }
            params.structured_output = Some(constraint);
        }
        None => matchers.resize_with(n, || None),
    }
    let prompt = req.prompt(endpoint)?;
    let tools = req.template_tools();
    let kwargs = req.chat_template_kwargs.take().map(Value::Object);
    drop(req);
    let prompt = tokenize(prompt, tools, kwargs, s).await?;
    let max_model_len = info.max_model_len;
    match max_tokens {
        None => params.max_tokens = max_model_len.saturating_sub(prompt.len()).max(1),
        // vLLM's answer: the prompt and the completion must fit in the context (a prompt that
        // alone does not is refused by the engine, naming `prompt`).
        Some(m)
            if prompt.len() < max_model_len && prompt.len().saturating_add(m) > max_model_len =>
        {
            return Err(ApiError::bad_request(
                format!(
                    "this model's maximum context length is {max_model_len} tokens, but {} were \
                     requested ({} in the prompt, {m} in the completion): reduce the prompt or \
                     max_tokens",
                    prompt.len().saturating_add(m),
                    prompt.len()
                ),
                Some("max_tokens".into()),
            ));
        }
        Some(_) => {}
    }
    let num_prompt = prompt.len();
    let mut places = places.into_iter();
    let mut matchers = matchers.into_iter();
    let first = (places.next(), matchers.next());
    let (Some(place), Some(matcher)) = first else {
        unreachable!("n ≥ 1")
    };
    let (id, rx) = s
        .engine
        .submit(place, prompt.clone(), params.clone(), matcher)
        .await?;
    let (tx, events) = tmpsc::unbounded_channel();
    let rest: Vec<(Place, Option<GrammarMatcher>)> = places.zip(matchers).collect();
    tokio::spawn(fan_out(s.clone(), rx, tx, rest, prompt, params));
    Ok(Admitted {
        id,
        events,
        n,
        num_prompt,
        tool_mode,
    })
}

/// Forwards the first completion's events as index 0; after its first event (its prompt is
/// computed) submits the other completions and forwards theirs. Stops, dropping every
/// completion's channel (the engine aborts them), once the client's side is gone.
async fn fan_out(
    s: Shared,
    mut first: tmpsc::UnboundedReceiver<Event>,
    tx: tmpsc::UnboundedSender<(usize, Event)>,
    rest: Vec<(Place, Option<GrammarMatcher>)>,
    prompt: Vec<u32>,
    params: SamplingParams,
) {
    // The reader may go away before the first completion's first event: stop then (dropping
    // `first` aborts it), not after its prefill.
    let event = tokio::select! {
        ev = first.recv() => ev,
        _ = tx.closed() => None,
    };
    let Some(event) = event else {
        return;
    };
    if tx.send((0, event)).is_err() {
        return;
    }
    let mut forwarders = vec![tokio::spawn(forward(0, first, tx.clone()))];
    for (k, (place, matcher)) in rest.into_iter().enumerate() {
        let index = k + 1;
        if tx.is_closed() {
            return;
        }
        let params = SamplingParams {
            seed: params.seed.map(|seed| seed.wrapping_add(index as u64)),
            ..params.clone()
        };
        match s
            .engine
            .submit(place, prompt.clone(), params, matcher)
            .await
        {
            Ok((_, rx)) => forwarders.push(tokio::spawn(forward(index, rx, tx.clone()))),
            Err(e) => {
                let _ = tx.send((index, Event::Failed(e.message)));
            }
        }
    }
    drop(tx);
    for f in forwarders {
        let _ = f.await;
    }
}

/// Forwards one completion's events tagged with `index`, until they end or nobody reads.
async fn forward(
    index: usize,
    mut rx: tmpsc::UnboundedReceiver<Event>,
    tx: tmpsc::UnboundedSender<(usize, Event)>,
) {
    loop {
        tokio::select! {
            ev = rx.recv() => match ev {
                Some(ev) => if tx.send((index, ev)).is_err() { return },
                None => return,
            },
            // The reader is gone: dropping `rx` aborts this completion.
            _ = tx.closed() => return,
        }
    }
}

/// `bad_words` as token ids, each word as written and after a space (vLLM's rule: a word
/// inside a text usually starts with one); bounded as the engine bounds them.
fn bad_word_ids(s: &AppState, words: &[String]) -> Result<Vec<Vec<u32>>, ApiError> {
    let bad = |m: String| ApiError::bad_request(m, Some("bad_words".into()));
    let bytes: usize = words.iter().map(String::len).sum();
    if words.len() > engine::sampling_params::MAX_BAD_WORDS || bytes > 64 << 10 {
        return Err(bad(format!(
            "{} words of {bytes} bytes: at most {} words of 64 KiB together",
            words.len(),
            engine::sampling_params::MAX_BAD_WORDS
        )));
    }
    let tokenizer = s.tokenizer.tokenizer("bad_words")?;
    let mut ids = Vec::new();
    for w in words.iter().filter(|w| !w.is_empty()) {
        for text in [w.clone(), format!(" {}", w.trim_start())] {
            let t = tokenizer.encode(&text).map_err(|e| bad(e.to_string()))?;
            if !t.is_empty() && !ids.contains(&t) {
                ids.push(t);
            }
        }
    }
    Ok(ids)
}

/// 404 naming `model` when a request names a model this server does not serve.
pub fn check_model(s: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(model) if model != s.model_name => Err(ApiError {
            param: Some("model".into()),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "the model `{model}` does not exist: this server serves `{}`",
                    s.model_name
                ),
            )
        }),
        _ => Ok(()),
    }
}

/// Token ids of a request's prompt: token ids as given, text tokenized, a conversation
/// through the chat template (with `tools` and the request's extra template variables).
pub async fn tokenize(
    prompt: PromptSpec,
    tools: Option<Value>,
    kwargs: Option<Value>,
    s: &AppState,
) -> Result<Vec<u32>, ApiError> {
    match prompt {
        PromptSpec::Tokens(ids) => Ok(ids),
        PromptSpec::Text(t) => s.tokenizer.encode(t, "prompt").await,
        PromptSpec::Chat(messages) => {
            let text = s
                .tokenizer
                .tokenizer("messages")?
                .render_chat_template(&messages, tools.as_ref(), kwargs.as_ref(), true)
                .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages".into())))?;
            drop(messages);
            s.tokenizer.encode(text, "messages").await
        }
    }
}
