//! The contracts between mmserve's processes.
//!
//! Each service is a `#[tarpc::service]` trait over a Unix socket (see [`transport`]).
//! Only the types here cross process boundaries; nothing in this crate knows OpenAI JSON
//! or runs a model.

pub mod cache;
pub mod encoder;
pub mod engine;
pub mod ready;
pub mod reconnect;
pub mod transport;

pub use cache::{
    AdminError, AllocItem, ArenaDtype, ArenaInfo, CacheAdmin, CacheAdminClient, CacheError, CacheStats, EmbedCache,
    EmbedCacheClient, ItemDigest, ItemInfo, ItemKey, ItemRecord, Modality, PinState,
};
pub use encoder::{EncodeItem, Encoder, EncoderClient, EncoderError, EncoderStats, ItemTiming};
pub use engine::{
    Constraint, Engine, EngineClient, EngineError, EngineInfo, FinishReason, GenerateRequest, ItemSpan, MropePrompt,
    OutputEvent, RequestTiming, SamplingParams, TokenLogprobs,
};

/// Virtual token ids of media items start here, far above any vocabulary, and are
/// never reused (so the prefix cache can key on them).
pub const VIRTUAL_TOKEN_BASE: u64 = 1 << 32;

/// A tarpc context whose deadline is `timeout` from now. Every RPC carries one.
pub fn deadline(timeout: std::time::Duration) -> tarpc::context::Context {
    let mut ctx = tarpc::context::current();
    ctx.deadline = std::time::Instant::now() + timeout;
    ctx
}

/// An RPC failed in transport (peer gone, deadline passed) rather than in the service.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{service} did not answer: {reason}")]
pub struct RpcFailure {
    pub service: &'static str,
    pub reason: String,
}

impl RpcFailure {
    pub fn new(service: &'static str, e: tarpc::client::RpcError) -> Self {
        RpcFailure { service, reason: e.to_string() }
    }
}

#[doc(hidden)]
pub mod __private {
    pub use futures::StreamExt;
    pub use tarpc::server::{BaseChannel, Channel};
    pub use tokio::{net::UnixListener, spawn};
    pub use tracing::warn;
}
