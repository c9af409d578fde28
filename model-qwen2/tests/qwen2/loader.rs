use std::collections::HashMap;
use std::path::Path;

use burn::tensor::DType;
use model_qwen2::{KvCache, LogitsRows, ModelError, Qwen2Model};
use safetensors::{SafeTensors, tensor::TensorView};

use super::common::{BLOCK_SIZE, Blocks, Golden, assert_close, device, fixture, to_vec};

const SRC: &str = "qwen2-tiny-untied";

/// A copy of the fixture whose tensors went through `edit` (name → (dtype, shape, bytes)).
fn edited_checkpoint(
    edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture(SRC).join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let bytes = std::fs::read(fixture(SRC).join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut tensors);
    write_safetensors(&dir.path().join("model.safetensors"), &tensors);
    dir
}

fn write_safetensors(path: &Path, tensors: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn load(dir: &Path) -> Result<Qwen2Model, ModelError> {
    Qwen2Model::from_pretrained(dir, DType::F32, &device())
}

#[test]
fn truncated_safetensors_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture(SRC).join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let bytes = std::fs::read(fixture(SRC).join("model.safetensors")).unwrap();
    std::fs::write(
        dir.path().join("model.safetensors"),
        &bytes[..bytes.len() / 2],
    )
    .unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(matches!(err, ModelError::Safetensors { .. }), "{err}");
    assert!(err.to_string().contains("model.safetensors"), "{err}");
}

#[test]
fn missing_tensor_is_an_error_naming_it() {
    let dir = edited_checkpoint(|t| t.retain(|(n, ..)| n != "model.layers.1.mlp.up_proj.weight"));
    let err = load(dir.path()).unwrap_err();
    assert!(
        matches!(&err, ModelError::MissingTensor(n) if n == "model.layers.1.mlp.up_proj.weight"),
        "{err}"
    );
}

#[test]
fn wrong_shape_is_an_error_naming_the_tensor() {
    let dir = edited_checkpoint(|t| {
        let down = t
            .iter_mut()
            .find(|(n, ..)| n == "model.layers.0.mlp.down_proj.weight")
            .unwrap();
        down.2.reverse(); // [H, I] -> [I, H], same bytes
    });
    let err = load(dir.path()).unwrap_err();
    assert!(
        matches!(&err, ModelError::ShapeMismatch { name, .. } if name == "model.layers.0.mlp.down_proj.weight"),
        "{err}"
    );
    assert!(err.to_string().contains("[160, 64]"), "{err}");
}

#[test]
fn unexpected_tensor_is_an_error_naming_it() {
    let dir = edited_checkpoint(|t| {
        t.push((
            "model.layers.0.extra.weight".into(),
            safetensors::Dtype::F32,
            vec![2],
            vec![0; 8],
        ))
    });
    let err = load(dir.path()).unwrap_err();
    assert!(
        err.to_string().contains("model.layers.0.extra.weight"),
        "{err}"
    );
}

#[test]
fn unknown_architecture_and_missing_files_are_errors() {
    let dir = edited_checkpoint(|_| {});
    let config = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        config.replace("Qwen2ForCausalLM", "MistralForCausalLM"),
    )
    .unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(
        err.to_string()
            .contains("architectures = MistralForCausalLM"),
        "{err}"
    );

    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    std::fs::write(dir.path().join("config.json"), config).unwrap();
    let err = load(dir.path()).unwrap_err();
    assert!(
        matches!(&err, ModelError::MissingFile(p) if p.ends_with("model.safetensors")),
        "{err}"
    );

    let err = load(&fixture("no-such-checkpoint")).unwrap_err();
    assert!(
        matches!(&err, ModelError::MissingFile(p) if p.ends_with("config.json")),
        "{err}"
    );
}

#[test]
fn sharded_checkpoint_loads_like_the_single_file() {
    // Split the fixture into two shards plus the index, as `save_pretrained` does for big models.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture(SRC).join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let bytes = std::fs::read(fixture(SRC).join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut shards: [Vec<_>; 2] = [Vec::new(), Vec::new()];
    let mut weight_map = HashMap::new();
    for (i, (n, v)) in st.tensors().into_iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i % 2 + 1);
        weight_map.insert(n.clone(), file);
        shards[i % 2].push((n, v.dtype(), v.shape().to_vec(), v.data().to_vec()));
    }
    for (i, shard) in shards.iter().enumerate() {
        write_safetensors(
            &dir.path()
                .join(format!("model-0000{}-of-00002.safetensors", i + 1)),
            shard,
        );
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();

    let model = load(dir.path()).unwrap();
    let golden = Golden::load(SRC);
    let ids = golden.ids("prompt.2.input_ids");
    let mut blocks = Blocks::new(4);
    let mut cache = KvCache::new(&model.config, 4, BLOCK_SIZE, DType::F32, &device()).unwrap();
    let meta = model_qwen2::AttentionMetadata::prefill(
        vec![ids.len()],
        vec![blocks.take(1)],
        BLOCK_SIZE,
        &device(),
    )
    .unwrap();
    let logits = model.forward(
        model.input_ids(&ids, &device()).unwrap(),
        &meta,
        &mut cache,
        LogitsRows::All,
    );
    assert_close(
        "sharded logits",
        &to_vec(logits),
        &golden.f32s("prompt.2.logits"),
        1e-4,
    );
}

#[test]
fn token_ids_outside_the_vocabulary_are_refused() {
    let model = load(&fixture(SRC)).unwrap();
    let err = model.input_ids(&[1, 1024], &device()).unwrap_err();
    assert!(err.to_string().contains("token id 1024"), "{err}");
}
