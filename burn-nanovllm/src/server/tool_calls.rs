//! Tool calls in Qwen's chat format: the model writes each call as
//! `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`; the server returns them as
//! OpenAI `tool_calls` (the arguments as JSON text) and the rest of the text as `content`.
//! [`ToolCallStream`] does it on text deltas: text that may open a call is held back until it
//! does or cannot, and a call is emitted once its block closes.

use serde_json::{Value, json};

/// Qwen's tool-call markers.
pub(crate) const OPEN: &str = "<tool_call>";
pub(crate) const CLOSE: &str = "</tool_call>";

/// One parsed call.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// The function's name.
    pub name: String,
    /// Its arguments as JSON text.
    pub arguments: String,
}

impl ToolCall {
    /// The call's OpenAI JSON (`index` for streaming deltas, `id` unique in the response).
    pub fn to_json(&self, id: &str, index: Option<usize>) -> Value {
        let mut v = json!({
            "id": id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        });
        if let Some(i) = index {
            v["index"] = json!(i);
        }
        v
    }
}

/// The call a block's body holds, if it is one: `{"name": string, "arguments": object}` (or
/// `"parameters"`, as some checkpoints write).
fn parse_call(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or(json!({}));
    let arguments = match arguments {
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(ToolCall { name, arguments })
}

/// Splits streamed text into content and tool calls.
#[derive(Debug, Default)]
pub struct ToolCallStream {
    /// Text not yet emitted: a possible opening tag's prefix, or an open call's body.
    held: String,
    /// Inside a `<tool_call>` block.
    in_call: bool,
}

impl ToolCallStream {
    /// Takes a text delta; returns the content to emit now and the calls completed by it.
    pub fn push(&mut self, text: &str) -> (String, Vec<ToolCall>) {
        self.held.push_str(text);
        let (mut content, mut calls) = (String::new(), Vec::new());
        loop {
            if self.in_call {
                let Some(end) = self.held.find(CLOSE) else {
                    break;
                };
                let body = self.held[..end].to_string();
                self.held.drain(..end + CLOSE.len());
                self.in_call = false;
                match parse_call(&body) {
                    Some(call) => calls.push(call),
                    // Not a call after all: the block stays text.
                    None => content.push_str(&format!("{OPEN}{body}{CLOSE}")),
                }
            } else if let Some(start) = self.held.find(OPEN) {
                content.push_str(&self.held[..start]);
                self.held.drain(..start + OPEN.len());
                self.in_call = true;
            } else {
                // Emit all but a tail that could still become the opening tag.
                let keep = (1..OPEN.len())
                    .rev()
                    .find(|&n| self.held.ends_with(&OPEN[..n]))
                    .unwrap_or(0);
                let cut = self.held.len() - keep;
                content.push_str(&self.held[..cut]);
                self.held.drain(..cut);
                break;
            }
        }
        (content, calls)
    }

    /// The end of the output: held text (an unclosed block included) is content.
    pub fn finish(&mut self) -> String {
        let held = std::mem::take(&mut self.held);
        match std::mem::take(&mut self.in_call) {
            true => format!("{OPEN}{held}"),
            false => held,
        }
    }
}

/// A whole output's content (trimmed; `None` when only calls remain) and tool calls.
pub fn parse_tool_calls(text: &str) -> (Option<String>, Vec<ToolCall>) {
    if !text.contains(OPEN) {
        return (Some(text.to_string()), Vec::new());
    }
    let mut stream = ToolCallStream::default();
    let (mut content, calls) = stream.push(text);
    content.push_str(&stream.finish());
    let content = content.trim();
    let content = match (content.is_empty(), calls.is_empty()) {
        (true, false) => None,
        _ => Some(content.to_string()),
    };
    (content, calls)
}
