//! Incremental detokenization and stop strings.
//!
//! Each new token's text is found by decoding a short window of recent tokens twice (with and
//! without the new ones) and taking the difference, so multi-byte characters split across
//! tokens come out whole (a window ending in U+FFFD waits for the next token). Stop strings are
//! searched only where new text can complete one, all of a request's in one pass (an
//! Aho–Corasick automaton built once per request, so a request's cost per token follows its
//! new text, not its number of stop strings); with stop strings, the last
//! `longest stop − 1` characters are held back from streamed deltas until the request ends, so
//! a client never sees the beginning of a stop string that is cut later.

use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use model_qwen2::Qwen2Tokenizer;

use crate::error::Result;
use crate::sampling_params::SamplingParams;

/// The text of one request's output, built token by token.
#[derive(Clone, Debug, Default)]
pub struct Detokenizer {
    prefix_offset: usize,
    read_offset: usize,
    text: String,
    /// Bytes of `text` already handed out as deltas.
    sent: usize,
    /// Bytes of text held back while the request runs (stop strings).
    hold_back: usize,
    /// A stop string cut the text: nothing more is added.
    stopped: bool,
    /// The request's stop strings, shortest first (at one position, the shortest wins), and
    /// the longest one's length.
    stops: Option<(Arc<AhoCorasick>, usize)>,
}

impl Detokenizer {
    /// A detokenizer for a request with `params`.
    pub fn new(params: &SamplingParams) -> Self {
        let longest = params.stop.iter().map(String::len).max().unwrap_or(0);
        let mut stops: Vec<&str> = params.stop.iter().map(String::as_str).collect();
        stops.sort_by_key(|s| s.len());
        let stops = (longest > 0)
            .then(|| {
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostFirst)
                    .build(stops)
                    .ok()
            })
            .flatten()
            .map(|a| (Arc::new(a), longest));
        Self {
            hold_back: longest.max(1) - 1,
            stops,
            ..Self::default()
        }
    }

    /// The text so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Decodes the output tokens added since the last call (`output` is every output token).
    /// Returns true if a stop string now ends the text (it is cut there).
    pub fn update(
        &mut self,
        tokenizer: &Qwen2Tokenizer,
        output: &[u32],
        params: &SamplingParams,
    ) -> Result<bool> {
        if self.stopped {
            return Ok(true);
        }
        let old_len = self.text.len();
        if !self.decode_window(tokenizer, output, params, false)? {
            return Ok(false);
        }
        self.stopped = self.find_stop(old_len, params);
        Ok(self.stopped)
    }

    /// Adds the text of the tokens not yet decoded, incomplete characters included (the
    /// request has ended).
    pub fn flush(
        &mut self,
        tokenizer: &Qwen2Tokenizer,
        output: &[u32],
        params: &SamplingParams,
    ) -> Result<()> {
        if !self.stopped {
            self.decode_window(tokenizer, output, params, true)?;
        }
        Ok(())
    }

    /// Appends the text the tokens after `read_offset` add; unless `force`, waits while it
    /// ends in an incomplete character. Returns true if text was added.
    fn decode_window(
        &mut self,
        tokenizer: &Qwen2Tokenizer,
        output: &[u32],
        params: &SamplingParams,
        force: bool,
    ) -> Result<bool> {
        if output.len() <= self.read_offset {
            return Ok(false);
        }
        let skip = params.skip_special_tokens;
        let prefix = tokenizer.decode(&output[self.prefix_offset..self.read_offset], skip)?;
        let full = tokenizer.decode(&output[self.prefix_offset..], skip)?;
        if full.len() <= prefix.len()
            || !full.is_char_boundary(prefix.len())
            || (!force && full.ends_with('\u{FFFD}'))
        {
            return Ok(false);
        }
        self.text.push_str(&full[prefix.len()..]);
        self.prefix_offset = self.read_offset;
        self.read_offset = output.len();
        Ok(true)
    }

    /// Cuts the text at the earliest stop string that ends in the new text (the shortest of
    /// those starting there).
    fn find_stop(&mut self, old_len: usize, params: &SamplingParams) -> bool {
        let Some((stops, longest)) = &self.stops else {
            return false;
        };
        let mut start = old_len.saturating_sub(longest - 1);
        while !self.text.is_char_boundary(start) {
            start -= 1;
        }
        let Some(found) = stops.find(&self.text[start..]) else {
            return false;
        };
        let end = start
            + if params.include_stop_str_in_output {
                found.end()
            } else {
                found.start()
            };
        self.text.truncate(end);
        self.sent = self.sent.min(end);
        true
    }

    /// The text not yet handed out; while the request runs, the held-back tail stays.
    pub fn take_delta(&mut self, finished: bool) -> String {
        let mut end = if finished {
            self.text.len()
        } else {
            self.text.len().saturating_sub(self.hold_back)
        };
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        if end <= self.sent {
            return String::new();
        }
        let delta = self.text[self.sent..end].to_string();
        self.sent = end;
        delta
    }
}
