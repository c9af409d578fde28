//! Structured outputs (vLLM's `structured_output`): a request's output constrained to a JSON
//! schema, any JSON object, a regular expression, a choice of strings or a Lark grammar,
//! through `llguidance` over the model's vocabulary.
//!
//! Each constrained request holds a [`GrammarMatcher`]. Before a step samples, the engine asks
//! every constrained row's matcher for its allowed tokens (`fill_masks`: in parallel, into
//! one `[rows, ⌈V/32⌉]` u32 bitmask), uploads it, and the device sampler sets every other logit
//! to −∞ before temperature and the filters (`cubecl_kernels::mask_logits`); each drawn token
//! then advances its matcher. With overlapped scheduling the masks are computed while the
//! device runs the step's forward pass. Unconstrained rows take no part in any of it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use model_qwen2::Qwen2Tokenizer;
use rayon::prelude::*;
use toktrie_hf_tokenizers::ByteTokenizer;

use crate::error::{EngineError, Result};

/// Most compiled grammars kept for reuse; past it the least recently used goes.
const MAX_CACHED_GRAMMARS: usize = 256;

/// llguidance's bounds on one grammar, set explicitly (its defaults but for the grammar size,
/// a fifth of it): the work a hostile grammar can make a compile or a mask step do is bounded
/// by these, whatever the wall clock says. Speeds are llguidance's figures.
fn parser_limits() -> llguidance::api::ParserLimits {
    llguidance::api::ParserLimits {
        // Earley items in one row (the grammar's branching).
        max_items_in_row: 2_000,
        // Lexer regex construction at compile time: ~20 ms at 50k/ms.
        initial_lexer_fuel: 1_000_000,
        // Lexer work of one token mask: ~15 ms at 14k/ms.
        step_lexer_fuel: 200_000,
        // Earley items of one token mask: ~2.5 ms at 20k/ms.
        step_max_items: 50_000,
        // Lexer states (1–2 kB each): at most a few hundred MB.
        max_lexer_states: 250_000,
        // Symbols in productions: about a megabyte of JSON schema.
        max_grammar_size: 100_000,
        ..Default::default()
    }
}

/// llguidance's JSON options for schemas that set none (`"x-guidance"`): JSON written as
/// Python's `json.dumps` writes it (`{"a": 1, "b": [2, 3]}`), no free whitespace. Free
/// whitespace lets small models fall into endless runs of blank lines and spaces inside a
/// JSON value (vLLM's `disable_any_whitespace` for the same reason).
pub fn json_defaults() -> serde_json::Value {
    serde_json::json!({
        "whitespace_flexible": false,
        "item_separator": ", ",
        "key_separator": ": ",
    })
}

/// `schema` with [`json_defaults`], unless it sets llguidance's options itself.
pub fn with_json_defaults(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut()
        && !o.contains_key("x-guidance")
    {
        o.insert("x-guidance".into(), json_defaults());
    }
    schema
}

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum StructuredOutput {
    /// JSON valid under this JSON schema, written as [`json_defaults`] says unless the schema
    /// sets llguidance's `x-guidance` options.
    JsonSchema(serde_json::Value),
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// Text matching this regular expression as a whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text of this grammar, in llguidance's Lark dialect (`%json {…}` embeds a JSON schema).
    Grammar(String),
}

impl StructuredOutput {
    /// The constraint's kind, as vLLM names it (`json`, `json_object`, `regex`, `choice`,
    /// `grammar`).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::JsonSchema(_) => "json",
            Self::JsonObject => "json_object",
            Self::Regex(_) => "regex",
            Self::Choice(_) => "choice",
            Self::Grammar(_) => "grammar",
        }
    }

    /// The llguidance grammar, and the text that identifies it in the cache.
    fn grammar(&self) -> Result<(TopLevelGrammar, String)> {
        let key = |text: &str| format!("{}:{text}", self.kind());
        Ok(match self {
            Self::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(self.invalid("a JSON schema must be an object".into()));
                }
                let text = schema.to_string();
                (
                    TopLevelGrammar::from_json_schema(with_json_defaults(schema.clone())),
                    key(&text),
                )
            }
            Self::JsonObject => (
                TopLevelGrammar::from_json_schema(with_json_defaults(
                    serde_json::json!({"type": "object"}),
                )),
                key(""),
            ),
            Self::Regex(rx) => (TopLevelGrammar::from_regex(rx), key(rx)),
            Self::Choice(choices) => {
                if choices.is_empty() {
                    return Err(self.invalid("the choice list is empty".into()));
                }
                let rx = choices
                    .iter()
                    .map(|c| regex_syntax::escape(c))
                    .collect::<Vec<_>>()
                    .join("|");
                (TopLevelGrammar::from_regex(&rx), key(&rx))
            }
            Self::Grammar(lark) => (TopLevelGrammar::from_lark(lark.clone()), key(lark)),
        })
    }

    /// An [`EngineError::InvalidParam`] of field `structured_output` naming the kind.
    fn invalid(&self, message: String) -> EngineError {
        EngineError::param(
            "structured_output",
            format!("invalid {} constraint: {message}", self.kind()),
        )
    }
}

