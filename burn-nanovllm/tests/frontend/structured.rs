//! Structured outputs and tool calls through the OpenAI server on loopback, over the trained
//! default model: `response_format` (JSON schema, JSON object), vLLM's `structured_outputs` and
//! `guided_*` fields, `tools` with `tool_choice` `required` / named / `auto`, in JSON bodies and
//! streamed deltas, read by the `async-openai` client; invalid constraints are 400s naming the
//! field.

use async_openai::types::chat::{
    ChatCompletionMessageToolCalls, ChatCompletionNamedToolChoice, ChatCompletionRequestMessage,
    ChatCompletionRequestUserMessageArgs, ChatCompletionTool, ChatCompletionToolChoiceOption,
    ChatCompletionTools, CreateChatCompletionRequest, CreateChatCompletionRequestArgs,
    FunctionName, FunctionObject, ResponseFormat, ResponseFormatJsonSchema, ToolChoiceOptions,
};
use burn_nanovllm::LLMEngine;
use serde_json::{Value, json};
use tokio_stream::StreamExt;

use super::server::{
    KEY, MODEL, TestServer, client, config, engine_config, post, qwen_vocabulary_server,
    qwen3_chat_server, spawn_server,
};

async fn default_model_server() -> TestServer {
    let make = || {
        Ok(LLMEngine::new(
            burn_nanovllm::default_model_dir(),
            engine_config(),
        )?)
    };
    spawn_server(make, config()).await.0
}

fn user(text: &str) -> ChatCompletionRequestMessage {
    ChatCompletionRequestUserMessageArgs::default()
        .content(text)
        .build()
        .unwrap()
        .into()
}

fn weather_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": false,
    })
}

fn add_schema() -> Value {
    let int = json!({"type": "integer", "minimum": -999, "maximum": 999});
    json!({
        "type": "object",
        "properties": {"a": int, "b": int},
        "required": ["a", "b"],
        "additionalProperties": false,
    })
}

fn tools() -> Vec<ChatCompletionTools> {
    let function = |name: &str, parameters: Value| {
        ChatCompletionTools::Function(ChatCompletionTool {
            function: FunctionObject {
                name: name.into(),
                description: Some(format!("the {name} tool")),
                parameters: Some(parameters),
                strict: None,
            },
        })
    };
    vec![
        function("get_weather", weather_schema()),
        function("add", add_schema()),
    ]
}

fn validate(schema: &Value, value: &Value) {
    let validator = jsonschema::validator_for(schema).unwrap();
    if let Err(e) = validator.validate(value) {
        panic!("{value} under {schema}: {e}");
    }
}

fn request(
    seed: i64,
    build: impl FnOnce(&mut CreateChatCompletionRequestArgs),
) -> CreateChatCompletionRequest {
    let mut args = CreateChatCompletionRequestArgs::default();
    args.model(MODEL)
        .messages([user("Tell me about the weather in a city.")])
        .max_completion_tokens(96u32)
        .temperature(1.0)
        .seed(seed);
    build(&mut args);
    args.build().unwrap()
}

/// `response_format` with a JSON schema (and `json_object`), in whole bodies and streamed:
/// the content parses and validates, across seeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_format_outputs_validate_whole_and_streamed() {
    for s in [default_model_server().await, qwen_vocabulary_server().await] {
        check_response_format(&s).await;
    }
}

async fn check_response_format(s: &TestServer) {
    let c = client(s);
    let schema = weather_schema();
    for seed in 0..3 {
        let req = request(seed, |a| {
            a.response_format(ResponseFormat::JsonSchema {
                json_schema: ResponseFormatJsonSchema {
                    name: "weather".into(),
                    description: None,
                    schema: schema.clone(),
                    strict: Some(true),
                },
            });
        });
        let whole = c.chat().create(req.clone()).await.unwrap();
        let content = whole.choices[0].message.content.clone().unwrap();
        validate(&schema, &serde_json::from_str(&content).unwrap());
        let mut stream = c.chat().create_stream(req).await.unwrap();
        let mut streamed = String::new();
        while let Some(chunk) = stream.next().await {
            for choice in chunk.unwrap().choices {
                streamed.push_str(choice.delta.content.as_deref().unwrap_or_default());
            }
        }
        assert_eq!(streamed, content, "seed {seed}: the stream is the body");
        let req = request(seed, |a| {
            a.response_format(ResponseFormat::JsonObject);
        });
        let whole = c.chat().create(req).await.unwrap();
        let content = whole.choices[0].message.content.clone().unwrap();
        // Any object: this prose model may write a string it never closes before the limit.
        match serde_json::to_value(whole.choices[0].finish_reason).unwrap() {
            v if v == json!("stop") => {
                let value: Value = serde_json::from_str(&content).unwrap();
                assert!(value.is_object(), "{content}");
            }
            _ => assert!(content.starts_with('{'), "{content}"),
        }
    }
}

