//! The Qwen2 tokenizer (`tokenizer.json`, byte-level BPE) and the chat template from
//! `tokenizer_config.json`, rendered with minijinja the way transformers renders it with Jinja2.

use std::path::Path;

use minijinja::{Environment, Error as JinjaError, ErrorKind, context};
use serde::Serialize;
use serde_json::Value;

use crate::error::{ModelError, Result};

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The text of the turn.
    pub content: String,
    /// An assistant turn's tool calls, as chat templates read them: `{"type": "function",
    /// "function": {"name", "arguments"}}` with `arguments` a JSON object.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<Value>,
    /// A tool turn's answer to this call id, when the client gave one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// Text ↔ token ids, plus the checkpoint's chat template.
pub struct Qwen2Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    max_token_bytes: usize,
    splits_at_spaces: bool,
}

/// The split pattern of Qwen's pre-tokenizer (GPT-4's, as in Qwen2/2.5/3 `tokenizer.json`).
const QWEN_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// True when `inner` splits text with Qwen's pattern and normalizes at most by NFC, so that a
/// cut before a space that follows a non-space is a split point (see
/// [`Qwen2Tokenizer::prefix_split`]).
fn splits_at_spaces(inner: &tokenizers::Tokenizer) -> bool {
    let pre = inner
        .get_pre_tokenizer()
        .and_then(|p| serde_json::to_string(p).ok())
        .unwrap_or_default();
    let normalizer = inner
        .get_normalizer()
        .and_then(|n| serde_json::to_value(n).ok());
    let nfc = normalizer
        .as_ref()
        .is_none_or(|n| n.get("type").and_then(Value::as_str) == Some("NFC"));
    let pattern = serde_json::to_string(QWEN_SPLIT).unwrap_or_default();
    nfc && pre.contains(&pattern) && pre.contains("Isolated")
}

impl Qwen2Tokenizer {
    /// Reads `tokenizer.json` and, when present, `tokenizer_config.json` (chat template,
    /// special tokens) and `chat_template.jinja` from a checkpoint folder.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let json = dir.join("tokenizer.json");
        if !json.exists() {
            return Err(ModelError::MissingFile(json));
        }
        let inner = tokenizers::Tokenizer::from_file(&json)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", json.display())))?;
        // A vocabulary entry's UTF-8 length is at least the bytes of text it stands for
        // (byte-level BPE writes one byte as a 1–2 byte character, `▁` stands for a space,
        // `<0x41>` for one byte, added tokens for themselves).
        let max_token_bytes = inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1);
        let mut tok = Self {
            splits_at_spaces: splits_at_spaces(&inner),
            inner,
            chat_template: None,
            bos_token: None,
            eos_token: None,
            max_token_bytes,
        };
        let config_path = dir.join("tokenizer_config.json");
        if config_path.exists() {
            let text = std::fs::read_to_string(&config_path).map_err(|source| ModelError::Io {
                path: config_path.clone(),
                source,
            })?;
            let config: Value = serde_json::from_str(&text).map_err(|e| ModelError::Parse {
                path: config_path.clone(),
                message: e.to_string(),
            })?;
            add_config_tokens(&mut tok.inner, &config).map_err(|message| ModelError::Parse {
                path: config_path.clone(),
                message,
            })?;
            tok.chat_template = template_from_config(&config);
            tok.bos_token = token_string(config.get("bos_token"));
            tok.eos_token = token_string(config.get("eos_token"));
        }
        let jinja = dir.join("chat_template.jinja");
        if tok.chat_template.is_none() && jinja.exists() {
            tok.chat_template =
                Some(
                    std::fs::read_to_string(&jinja).map_err(|source| ModelError::Io {
                        path: jinja,
                        source,
                    })?,
                );
        }
        Ok(tok)
    }

    /// Token ids of `text`, with nothing added (Qwen has no BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; `skip_special_tokens` drops special tokens such as `<|im_end|>`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// The most text bytes one token can stand for (its longest vocabulary entry): a text of
    /// `n` bytes has at least `n / max_token_bytes` tokens before normalization.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// The last byte index `i ≤ limit` at which `text[..i]` tokenizes to the first tokens of
    /// `text`, whatever follows: before an ASCII space that follows an ASCII character other
    /// than whitespace. (No piece of Qwen's split pattern holds a non-space followed by a
    /// space, NFC never composes across a space, and no added token holds one.) `None` when
    /// the window has no such point or the tokenizer does not split as Qwen's does.
    pub fn prefix_split(&self, text: &str, limit: usize) -> Option<usize> {
        if !self.splits_at_spaces {
            return None;
        }
        let bytes = text.as_bytes();
        let end = limit.min(bytes.len().saturating_sub(1));
        (1..=end).rev().find(|&i| {
            bytes[i] == b' ' && bytes[i - 1].is_ascii() && !bytes[i - 1].is_ascii_whitespace()
        })
    }

    /// The tokenizer as `tokenizer.json` text, with the added tokens of
    /// `tokenizer_config.json` (the structured-output compiler builds its token trie from it).
    pub fn to_json(&self) -> Result<String> {
        self.inner
            .to_string(false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// Id of a token string such as `<|im_end|>`.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The `eos_token` named by `tokenizer_config.json`, if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// True if the checkpoint ships a chat template.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders the chat template over `messages`; with `add_generation_prompt` the text ends
    /// with the opening of an assistant turn.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Qwen2Tokenizer::apply_chat_template`] with the tools the model may call (OpenAI's
    /// `tools`: `[{"type": "function", "function": {"name", "description", "parameters"}}]`),
    /// passed to the template as `tools` (Qwen's templates list them in the system turn).
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_chat_template(messages, tools, None, add_generation_prompt)
    }

    /// [`Qwen2Tokenizer::apply_chat_template_with_tools`] with extra template variables
    /// (`kwargs`, a JSON object: transformers' and vLLM's `chat_template_kwargs`, such as
    /// Qwen3's `enable_thinking`); `messages`, `tools`, `add_generation_prompt` and the
    /// special-token names take precedence over keys of the same name.
    pub fn render_chat_template(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Value>,
        kwargs: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            ModelError::Tokenizer("tokenizer_config.json has no chat_template".into())
        })?;
        let mut env = Environment::new();
        // transformers renders with Jinja2(trim_blocks=True, lstrip_blocks=True).
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", python_tojson);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, JinjaError> {
                Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
            },
        );
        let render_err = |e: JinjaError| ModelError::Tokenizer(format!("chat template: {e:#}"));
        env.add_template("chat", template).map_err(render_err)?;
        env.get_template("chat")
            .and_then(|t| {
                t.render(context! {
                    messages => messages,
                    tools => tools,
                    add_generation_prompt => add_generation_prompt,
                    bos_token => self.bos_token.clone().unwrap_or_default(),
                    eos_token => self.eos_token.clone().unwrap_or_default(),
                    ..minijinja::Value::from_serialize(kwargs)
                })
            })
            .map_err(render_err)
    }
}