/// Compiles constraints against one model's vocabulary. Compiled grammars are cached by their
/// text, so requests sharing a schema compile it once (later ones clone the fresh matcher).
/// Shared between threads: a server can compile (and so check) a request's constraint before
/// it reaches the engine.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab_size: usize,
    cache: Mutex<GrammarCache>,
    /// The tokenizer's special tokens (added tokens such as `<tool_call>`), end-of-sequence
    /// tokens excepted.
    specials: Vec<u32>,
}

/// Compiled grammars by their text, least recently used evicted first.
#[derive(Default)]
struct GrammarCache {
    entries: HashMap<String, (Matcher, u64)>,
    clock: u64,
}

impl GrammarCache {
    /// A fresh copy of the matcher of `key`, marked used.
    fn get(&mut self, key: &str) -> Option<Matcher> {
        self.clock += 1;
        let (m, used) = self.entries.get_mut(key)?;
        *used = self.clock;
        Some(m.deep_clone())
    }

    /// Keeps `m` under `key`, evicting the least recently used entry when full.
    fn insert(&mut self, key: String, m: Matcher) {
        self.clock += 1;
        if self.entries.len() >= MAX_CACHED_GRAMMARS
            && !self.entries.contains_key(&key)
            && let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone())
        {
            self.entries.remove(&oldest);
        }
        self.entries.insert(key, (m, self.clock));
    }
}

impl GrammarCompiler {
    /// Over `tokenizer`'s vocabulary (with the added tokens of its `tokenizer_config.json`);
    /// `eos_token_ids` end a constrained output once its grammar is complete; `vocab_size` is
    /// the model's (logits) vocabulary, at least the tokenizer's.
    pub fn new(
        tokenizer: &Qwen2Tokenizer,
        eos_token_ids: &[u32],
        vocab_size: usize,
    ) -> Result<Self> {
        let failed = |e: String| {
            EngineError::param(
                "structured_output",
                format!("structured outputs cannot use this tokenizer: {e}"),
            )
        };
        let json = tokenizer.to_json()?;
        let mut tokenizer =
            ByteTokenizer::from_json_bytes(json.as_bytes()).map_err(|e| failed(e.to_string()))?;
        if !eos_token_ids.is_empty() {
            tokenizer.set_eos_tokens(eos_token_ids);
        }
        let env = tokenizer
            .into_tok_env(Some(vocab_size))
            .map_err(|e| failed(e.to_string()))?;
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| failed(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = parser_limits();
        let trie = factory.tok_env().tok_trie();
        let specials = (0..trie.vocab_size() as u32)
            .filter(|&t| trie.is_special_token(t) && !eos_token_ids.contains(&t))
            .collect();
        Ok(Self {
            factory,
            vocab_size,
            cache: Mutex::new(GrammarCache::default()),
            specials,
        })
    }

    /// The logits' vocabulary the masks cover.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The id of `text` when the tokenizer has it as a special token (an added token such as
    /// Qwen's `<tool_call>`): a grammar must then name it as a token (`<tool_call>` in Lark,
    /// unquoted), since a quoted string matches text bytes, which a special token never
    /// spells.
    pub fn special_token(&self, text: &str) -> Option<u32> {
        self.factory.tok_env().tok_trie().get_special_token(text)
    }

    /// A fresh matcher of `constraint`; an invalid schema, regex or grammar is an
    /// [`EngineError::InvalidParam`] (field `structured_output`) saying what is wrong.
    pub fn compile(&self, constraint: &StructuredOutput) -> Result<GrammarMatcher> {
        let (grammar, key) = constraint.grammar()?;
        let unnamed = Arc::new(self.unnamed_specials(constraint));
        if let Some(m) = self.cache.lock().expect("grammar cache").get(&key) {
            return Ok(GrammarMatcher::new(m, unnamed));
        }
        let matcher = Matcher::new(self.factory.create_parser(grammar));
        if let Some(e) = matcher.get_error() {
            return Err(constraint.invalid(e));
        }
        self.cache
            .lock()
            .expect("grammar cache")
            .insert(key, matcher.deep_clone());
        Ok(GrammarMatcher::new(matcher, unnamed))
    }

    /// The special tokens `constraint` may never admit: every one but those a Lark grammar
    /// names (`<tool_call>`, or any of them through a token range `<[…]>`). llguidance lets a
    /// special token through wherever the text it spells is allowed (a regex asking for the
    /// text `<tool_call>` admitted token 151657 of the Qwen tokenizers, which then broke the
    /// constraint); a model that draws one there could not go on.
    fn unnamed_specials(&self, constraint: &StructuredOutput) -> Vec<u32> {
        let StructuredOutput::Grammar(lark) = constraint else {
            return self.specials.clone();
        };
        if lark.contains("<[") {
            return Vec::new();
        }
        let trie = self.factory.tok_env().tok_trie();
        // `<name>` outside quotes names a token; `"<name>"` is text.
        let named: Vec<u32> = lark
            .match_indices('<')
            .filter(|&(at, _)| !lark[..at].ends_with('"'))
            .filter_map(|(at, _)| {
                let end = lark[at..].find('>')?;
                trie.get_special_token(&lark[at..=at + end])
            })
            .collect();
        self.specials
            .iter()
            .copied()
            .filter(|t| !named.contains(t))
            .collect()
    }
}

/// One request's place in its grammar.
pub struct GrammarMatcher {
    matcher: Matcher,
    /// Special tokens the constraint does not name: never allowed.
    unnamed_specials: Arc<Vec<u32>>,
}

impl GrammarMatcher {
    fn new(matcher: Matcher, unnamed_specials: Arc<Vec<u32>>) -> Self {
        Self {
            matcher,
            unnamed_specials,
        }
    }

