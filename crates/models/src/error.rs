//! Errors of the model code: candle failures, checkpoints that do not match their
//! `config.json` (missing tensors, wrong shapes), settings this crate does not
//! implement (`rope_type` other than `default`, unknown activations) and bad inputs.

use mmserve_config::ConfigError;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Op(#[from] mmserve_ops::OpError),
    #[error("tensor {0:?} is missing from the checkpoint")]
    MissingTensor(String),
    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch { name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("unsupported model setting: {0}")]
    Unsupported(String),
    #[error("invalid input: {0}")]
    InvalidInput(String),
}
