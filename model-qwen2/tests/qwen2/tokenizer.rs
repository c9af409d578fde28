use model_qwen2::{ChatMessage, Qwen2Tokenizer};

use super::common::{Golden, fixture};

#[test]
fn ids_match_the_reference_tokenizer_on_every_case() {
    let tok = Qwen2Tokenizer::from_dir(fixture("qwen2-tokenizer")).unwrap();
    let text =
        std::fs::read_to_string(fixture("qwen2-tokenizer").join("tokenizer_tests.json")).unwrap();
    let tests: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = tests["tests"].as_array().unwrap();
    assert!(cases.len() >= 255);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = tok.encode(text).unwrap();
        assert_eq!(got, want, "ids of {text:?} ({})", case["category"]);
        let decoded = tok.decode(&got, false).unwrap();
        assert_eq!(
            decoded,
            case["nfc_text"].as_str().unwrap(),
            "decode of {text:?}"
        );
    }
}

#[test]
fn special_tokens_and_skip_special_decoding() {
    let tok = Qwen2Tokenizer::from_dir(fixture("qwen2-tokenizer")).unwrap();
    assert_eq!(tok.encode("Hello world").unwrap(), vec![9707, 1879]);
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(151645));
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    let ids = tok.encode("<|im_start|>a<tool_call>b<|im_end|>").unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "a<tool_call>b");
}

#[test]
fn chat_template_renders_the_golden_chatml() {
    // The tied checkpoint's folder links the shared tokenizer files.
    let tok = Qwen2Tokenizer::from_dir(fixture("qwen2-tiny-tied")).unwrap();
    let golden = Golden::load("qwen2-tiny-tied");
    let case = golden.json["text_tests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "chatml")
        .unwrap();
    let messages: Vec<ChatMessage> = case["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect();
    let text = tok.apply_chat_template(&messages, true).unwrap();
    assert_eq!(text, case["text"].as_str().unwrap());
    let ids: Vec<u32> = case["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(tok.encode(&text).unwrap(), ids);

    // Without a system turn the template inserts Qwen's default one.
    let text = tok
        .apply_chat_template(&[ChatMessage::new("user", "Hi")], false)
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
}

/// A cut at `prefix_split` never changes the tokens before it: over the reference cases joined
/// into one text (words, code, digits, CJK, emoji, whitespace runs, special tokens), the ids of
/// every probed prefix are the first ids of the whole.
#[test]
fn prefix_split_keeps_the_tokens_before_the_cut() {
    let tok = Qwen2Tokenizer::from_dir(fixture("qwen2-tokenizer")).unwrap();
    let cases: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen2-tokenizer").join("tokenizer_tests.json")).unwrap(),
    )
    .unwrap();
    let text: String = cases["tests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect::<Vec<_>>()
        .join(" <|im_end|>\n");
    let whole = tok.encode(&text).unwrap();
    let mut cuts = 0;
    let mut limit = text.len();
    while let Some(cut) = tok.prefix_split(&text, limit) {
        assert!(cut <= limit && text.as_bytes()[cut] == b' ');
        let prefix = tok.encode(&text[..cut]).unwrap();
        assert_eq!(
            prefix[..],
            whole[..prefix.len()],
            "cut at {cut}: {:?}",
            &text[cut.saturating_sub(20)..cut]
        );
        cuts += 1;
        limit = cut * 7 / 8;
    }
    assert!(cuts > 20, "{cuts} cuts probed");
    // No cut inside a whitespace run or after a non-ASCII character.
    assert_eq!(tok.prefix_split("a\u{3000} b", 5), None);
    assert_eq!(tok.prefix_split("ab  c", 4), Some(2));
}

/// A Qwen3-style tokenizer (`fixtures/qwen3-tokenizer`: Qwen2's `tokenizer.json` and a config
/// whose `added_tokens_decoder` adds `<think>`, `</think>`, `<tool_response>`,
/// `</tool_response>`) renders Qwen3's template as transformers does (Jinja2's output in
/// `chat_tests.json`): thinking blocks kept or dropped by turn, `enable_thinking` through the
/// extra template variables, tools listed with Python's `json.dumps`, tool calls and results.
#[test]
fn qwen3_chat_template_renders_like_transformers() {
    let tok = Qwen2Tokenizer::from_dir(fixture("qwen3-tokenizer")).unwrap();
    assert_eq!(tok.token_to_id("<think>"), Some(151667));
    assert_eq!(tok.token_to_id("</think>"), Some(151668));
    assert_eq!(tok.token_to_id("<tool_response>"), Some(151665));
    assert_eq!(
        tok.encode("<think>\nok\n</think>").unwrap(),
        [151667, 198, 562, 198, 151668]
    );
    let tests: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen3-tokenizer").join("chat_tests.json")).unwrap(),
    )
    .unwrap();
    let cases = tests["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for case in cases {
        let messages: Vec<ChatMessage> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let mut message =
                    ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap());
                if let Some(calls) = m["tool_calls"].as_array() {
                    message.tool_calls = calls.clone();
                }
                message
            })
            .collect();
        let tools = Some(&case["tools"]).filter(|t| !t.is_null());
        let kwargs = Some(&case["kwargs"]).filter(|k| !k.is_null());
        let text = tok
            .render_chat_template(
                &messages,
                tools,
                kwargs,
                case["add_generation_prompt"].as_bool().unwrap(),
            )
            .unwrap();
        assert_eq!(
            text,
            case["text"].as_str().unwrap(),
            "case {}",
            case["name"]
        );
    }
}
