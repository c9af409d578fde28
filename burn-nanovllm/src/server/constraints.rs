//! A request's constraint: structured outputs (`response_format`, vLLM's `structured_outputs`
//! and older `guided_*` fields) and tools (`tools`, `tool_choice`) to one
//! [`StructuredOutput`]; tool calls as a Lark grammar of Qwen's `<tool_call>` blocks.

use engine::StructuredOutput;
use serde_json::{Value, json};

use super::error::ApiError;
use super::protocol::{Endpoint, OpenAiRequest, ResponseFormat, ToolIn, ToolMode};
use super::tool_calls::{CLOSE, OPEN};

/// The functions' JSON schema of a tool call in Qwen's format: `{"name": …, "arguments": …}`.
fn tool_call_schema(tools: &[&ToolIn]) -> Value {
    let calls: Vec<Value> = tools
        .iter()
        .map(|t| {
            json!({
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "arguments": t.function.parameters.clone().unwrap_or(json!({"type": "object"})),
                },
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        })
        .collect();
    engine::structured_output::with_json_defaults(match calls.len() {
        1 => calls.into_iter().next().expect("one call"),
        _ => json!({"anyOf": calls}),
    })
}

/// How a grammar spells the tool-call markers `<tool_call>` and `</tool_call>`: as special
/// tokens where the tokenizer has them so (Qwen2, Qwen2.5 and Qwen3 tokenizers: added tokens
/// 151657 and 151658, which a model emits whole and whose bytes no text matches), else as text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ToolMarkers {
    /// `<tool_call>` is a special token.
    pub open_token: bool,
    /// `</tool_call>` is a special token.
    pub close_token: bool,
}

impl ToolMarkers {
    /// The markers as `has_special` (a special-token lookup of the tokenizer) says.
    pub fn of(has_special: impl Fn(&str) -> bool) -> Self {
        Self {
            open_token: has_special(OPEN),
            close_token: has_special(CLOSE),
        }
    }
}

/// A Lark grammar of `<tool_call>` blocks (Qwen's chat format), each holding one call of
/// `tools`: one block, or with `many` one or more; the markers spelled as `markers` says.
fn tool_call_grammar(tools: &[&ToolIn], many: bool, markers: ToolMarkers) -> String {
    let schema = tool_call_schema(tools);
    let repeat = if many { " (\"\\n\" call)*" } else { "" };
    let spell = |marker: &str, token: bool| match token {
        true => marker.to_string(),
        false => format!("{marker:?}"),
    };
    let (open, close) = (
        spell(OPEN, markers.open_token),
        spell(CLOSE, markers.close_token),
    );
    format!("start: call{repeat}\ncall: {open} \"\\n\" %json {schema} \"\\n\" {close}\n")
}

impl OpenAiRequest {
    /// The request's structured-output constraint and the field it came from, and what to do
    /// with tool calls; at most one source of constraint per request.
    pub fn structured_output(
        &self,
        endpoint: Endpoint,
        markers: ToolMarkers,
    ) -> Result<(Option<(StructuredOutput, String)>, ToolMode), ApiError> {
        let bad = |m: String, p: &str| ApiError::bad_request(m, Some(p.to_string()));
        let mut found: Vec<(StructuredOutput, String)> = Vec::new();
        match &self.response_format {
            None | Some(ResponseFormat::Text) => {}
            Some(ResponseFormat::JsonObject) => {
                found.push((StructuredOutput::JsonObject, "response_format".into()))
            }
            Some(ResponseFormat::JsonSchema { json_schema }) => {
                let schema = json_schema
                    .schema
                    .clone()
                    .unwrap_or(json!({"type": "object"}));
                found.push((
                    StructuredOutput::JsonSchema(schema),
                    "response_format.json_schema.schema".into(),
                ));
            }
        }
        let schema_of = |v: &Value, field: &str| match v {
            Value::String(text) => serde_json::from_str(text)
                .map_err(|e| bad(format!("{field}: the JSON schema is not JSON: {e}"), field)),
            v => Ok(v.clone()),
        };
        if let Some(so) = &self.structured_outputs {
            if let Some(v) = &so.json {
                let field = "structured_outputs.json";
                found.push((
                    StructuredOutput::JsonSchema(schema_of(v, field)?),
                    field.into(),
                ));
            }
            if let Some(rx) = &so.regex {
                found.push((
                    StructuredOutput::Regex(rx.clone()),
                    "structured_outputs.regex".into(),
                ));
            }
            if let Some(c) = &so.choice {
                found.push((
                    StructuredOutput::Choice(c.clone()),
                    "structured_outputs.choice".into(),
                ));
            }
            if let Some(g) = &so.grammar {
                found.push((
                    StructuredOutput::Grammar(g.clone()),
                    "structured_outputs.grammar".into(),
                ));
            }
            if so.json_object == Some(true) {
                found.push((
                    StructuredOutput::JsonObject,
                    "structured_outputs.json_object".into(),
                ));
            }
        }
        if let Some(v) = &self.guided_json {
            found.push((
                StructuredOutput::JsonSchema(schema_of(v, "guided_json")?),
                "guided_json".into(),
            ));
        }
        if let Some(rx) = &self.guided_regex {
            found.push((StructuredOutput::Regex(rx.clone()), "guided_regex".into()));
        }
        if let Some(c) = &self.guided_choice {
            found.push((StructuredOutput::Choice(c.clone()), "guided_choice".into()));
        }
        if let Some(g) = &self.guided_grammar {
            found.push((
                StructuredOutput::Grammar(g.clone()),
                "guided_grammar".into(),
            ));
        }
        let (tool_constraint, mode) = self.tool_constraint(endpoint, markers)?;
        found.extend(tool_constraint);
        if found.len() > 1 {
            let fields: Vec<&str> = found.iter().map(|(_, f)| f.as_str()).collect();
            return Err(bad(
                format!(
                    "at most one structured-output constraint per request, got {}",
                    fields.join(", ")
                ),
                &found[1].1,
            ));
        }
        Ok((found.pop(), mode))
    }