    /// Writes the tokens allowed next into `mask` (`⌈V/32⌉` words; bit `t mod 32` of word
    /// `t / 32` set = token `t` allowed); once the grammar is complete, only end-of-sequence.
    pub fn fill_mask(&mut self, mask: &mut [u32]) -> std::result::Result<(), String> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())?;
        let words = allowed.as_slice();
        let n = words.len().min(mask.len());
        mask[..n].copy_from_slice(&words[..n]);
        mask[n..].fill(0);
        for &t in self.unnamed_specials.iter() {
            if let Some(w) = mask.get_mut(t as usize / 32) {
                *w &= !(1u32 << (t % 32));
            }
        }
        if mask.iter().all(|&w| w == 0) {
            return Err("the grammar allows no token here".into());
        }
        Ok(())
    }

    /// Advances past a drawn token; an error if the grammar does not allow it (or it is a
    /// special token the constraint does not name).
    pub fn accept(&mut self, token: u32) -> std::result::Result<(), String> {
        if self.unnamed_specials.contains(&token) {
            return Err(format!(
                "token {token} is a special token the constraint does not name"
            ));
        }
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    /// What the last mask cost llguidance: trie nodes walked and token slices applied
    /// (benchmarks; zeros before the first mask).
    pub fn last_mask_cost(&self) -> (usize, usize) {
        self.matcher
            .last_step_stats()
            .map(|s| (s.trie_nodes_walked, s.slices_applied))
            .unwrap_or_default()
    }

    /// True once the output is complete: the grammar allows nothing more (or an
    /// end-of-sequence token was accepted).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// Fills one mask row per matcher (`masks`: `matchers.len()` rows of `words` u32), the rows in
/// parallel. A row without a matcher (`None`: its request ended) or whose grammar failed allows
/// every token (a failed request ends with the error returned for it; its draw is dropped).
pub fn fill_masks(
    matchers: &mut [Option<&mut GrammarMatcher>],
    masks: &mut [u32],
    words: usize,
) -> Vec<Option<String>> {
    matchers
        .par_iter_mut()
        .zip(masks.par_chunks_mut(words))
        .map(|(m, row)| {
            let error = m.as_mut().and_then(|m| m.fill_mask(row).err());
            if m.is_none() || error.is_some() {
                row.fill(u32::MAX);
            }
            error
        })
        .collect()
}

/// Advances each matcher past its drawn token, the rows in parallel: for each, whether its
/// output is now complete, or why the token breaks its constraint.
pub fn accept_tokens(
    rows: &mut [(&mut GrammarMatcher, u32)],
) -> Vec<std::result::Result<bool, String>> {
    rows.par_iter_mut()
        .map(|(m, t)| m.accept(*t).map(|()| m.is_finished()))
        .collect()
}

/// The engine's constrained requests and their compiler (built on the first constrained
/// request: unconstrained use pays nothing).
pub(crate) struct StructuredOutputs {
    tokenizer: Option<Arc<Qwen2Tokenizer>>,
    eos_token_ids: Vec<u32>,
    vocab_size: usize,
    compiler: Option<Arc<GrammarCompiler>>,
    matchers: HashMap<crate::sequence::RequestId, GrammarMatcher>,
}

impl StructuredOutputs {
    pub(crate) fn new(
        tokenizer: Option<Arc<Qwen2Tokenizer>>,
        eos_token_ids: Vec<u32>,
        vocab_size: usize,
    ) -> Self {
        Self {
            tokenizer,
            eos_token_ids,
            vocab_size,
            compiler: None,
            matchers: HashMap::new(),
        }
    }

    /// The compiler, built on first use.
    pub(crate) fn compiler(&mut self) -> Result<Arc<GrammarCompiler>> {
        if let Some(c) = &self.compiler {
            return Ok(c.clone());
        }
        let tokenizer = self.tokenizer.as_ref().ok_or_else(|| {
            EngineError::param(
                "structured_output",
                "structured outputs need the model's tokenizer.json, which this model folder \
                 lacks"
                    .into(),
            )
        })?;
        let c = Arc::new(GrammarCompiler::new(
            tokenizer,
            &self.eos_token_ids,
            self.vocab_size,
        )?);
        self.compiler = Some(c.clone());
        Ok(c)
    }

    /// Tracks `id` with its compiled constraint.
    pub(crate) fn insert(&mut self, id: crate::sequence::RequestId, matcher: GrammarMatcher) {
        self.matchers.insert(id, matcher);
    }

    /// True if `id` is constrained.
    pub(crate) fn contains(&self, id: crate::sequence::RequestId) -> bool {
        self.matchers.contains_key(&id)
    }

    /// Forgets `id`.
    pub(crate) fn remove(&mut self, id: crate::sequence::RequestId) {
        self.matchers.remove(&id);
    }

    /// Forgets every request (the engine failed).
    pub(crate) fn clear(&mut self) {
        self.matchers.clear();
    }

    /// Advances the matchers of `tokens` (request, drawn token; requests without one are
    /// skipped) past their tokens, in parallel: for each, whether its output is now complete,
    /// or why the token breaks its constraint.
    pub(crate) fn advance(
        &mut self,
        tokens: &[(crate::sequence::RequestId, u32)],
    ) -> HashMap<crate::sequence::RequestId, std::result::Result<bool, String>> {
        let drawn: HashMap<_, u32> = tokens.iter().copied().collect();
        let (ids, mut rows): (Vec<_>, Vec<_>) = self
            .matchers
            .iter_mut()
            .filter_map(|(id, m)| drawn.get(id).map(|&t| (*id, (m, t))))
            .unzip();
        ids.into_iter().zip(accept_tokens(&mut rows)).collect()
    }

    /// Fills `masks` (`rows.len()` rows of `⌈V/32⌉` words) with the masks of `rows`' requests,
    /// in parallel; a `None` row, or one whose request is not tracked, allows every token.
    /// Returns the requests whose grammar failed, with the error.
    pub(crate) fn masks(
        &mut self,
        rows: &[Option<crate::sequence::RequestId>],
        masks: &mut [u32],
    ) -> Vec<(crate::sequence::RequestId, String)> {
        let words = cubecl_kernels::mask_words(self.vocab_size);
        let position: HashMap<_, usize> = rows
            .iter()
            .enumerate()
            .filter_map(|(k, id)| id.map(|id| (id, k)))
            .collect();
        let mut matchers: Vec<Option<&mut GrammarMatcher>> =
            (0..rows.len()).map(|_| None).collect();
        for (id, m) in self.matchers.iter_mut() {
            if let Some(&k) = position.get(id) {
                matchers[k] = Some(m);
            }
        }
        fill_masks(&mut matchers, masks, words)
            .into_iter()
            .zip(rows)
            .filter_map(|(e, id)| Some(((*id)?, e?)))
            .collect()
    }
}
