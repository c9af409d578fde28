use model_qwen2::{Architecture, ModelError, Qwen2Config};

use super::common::{CHECKPOINTS, fixture};

#[test]
fn parses_every_fixture_config() {
    for name in CHECKPOINTS {
        let c = Qwen2Config::from_file(fixture(name).join("config.json")).unwrap();
        assert!(c.num_hidden_layers > 0, "{name}");
        match name {
            "qwen2-tiny-tied" => {
                assert_eq!(
                    (
                        c.architecture,
                        c.head_dim,
                        c.tie_word_embeddings,
                        c.attention_bias
                    ),
                    (Architecture::Qwen2, 8, true, true)
                );
                assert_eq!(
                    (c.vocab_size, c.eos_token_ids.clone()),
                    (151936, vec![151645])
                );
            }
            "qwen2-tiny-untied" => assert_eq!(
                (c.head_dim, c.tie_word_embeddings, c.qk_norm),
                (8, false, false)
            ),
            "qwen3-tiny" => assert_eq!(
                (c.architecture, c.head_dim, c.qk_norm, c.attention_bias),
                (Architecture::Qwen3, 16, true, false)
            ),
            "qwen3-tiny-hd32" => assert_eq!(
                (c.head_dim, c.q_size(), c.tie_word_embeddings),
                (32, 128, true)
            ),
            _ => unreachable!(),
        }
        assert_eq!(c.rope_theta, 1e6);
    }
}

fn edited(edit: impl FnOnce(&mut serde_json::Value)) -> Result<Qwen2Config, ModelError> {
    let text = std::fs::read_to_string(fixture("qwen2-tiny-untied").join("config.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(&mut json);
    Qwen2Config::from_json(&json.to_string())
}

#[track_caller]
fn assert_refused(result: Result<Qwen2Config, ModelError>, field: &str) {
    let err = result.expect_err("config should be refused").to_string();
    assert!(err.contains(field), "error `{err}` should name `{field}`");
}

#[test]
fn refuses_unsupported_settings_naming_the_field() {
    assert_refused(
        edited(|j| j["architectures"] = serde_json::json!(["LlamaForCausalLM"])),
        "architectures",
    );
    assert_refused(
        edited(|j| j["use_sliding_window"] = true.into()),
        "use_sliding_window",
    );
    assert_refused(
        edited(|j| j["rope_scaling"] = serde_json::json!({"type": "yarn", "factor": 4.0})),
        "rope_scaling.type",
    );
    assert_refused(
        edited(|j| j["rope_scaling"] = serde_json::json!({"rope_type": "dynamic", "factor": 2.0})),
        "rope_scaling.rope_type",
    );
    assert_refused(edited(|j| j["hidden_act"] = "gelu".into()), "hidden_act");
    assert_refused(
        edited(|j| j["num_key_value_heads"] = 3.into()),
        "num_key_value_heads",
    );
    // Shapes outside the kernels' range: head_dim 512, 4, odd; empty sizes.
    for head_dim in [512, 4, 33] {
        assert_refused(
            edited(|j| {
                j["architectures"] = serde_json::json!(["Qwen3ForCausalLM"]);
                j["head_dim"] = head_dim.into();
            }),
            "head_dim",
        );
    }
    for field in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
    ] {
        assert_refused(edited(|j| j[field] = 0.into()), field);
    }
    // sliding_window set but switched off, as in real Qwen2.5 configs, is fine.
    edited(|j| j["sliding_window"] = 4096.into()).unwrap();
    // transformers 5 moves rope_theta into rope_parameters.
    let c = edited(|j| {
        j.as_object_mut().unwrap().remove("rope_theta");
        j["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 5e5});
    })
    .unwrap();
    assert_eq!(c.rope_theta, 5e5);
}

#[test]
fn malformed_or_missing_config_is_an_error() {
    let err = Qwen2Config::from_json("{\"architectures\": [\"Qwen2ForCausalLM\"]}").unwrap_err();
    assert!(matches!(err, ModelError::Parse { .. }), "{err}");
    let err = Qwen2Config::from_file(fixture("does-not-exist").join("config.json")).unwrap_err();
    assert!(err.to_string().contains("missing model file"), "{err}");
}