    /// The constraint `tool_choice` implies (`required`, a named function) and the tool mode.
    fn tool_constraint(
        &self,
        endpoint: Endpoint,
        markers: ToolMarkers,
    ) -> Result<(Option<(StructuredOutput, String)>, ToolMode), ApiError> {
        let bad = |m: String, p: &str| ApiError::bad_request(m, Some(p.to_string()));
        let tools = self.tools.as_deref().unwrap_or_default();
        if endpoint == Endpoint::Completions && (!tools.is_empty() || self.tool_choice.is_some()) {
            return Err(bad("tools are for /v1/chat/completions".into(), "tools"));
        }
        for (i, t) in tools.iter().enumerate() {
            if t.kind != "function" {
                return Err(bad(
                    format!("unsupported tool type `{}`: only `function`", t.kind),
                    &format!("tools[{i}].type"),
                ));
            }
            if let Some(p) = &t.function.parameters
                && !p.is_object()
            {
                return Err(bad(
                    "parameters must be a JSON schema object".into(),
                    &format!("tools[{i}].function.parameters"),
                ));
            }
        }
        let choice = self.tool_choice.clone().unwrap_or(match tools.is_empty() {
            true => json!("none"),
            false => json!("auto"),
        });
        let needs_tools = |what: &str| {
            Err(bad(
                format!("tool_choice `{what}` needs a non-empty `tools`"),
                "tool_choice",
            ))
        };
        match &choice {
            Value::String(c) if c == "none" => Ok((None, ToolMode::Off)),
            Value::String(c) if c == "auto" => match tools.is_empty() {
                true => needs_tools("auto"),
                false => Ok((None, ToolMode::Parse)),
            },
            Value::String(c) if c == "required" => match tools.is_empty() {
                true => needs_tools("required"),
                false => {
                    let all: Vec<&ToolIn> = tools.iter().collect();
                    let grammar = StructuredOutput::Grammar(tool_call_grammar(&all, true, markers));
                    Ok((Some((grammar, "tools".into())), ToolMode::Parse))
                }
            },
            Value::Object(o) => {
                let name = o
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        bad(
                            "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": …}}"
                                .into(),
                            "tool_choice",
                        )
                    })?;
                let tool = tools
                    .iter()
                    .find(|t| t.function.name == name)
                    .ok_or_else(|| {
                        bad(
                            format!("tool_choice names `{name}`, which is not in tools"),
                            "tool_choice",
                        )
                    })?;
                let grammar = StructuredOutput::Grammar(tool_call_grammar(&[tool], false, markers));
                Ok((Some((grammar, "tools".into())), ToolMode::Parse))
            }
            other => Err(bad(
                format!(
                    "tool_choice must be none, auto, required or a named function, got {other}"
                ),
                "tool_choice",
            )),
        }
    }

    /// The tools as the chat template takes them (`None` without tools).
    pub fn template_tools(&self) -> Option<Value> {
        self.tools
            .as_ref()
            .filter(|t| !t.is_empty())
            .map(|t| serde_json::to_value(t).expect("tools serialize"))
    }
}
