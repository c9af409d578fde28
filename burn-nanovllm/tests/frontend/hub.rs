//! The Hugging Face cache resolver against a fake cache tree (offline: no network in tests).

use std::fs;
use std::path::{Path, PathBuf};

use burn_nanovllm::hub::{HubEnv, resolve_model_in};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const OLD: &str = "fedcba9876543210fedcba9876543210fedcba98";

/// `models--Qwen--Tiny` with `main` → COMMIT (complete, sharded) and OLD (no weights).
fn fake_cache(root: &Path) -> PathBuf {
    let repo = root.join("models--Qwen--Tiny");
    fs::create_dir_all(repo.join("refs")).unwrap();
    fs::write(repo.join("refs/main"), format!("{COMMIT}\n")).unwrap();
    fs::write(repo.join("refs/v1"), OLD).unwrap();
    let snap = repo.join("snapshots").join(COMMIT);
    fs::create_dir_all(&snap).unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        fs::write(snap.join(f), "x").unwrap();
    }
    fs::write(
        snap.join("model.safetensors.index.json"),
        r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let old = repo.join("snapshots").join(OLD);
    fs::create_dir_all(&old).unwrap();
    fs::write(old.join("config.json"), "x").unwrap();
    fs::write(old.join("tokenizer.json"), "x").unwrap();
    snap
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("bnv-hub-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn resolves_repo_ids_in_the_cache_and_names_what_is_missing() {
    let root = temp_dir("cache");
    let snap = fake_cache(&root);
    let env = HubEnv {
        cache_dir: root.clone(),
        offline: true,
    };
    // A branch through refs/, and the commit itself.
    assert_eq!(resolve_model_in("Qwen/Tiny", None, &env).unwrap(), snap);
    assert_eq!(
        resolve_model_in("Qwen/Tiny", Some(COMMIT), &env).unwrap(),
        snap
    );
    // A local folder is taken as it is.
    let local = root.to_str().unwrap();
    assert_eq!(resolve_model_in(local, None, &env).unwrap(), root);
    // A snapshot without weights: the error names the missing file and what is cached.
    let err = resolve_model_in("Qwen/Tiny", Some("v1"), &env)
        .unwrap_err()
        .to_string();
    assert!(err.contains("offline"), "{err}");
    assert!(err.contains("model.safetensors"), "{err}");
    assert!(err.contains("[config.json, tokenizer.json]"), "{err}");
    // A missing shard is named.
    fs::remove_file(snap.join("model-00002-of-00002.safetensors")).unwrap();
    let err = resolve_model_in("Qwen/Tiny", None, &env)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("missing model-00002-of-00002.safetensors"),
        "{err}"
    );
    // A repo that is not cached at all.
    let err = resolve_model_in("Qwen/Other", None, &env)
        .unwrap_err()
        .to_string();
    assert!(err.contains("has nothing for `Qwen/Other`"), "{err}");
    assert!(err.contains(&root.display().to_string()), "{err}");
    // Neither a folder nor a repo id.
    let err = resolve_model_in("no/such/dir", None, &env)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a Hugging Face repo id"), "{err}");
    fs::remove_dir_all(&root).unwrap();
}
