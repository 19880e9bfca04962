//! The files of a model directory: config, weights, tokenizer, chat template,
//! preprocessor settings.

use std::path::{Path, PathBuf};

use crate::{ConfigError, ModelConfig};

/// Where a checkpoint's tensors live.
#[derive(Debug, Clone)]
pub enum WeightFiles {
    Single(PathBuf),
    /// `model.safetensors.index.json` and the shards it names, in file order.
    Sharded(Vec<PathBuf>),
}

impl WeightFiles {
    pub fn paths(&self) -> Vec<PathBuf> {
        match self {
            WeightFiles::Single(p) => vec![p.clone()],
            WeightFiles::Sharded(v) => v.clone(),
        }
    }
}

/// A Hugging Face model directory, opened and its `config.json` parsed.
#[derive(Debug, Clone)]
pub struct ModelDir {
    pub root: PathBuf,
    /// The raw `config.json`.
    pub raw_config: serde_json::Value,
    pub config: ModelConfig,
    /// The model's name as served: the directory's last component.
    pub name: String,
}

impl ModelDir {
    pub fn open(root: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let root = root.as_ref().to_path_buf();
        if !root.is_dir() {
            return Err(ConfigError::NotADirectory(root));
        }
        let config_path = root.join("config.json");
        let raw_config = read_json(&config_path)?;
        let config = ModelConfig::from_json(&raw_config)
            .map_err(|message| ConfigError::Invalid { path: config_path.clone(), message })?;
        let name = root
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".to_string());
        Ok(ModelDir { root, raw_config, config, name })
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.root.join(file)
    }

    /// Reads a JSON file of the directory, if it exists.
    pub fn optional_json(&self, file: &str) -> Result<Option<serde_json::Value>, ConfigError> {
        let p = self.path(file);
        if p.exists() { read_json(&p).map(Some) } else { Ok(None) }
    }

    /// `model.safetensors`, or the shards named by `model.safetensors.index.json`.
    pub fn weight_files(&self) -> Result<WeightFiles, ConfigError> {
        let single = self.path("model.safetensors");
        if single.exists() {
            return Ok(WeightFiles::Single(single));
        }
        let index_path = self.path("model.safetensors.index.json");
        if !index_path.exists() {
            return Err(ConfigError::NoWeights(self.root.clone()));
        }
        let index = read_json(&index_path)?;
        let map = index
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ConfigError::Invalid { path: index_path.clone(), message: "no weight_map object".into() })?;
        let mut shards: Vec<String> = Vec::new();
        for file in map.values() {
            let file = file.as_str().ok_or_else(|| ConfigError::Invalid {
                path: index_path.clone(),
                message: "weight_map values must be file names".into(),
            })?;
            if file.contains('/') || file.contains("..") {
                return Err(ConfigError::Invalid {
                    path: index_path.clone(),
                    message: format!("shard name {file:?} leaves the model directory"),
                });
            }
            if !shards.iter().any(|s| s == file) {
                shards.push(file.to_string());
            }
        }
        shards.sort();
        Ok(WeightFiles::Sharded(shards.into_iter().map(|s| self.path(&s)).collect()))
    }

    /// The chat template: `chat_template.jinja` first, then `tokenizer_config.json`'s
    /// `chat_template` (a string, or a list of named templates of which `default` is used).
    pub fn chat_template(&self) -> Result<Option<String>, ConfigError> {
        let jinja = self.path("chat_template.jinja");
        if jinja.exists() {
            return std::fs::read_to_string(&jinja).map(Some).map_err(|source| ConfigError::Io { path: jinja, source });
        }
        let Some(tc) = self.optional_json("tokenizer_config.json")? else {
            return Ok(None);
        };
        Ok(match tc.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            _ => None,
        })
    }
}

pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text).map_err(|source| ConfigError::Json { path: path.to_path_buf(), source })
}
