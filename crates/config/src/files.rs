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
    /// A directory, or a Hugging Face hub id found in the local cache ([`crate::hub`]),
    /// served under that id.
    pub fn open(root: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let given = root.as_ref();
        if !given.is_dir() && crate::hub::looks_like_hub_id(given) {
            let id = given.to_string_lossy().into_owned();
            let mut dir = Self::open_dir(crate::hub::resolve(&id, &crate::hub::cache_dir())?)?;
            dir.name = id;
            return Ok(dir);
        }
        Self::open_dir(given.to_path_buf())
    }

    fn open_dir(root: PathBuf) -> Result<Self, ConfigError> {
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

    /// The chat template, where transformers looks for it: `chat_template.jinja`, then a
    /// processor's `chat_template.json`, then `tokenizer_config.json`'s `chat_template`
    /// (in either JSON file a string, a list of named templates, or a map of them, of
    /// which `default` is used).
    pub fn chat_template(&self) -> Result<Option<String>, ConfigError> {
        let jinja = self.path("chat_template.jinja");
        if jinja.exists() {
            return std::fs::read_to_string(&jinja).map(Some).map_err(|source| ConfigError::Io { path: jinja, source });
        }
        for file in ["chat_template.json", "tokenizer_config.json"] {
            if let Some(template) =
                self.optional_json(file)?.as_ref().and_then(|v| named_default(v.get("chat_template")?))
            {
                return Ok(Some(template));
            }
        }
        Ok(None)
    }
}

/// A `chat_template` value: the string, or the template named `default` in a list of
/// `{name, template}` or a map of name to template.
fn named_default(v: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str())
            .map(str::to_string),
        Value::Object(map) => map.get("default")?.as_str().map(str::to_string),
        _ => None,
    }
}

pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text).map_err(|source| ConfigError::Json { path: path.to_path_buf(), source })
}
