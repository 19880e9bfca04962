//! Hugging Face model directories, read without loading any weights.
//!
//! `config.json` comes in two layouts: the Hub's (`torch_dtype`, `rope_theta` and
//! `rope_scaling` at the top of `text_config`) and transformers v5's (`dtype`,
//! `rope_parameters`). Both parse into the same typed structs, with transformers'
//! defaults filled in for every field a Hub config leaves out (llava-1.5-7b-hf's
//! `text_config` names only five fields).

mod defaults;
mod files;
pub mod hub;
mod llava;
mod qwen2_audio;
mod qwen2_vl;

pub use files::{ModelDir, WeightFiles};
pub use llava::{ClipVisionConfig, FeatureSelect, LlamaConfig, LlavaConfig};
pub use qwen2_audio::{AudioEncoderConfig, Qwen2AudioConfig, audio_token_count};
pub use qwen2_vl::{Qwen2VisionConfig, Qwen2VlConfig, WindowAttention};

use std::path::PathBuf;

/// The architectures mmserve serves.
pub const SUPPORTED: &str = "LlavaForConditionalGeneration, Qwen2AudioForConditionalGeneration, \
                             Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("model directory {0} does not exist or is not a directory")]
    NotADirectory(PathBuf),
    #[error("model {id:?} is not a directory, and not in the Hugging Face cache: looked in {looked}: {why}")]
    NotInHubCache { id: String, looked: PathBuf, why: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: invalid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("unsupported architecture {0:?} (supported: {supported})", supported = SUPPORTED)]
    UnsupportedArchitecture(String),
    #[error("{0}: no weights found (model.safetensors or model.safetensors.index.json)")]
    NoWeights(PathBuf),
}

/// What a model directory holds, by family.
#[derive(Debug, Clone)]
pub enum ModelConfig {
    Llava(LlavaConfig),
    Qwen2Audio(Qwen2AudioConfig),
    /// Qwen2-VL and Qwen2.5-VL.
    Qwen2Vl(Qwen2VlConfig),
}

/// What kind of media items a model takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MediaKind {
    Image,
    Audio,
}

impl ModelConfig {
    /// Parses a `config.json` value, dispatching on `model_type` / `architectures`.
    pub fn from_json(value: &serde_json::Value) -> Result<Self, String> {
        let model_type = value.get("model_type").and_then(|v| v.as_str()).unwrap_or("");
        let arch = value.get("architectures").and_then(|a| a.get(0)).and_then(|a| a.as_str()).unwrap_or("");
        if model_type == "llava" || arch == "LlavaForConditionalGeneration" {
            return LlavaConfig::from_json(value).map(ModelConfig::Llava);
        }
        if model_type == "qwen2_audio" || arch == "Qwen2AudioForConditionalGeneration" {
            return Qwen2AudioConfig::from_json(value).map(ModelConfig::Qwen2Audio);
        }
        let qwen_vl = ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"];
        if model_type == "qwen2_vl" || model_type == "qwen2_5_vl" || qwen_vl.contains(&arch) {
            return Qwen2VlConfig::from_json(value).map(ModelConfig::Qwen2Vl);
        }
        Err(format!("unsupported architecture {arch:?} (model_type {model_type:?}); supported: {SUPPORTED}"))
    }

    /// The language model's config.
    pub fn text(&self) -> &LlamaConfig {
        match self {
            ModelConfig::Llava(c) => &c.text,
            ModelConfig::Qwen2Audio(c) => &c.text,
            ModelConfig::Qwen2Vl(c) => &c.text,
        }
    }

    /// Hidden size of the language model: the width of one embedding row.
    pub fn lm_hidden_size(&self) -> usize {
        self.text().hidden_size
    }

    /// Vocabulary size of the language model (rows of the embedding table).
    pub fn vocab_size(&self) -> usize {
        self.text().vocab_size
    }

    /// The dtype the checkpoint declares (`float32`, `bfloat16`, `float16`).
    pub fn dtype(&self) -> &str {
        match self {
            ModelConfig::Llava(c) => &c.dtype,
            ModelConfig::Qwen2Audio(c) => &c.dtype,
            ModelConfig::Qwen2Vl(c) => &c.dtype,
        }
    }

    /// The media the model takes.
    pub fn media(&self) -> MediaKind {
        match self {
            ModelConfig::Llava(_) | ModelConfig::Qwen2Vl(_) => MediaKind::Image,
            ModelConfig::Qwen2Audio(_) => MediaKind::Audio,
        }
    }
}
