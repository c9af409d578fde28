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
