//! Models named by Hugging Face repo id (`Qwen/Qwen2.5-0.5B-Instruct`), resolved in the local
//! Hugging Face cache (`models--ORG--NAME/snapshots/<commit>`, branches through `refs/`), and
//! downloaded into it with `hf-hub` when online. Offline (`HF_HUB_OFFLINE=1`), or when a
//! download fails, the error says which file is missing and what the cache holds.

use std::path::{Path, PathBuf};

use crate::error::{LlmError, Result};

/// Where the cache is and whether the network may be used.
#[derive(Clone, Debug)]
pub struct HubEnv {
    /// The hub cache folder (holds `models--ORG--NAME/`).
    pub cache_dir: PathBuf,
    /// Use the cache alone.
    pub offline: bool,
}

impl HubEnv {
    /// From the environment: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
    /// `~/.cache/huggingface/hub`; offline when `HF_HUB_OFFLINE` is `1`/`true`/`yes`/`on`.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        let cache_dir = var("HF_HUB_CACHE")
            .map(PathBuf::from)
            .or_else(|| var("HF_HOME").map(|h| PathBuf::from(h).join("hub")))
            .unwrap_or_else(|| {
                PathBuf::from(var("HOME").unwrap_or_else(|| ".".into()))
                    .join(".cache/huggingface/hub")
            });
        let offline = std::env::var("HF_HUB_OFFLINE")
            .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"));
        Self { cache_dir, offline }
    }
}

/// A local folder as it is, or a repo id resolved (and if need be downloaded) through the
/// Hugging Face cache of the environment. `revision`: a branch, tag or 40-hex commit (default
/// `main`).
pub fn resolve_model(model: &str, revision: Option<&str>) -> Result<PathBuf> {
    resolve_model_in(model, revision, &HubEnv::from_env())
}

/// [`resolve_model`] with an explicit cache and network setting.
pub fn resolve_model_in(model: &str, revision: Option<&str>, env: &HubEnv) -> Result<PathBuf> {
    if Path::new(model).is_dir() {
        return Ok(PathBuf::from(model));
    }
    if !is_repo_id(model) {
        return Err(LlmError::Hub(format!(
            "model `{model}`: no such folder, and not a Hugging Face repo id (ORG/NAME)"
        )));
    }
    let revision = revision.unwrap_or("main");
    let repo_dir = env
        .cache_dir
        .join(format!("models--{}", model.replace('/', "--")));
    let snapshot = snapshot_dir(&repo_dir, revision);
    let missing = snapshot
        .as_deref()
        .map_or_else(|| vec!["config.json".to_string()], missing_files);
    if let (Some(dir), true) = (&snapshot, missing.is_empty()) {
        return Ok(dir.clone());
    }
    let cached = snapshot.as_deref().map(list_files).unwrap_or_default();
    let state = format!(
        "the Hugging Face cache at {} has {} for `{model}` at revision `{revision}`",
        env.cache_dir.display(),
        if cached.is_empty() {
            "nothing".to_string()
        } else {
            format!("[{}]", cached.join(", "))
        }
    );
    if env.offline {
        return Err(LlmError::Hub(format!(
            "offline (HF_HUB_OFFLINE): {state}; missing {}",
            missing.join(", ")
        )));
    }
    download(model, revision, env).map_err(|e| {
        LlmError::Hub(format!(
            "{e}; {state}; missing {} (download it where the hub is reachable, or set \
             HF_HUB_CACHE to a cache that has it)",
            missing.join(", ")
        ))
    })
}

/// `ORG/NAME` of letters, digits, `-`, `_`, `.`.
fn is_repo_id(s: &str) -> bool {
    let ok = |p: &str| {
        !p.is_empty()
            && !p.starts_with('.')
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    matches!(s.split_once('/'), Some((org, name)) if ok(org) && ok(name))
}

/// The snapshot folder of `revision`: a commit directly, a branch or tag through `refs/`.
fn snapshot_dir(repo_dir: &Path, revision: &str) -> Option<PathBuf> {
    let commit = if revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit()) {
        revision.to_string()
    } else {
        std::fs::read_to_string(repo_dir.join("refs").join(revision))
            .ok()?
            .trim()
            .to_string()
    };
    let dir = repo_dir.join("snapshots").join(commit);
    dir.is_dir().then_some(dir)
}

/// The files a checkpoint needs that `dir` lacks: config, tokenizer, and the weights (one
/// `model.safetensors`, or the index and every shard it names).
fn missing_files(dir: &Path) -> Vec<String> {
    let mut missing: Vec<String> = ["config.json", "tokenizer.json"]
        .into_iter()
        .filter(|f| !dir.join(f).is_file())
        .map(String::from)
        .collect();
    missing.extend(missing_weights(dir));
    missing
}

fn missing_weights(dir: &Path) -> Vec<String> {
    if dir.join("model.safetensors").is_file() {
        return Vec::new();
    }
    let index = dir.join("model.safetensors.index.json");
    let Some(shards) = std::fs::read_to_string(&index)
        .ok()
        .and_then(|t| shard_names(&t))
    else {
        return vec!["model.safetensors (or model.safetensors.index.json)".into()];
    };
    shards
        .into_iter()
        .filter(|s| !dir.join(s).is_file())
        .collect()
}

/// The shard file names of a `model.safetensors.index.json`, sorted and unique.
fn shard_names(index: &str) -> Option<Vec<String>> {
    let json: serde_json::Value = serde_json::from_str(index).ok()?;
    let mut names: Vec<String> = json["weight_map"]
        .as_object()?
        .values()
        .filter_map(|v| v.as_str().map(String::from))
        .collect();
    names.sort();
    names.dedup();
    Some(names)
}

fn list_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.path().is_file())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Downloads the checkpoint's files into the cache with hf-hub; returns the snapshot folder.
fn download(model: &str, revision: &str, env: &HubEnv) -> std::result::Result<PathBuf, String> {
    use hf_hub::api::sync::ApiBuilder;
    use hf_hub::{Repo, RepoType};
    let api = ApiBuilder::new()
        .with_cache_dir(env.cache_dir.clone())
        .with_progress(true)
        .build()
        .map_err(|e| format!("hub client: {e}"))?;
    let repo = api.repo(Repo::with_revision(
        model.to_string(),
        RepoType::Model,
        revision.to_string(),
    ));
    let get = |f: &str| {
        repo.get(f)
            .map_err(|e| format!("could not download `{f}` of `{model}`: {e}"))
    };
    let config = get("config.json")?;
    get("tokenizer.json")?;
    for optional in ["tokenizer_config.json", "generation_config.json"] {
        let _ = repo.get(optional);
    }
    match repo.get("model.safetensors.index.json") {
        Ok(index) => {
            let text = std::fs::read_to_string(&index).map_err(|e| e.to_string())?;
            for shard in shard_names(&text).ok_or("unreadable model.safetensors.index.json")? {
                get(&shard)?;
            }
        }
        Err(_) => {
            get("model.safetensors")?;
        }
    }
    Ok(config.parent().map(Path::to_path_buf).unwrap_or_default())
}