/// Adds the tokens of `tokenizer_config.json`'s `added_tokens_decoder` that `tokenizer.json`
/// lacks, as transformers does (the config is its source of truth for added tokens: a
/// checkpoint may list there tokens its `tokenizer.json` predates). Each must land on its
/// listed id, which holds when they follow the vocabulary in order.
fn add_config_tokens(
    inner: &mut tokenizers::Tokenizer,
    config: &Value,
) -> std::result::Result<(), String> {
    let Some(decoder) = config
        .get("added_tokens_decoder")
        .and_then(Value::as_object)
    else {
        return Ok(());
    };
    let mut missing: Vec<(u32, tokenizers::AddedToken)> = Vec::new();
    for (id, entry) in decoder {
        let id: u32 = id
            .parse()
            .map_err(|_| format!("added_tokens_decoder: {id:?} is not a token id"))?;
        let content = entry
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("added_tokens_decoder[{id}] has no content"))?;
        match inner.token_to_id(content) {
            Some(have) if have == id => continue,
            Some(have) => {
                return Err(format!(
                    "added_tokens_decoder gives {content:?} id {id}; tokenizer.json gives {have}"
                ));
            }
            None => {}
        }
        let flag = |name: &str| entry.get(name).and_then(Value::as_bool).unwrap_or(false);
        let token = tokenizers::AddedToken::from(content, flag("special"))
            .single_word(flag("single_word"))
            .lstrip(flag("lstrip"))
            .rstrip(flag("rstrip"))
            .normalized(flag("normalized"));
        missing.push((id, token));
    }
    missing.sort_by_key(|(id, _)| *id);
    for (id, token) in missing {
        let content = token.content.clone();
        match token.special {
            true => inner.add_special_tokens(&[token]),
            false => inner.add_tokens(&[token]),
        };
        let got = inner.token_to_id(&content);
        if got != Some(id) {
            return Err(format!(
                "added_tokens_decoder gives {content:?} id {id}, but it follows the vocabulary \
                 at {got:?}"
            ));
        }
    }
    Ok(())
}

/// transformers' `tojson` filter: `json.dumps(value, ensure_ascii=False, indent=indent)`, so
/// Python's separators (`", "`, `": "`) and no escaping of `<`, `>`, `&`, `'` (minijinja's own
/// filter writes compact, HTML-safe JSON: a tool list the model never saw in training).
fn python_tojson(
    value: minijinja::Value,
    indent: Option<usize>,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<String, JinjaError> {
    let indent = match indent {
        Some(n) => Some(n),
        None => kwargs.get::<Option<usize>>("indent")?,
    };
    let json = serde_json::to_value(&value)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = " ".repeat(n);
            let formatter = serde_json::ser::PrettyFormatter::with_indent(pad.as_bytes());
            json.serialize(&mut serde_json::Serializer::with_formatter(
                &mut out, formatter,
            ))
        }
        None => json.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PythonSeparators,
        )),
    };
    written.map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))?;
    String::from_utf8(out).map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// `json.dumps`' default separators: `", "` between items, `": "` after keys.
struct PythonSeparators;

impl serde_json::ser::Formatter for PythonSeparators {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.begin_array_value(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

fn template_from_config(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        // A list of named templates: take "default".
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_string)),
        _ => None,
    }
}

fn token_string(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}
