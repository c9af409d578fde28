//! Interactive chat over the engine: the conversation is kept and rendered through the chat
//! template every turn, the reply streams as it is generated. `/reset` clears the history,
//! `/exit` or end of input (Ctrl-D) ends.

use std::io::{BufRead, Write};

use engine::{FinishReason, SamplingParams};
use model_qwen2::ChatMessage;

use crate::error::{LlmError, Result};
use crate::llm::{LLM, Prompt};

/// Runs the chat: reads user turns from `input`, writes replies (streamed) to `out`.
/// `system`: an optional system message at the head of every conversation.
pub fn chat_loop(
    llm: &mut LLM,
    params: &SamplingParams,
    system: Option<&str>,
    mut input: impl BufRead,
    mut out: impl Write,
) -> Result<()> {
    let has_template = llm
        .engine()
        .tokenizer()
        .is_some_and(|t| t.has_chat_template());
    if !has_template {
        return Err(LlmError::Invalid(
            "the model has no chat template (tokenizer_config.json `chat_template`): use \
             `generate` for plain completions"
                .into(),
        ));
    }
    llm.engine_mut().set_stream_text(true);
    let fresh = || -> Vec<ChatMessage> {
        system
            .map(|s| vec![ChatMessage::new("system", s)])
            .unwrap_or_default()
    };
    let mut history = fresh();
    let io = |e: std::io::Error| LlmError::Invalid(format!("terminal: {e}"));
    loop {
        write!(out, "> ").map_err(io)?;
        out.flush().map_err(io)?;
        let mut line = String::new();
        if input.read_line(&mut line).map_err(io)? == 0 {
            writeln!(out).map_err(io)?;
            return Ok(());
        }
        let line = line.trim();
        match line {
            "" => continue,
            "/exit" | "/quit" => return Ok(()),
            "/reset" => {
                history = fresh();
                writeln!(out, "(history cleared)").map_err(io)?;
                continue;
            }
            _ => {}
        }
        history.push(ChatMessage::new("user", line));
        let prompt = [Prompt::Chat(history.clone())];
        let mut failed = None;
        let done = llm.generate_streaming(&prompt, params, |_, o| {
            if failed.is_none()
                && let Err(e) = write!(out, "{}", o.new_text).and_then(|_| out.flush())
            {
                failed = Some(e);
            }
        })?;
        if let Some(e) = failed {
            return Err(io(e));
        }
        let reply = &done[0];
        match &reply.finish_reason {
            FinishReason::Error(e) => {
                history.pop();
                writeln!(out, "error: {e}").map_err(io)?;
            }
            _ => {
                writeln!(out).map_err(io)?;
                let text = reply.text.clone().unwrap_or_default();
                history.push(ChatMessage::new("assistant", text));
            }
        }
    }
}