/// vLLM's fields (`structured_outputs`, and the older `guided_*`) on both endpoints, beside an
/// unconstrained request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_structured_output_fields_constrain_completions_and_chats() {
    for s in [default_model_server().await, qwen_vocabulary_server().await] {
        check_vllm_fields(&s).await;
    }
}

async fn check_vllm_fields(s: &TestServer) {
    let cases = [
        (
            json!({"structured_outputs": {"choice": ["sunny", "rainy", "cold"]}}),
            "choice",
        ),
        (
            json!({"guided_choice": ["sunny", "rainy", "cold"]}),
            "choice",
        ),
        (
            json!({"structured_outputs": {"regex": "[0-9]{2}-[0-9]{2}"}}),
            "regex",
        ),
        (json!({"guided_regex": "[0-9]{2}-[0-9]{2}"}), "regex"),
        (
            json!({"structured_outputs": {"json": weather_schema()}}),
            "json",
        ),
        (json!({"guided_json": weather_schema().to_string()}), "json"),
        (
            json!({"structured_outputs": {"grammar": "start: \"yes\" | \"no\""}}),
            "grammar",
        ),
        (
            json!({"guided_grammar": "start: \"yes\" | \"no\""}),
            "grammar",
        ),
    ];
    for (i, (extra, kind)) in cases.iter().enumerate() {
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let mut body = json!({
                "model": MODEL, "max_tokens": 64, "temperature": 0.8, "seed": i,
            });
            match path {
                "/v1/completions" => body["prompt"] = json!("The weather today is"),
                _ => body["messages"] = json!([{"role": "user", "content": "How is the weather?"}]),
            }
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            let r = post(s, path, &body.to_string(), Some(KEY)).await;
            assert_eq!(r.status(), 200, "{path} {extra}");
            let v: Value = r.json().await.unwrap();
            let text = match path {
                "/v1/completions" => v["choices"][0]["text"].as_str().unwrap().to_string(),
                _ => v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            };
            assert_eq!(
                v["choices"][0]["finish_reason"], "stop",
                "{path} {extra}: {text:?}"
            );
            match *kind {
                "choice" => assert!(
                    ["sunny", "rainy", "cold"].contains(&text.as_str()),
                    "{text:?}"
                ),
                "regex" => {
                    let b = text.as_bytes();
                    assert!(
                        b.len() == 5
                            && b[2] == b'-'
                            && b.iter().filter(|c| c.is_ascii_digit()).count() == 4,
                        "{text:?}"
                    );
                }
                "json" => validate(&weather_schema(), &serde_json::from_str(&text).unwrap()),
                _ => assert!(text == "yes" || text == "no", "{text:?}"),
            }
        }
    }
}

/// Tools: `required` and a named function force a `<tool_call>` block whose call validates
/// against its function's parameters, returned as `tool_calls` (finish reason `tool_calls`)
/// whole and streamed; `auto` leaves the model free (this small model writes text) and
/// returns content; a tool result in the history renders through the template.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_come_back_as_openai_tool_calls_whole_and_streamed() {
    check_tool_calls(&default_model_server().await, 128).await;
}

/// The same through the real Qwen2 vocabulary (`fixtures/qwen2-tiny-tied`, random weights),
/// whose `<tool_call>` and `</tool_call>` are added tokens: the grammar names them as tokens,
/// so the model emits them whole (the text `<tool_call>` spelled in bytes was a 400 on every
/// request), and the parser finds them in the text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_work_with_the_real_qwen_vocabulary() {
    check_tool_calls(&qwen_vocabulary_server().await, 600).await;
}

/// The same with a Qwen3-style tokenizer and template (`<think>` and `</think>` added tokens,
/// tool results as `<tool_response>` blocks in a user turn): a forced call never draws a
/// thinking token it does not name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_work_with_a_qwen3_style_tokenizer() {
    check_tool_calls(&qwen3_chat_server().await, 600).await;
}

