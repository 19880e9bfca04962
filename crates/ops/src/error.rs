//! Errors of the ops: candle failures and inputs an op does not take.

#[derive(Debug, thiserror::Error)]
pub enum OpError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("invalid input: {0}")]
    InvalidInput(String),
}
