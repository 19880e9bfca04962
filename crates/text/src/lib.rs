//! The text side of a model directory: the tokenizer (`tokenizer.json`), the chat
//! template (rendered like transformers' Jinja environment) and an incremental
//! detokenizer that never emits half a UTF-8 character.

mod detokenize;
mod template;
mod tokenizer;

pub use detokenize::IncrementalDecoder;
pub use template::ChatTemplate;
pub use tokenizer::TextTokenizer;

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error(transparent)]
    Config(#[from] mmserve_config::ConfigError),
    #[error("{path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("tokenizing the prompt: {0}")]
    Encode(String),
    #[error("the model directory has no chat template (chat_template.jinja or tokenizer_config.json)")]
    NoChatTemplate,
    #[error("chat template: {0}")]
    Template(String),
}