/// Tool calls forced (`required`, named) come back as `tool_calls` whole and streamed, `auto`
/// as content, a history with calls and results renders; outputs of up to `max_tokens`.
async fn check_tool_calls(s: &TestServer, max_tokens: u32) {
    let c = client(s);
    let params = |name: &str| match name {
        "get_weather" => weather_schema(),
        _ => add_schema(),
    };
    let named = ChatCompletionToolChoiceOption::Function(ChatCompletionNamedToolChoice {
        function: FunctionName { name: "add".into() },
    });
    let required = ChatCompletionToolChoiceOption::Mode(ToolChoiceOptions::Required);
    for (seed, choice) in [(1, required.clone()), (2, named.clone()), (3, required)] {
        let is_named = choice == named;
        let req = request(seed, |a| {
            a.tools(tools())
                .tool_choice(choice)
                .max_completion_tokens(max_tokens);
        });
        let whole = c.chat().create(req.clone()).await.unwrap();
        let choice0 = &whole.choices[0];
        let calls = choice0.message.tool_calls.clone().unwrap_or_default();
        assert!(!calls.is_empty(), "seed {seed}: {:?}", choice0.message);
        assert_eq!(
            serde_json::to_value(choice0.finish_reason).unwrap(),
            json!("tool_calls")
        );
        let mut whole_calls = Vec::new();
        for call in &calls {
            let ChatCompletionMessageToolCalls::Function(call) = call else {
                panic!("{call:?}");
            };
            if is_named {
                assert_eq!(call.function.name, "add");
            }
            let args: Value = serde_json::from_str(&call.function.arguments).unwrap();
            validate(&params(&call.function.name), &args);
            whole_calls.push((call.function.name.clone(), args));
        }
        // Streamed: the same calls in `tool_calls` deltas, indexed from 0.
        let mut stream = c.chat().create_stream(req).await.unwrap();
        let (mut streamed, mut finish) = (Vec::new(), None);
        while let Some(chunk) = stream.next().await {
            for ch in chunk.unwrap().choices {
                for call in ch.delta.tool_calls.unwrap_or_default() {
                    assert_eq!(call.index as usize, streamed.len());
                    let f = call.function.unwrap();
                    let args: Value = serde_json::from_str(&f.arguments.unwrap()).unwrap();
                    streamed.push((f.name.unwrap(), args));
                }
                finish = ch.finish_reason.or(finish);
            }
        }
        assert_eq!(streamed, whole_calls, "seed {seed}");
        assert_eq!(serde_json::to_value(finish).unwrap(), json!("tool_calls"));
    }
    // `auto`: free text here, as content.
    let req = request(4, |a| {
        a.tools(tools())
            .tool_choice(ChatCompletionToolChoiceOption::Mode(
                ToolChoiceOptions::Auto,
            ))
            .temperature(0.0)
            .max_completion_tokens(16u32);
    });
    let reply = c.chat().create(req).await.unwrap();
    assert!(reply.choices[0].message.content.is_some(), "{reply:?}");
    // A tool turn and an assistant turn with calls in the history.
    let body = json!({
        "model": MODEL, "max_tokens": 8, "temperature": 0.0,
        "tools": serde_json::to_value(tools()).unwrap(),
        "messages": [
            {"role": "user", "content": "Add 2 and 3."},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        ],
    });
    let r = post(s, "/v1/chat/completions", &body.to_string(), Some(KEY)).await;
    assert_eq!(r.status(), 200);
}

/// Invalid constraints and tool requests are 400s naming the field; the server keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_constraints_are_400s_naming_the_field() {
    let s = default_model_server().await;
    let chat = |extra: Value| {
        let mut body = json!({
            "model": MODEL, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hi"}],
        });
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body.to_string()
    };
    let cases = [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"structured_outputs": {"regex": "[a-"}}),
            "structured_outputs.regex",
        ),
        (
            json!({"guided_grammar": "start: missing_rule"}),
            "guided_grammar",
        ),
        (json!({"guided_choice": []}), "guided_choice"),
        (json!({"guided_json": "{not json"}), "guided_json"),
        (
            json!({"guided_regex": "a", "response_format": {"type": "json_object"}}),
            "guided_regex",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                   "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
            "tools[0].type",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format.type",
        ),
    ];
    for (extra, field) in cases {
        let r = post(&s, "/v1/chat/completions", &chat(extra.clone()), Some(KEY)).await;
        assert_eq!(r.status(), 400, "{extra}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], json!(field), "{extra}: {v}");
    }
    let r = post(&s, "/v1/chat/completions", &chat(json!({})), Some(KEY)).await;
    assert_eq!(r.status(), 200);
}
