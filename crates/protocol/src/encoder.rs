//! The encoder service: turns items' raw bytes into embedding rows in the arena.

use serde::{Deserialize, Serialize};

use crate::Modality;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EncodeItem {
    pub id: u64,
    pub modality: Modality,
    /// The cache instance the offsets refer to (see `ArenaInfo::instance`).
    pub cache_instance: u64,
    pub data_offset: u64,
    pub data_len: u64,
    pub start_index: u64,
    pub token_num: u32,
    /// Qwen-VL images: `(min_pixels, max_pixels)` the request chose
    /// (`mm_processor_kwargs`) instead of the preprocessor config's; part of the item's
    /// digest, so items under other bounds never share an embedding.
    #[serde(default)]
    pub pixel_bounds: Option<(u64, u64)>,
}

/// Where an item's time in the encoder went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ItemTiming {
    /// Decoding and preprocessing (on a CPU thread).
    pub preprocess_s: f64,
    /// The tower forward of the batch it was in, writing its rows included.
    pub tower_s: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct EncoderStats {
    /// Items run through the tower (cache hits never are).
    pub items_encoded: u64,
    pub batches: u64,
    pub largest_batch: u64,
}

#[derive(Debug, Clone, thiserror::Error, Serialize, Deserialize)]
pub enum EncoderError {
    /// The item's bytes are not a usable image or clip: the client's fault.
    #[error("{message}")]
    BadItem { index: usize, message: String },
    #[error("timed out after {0} ms")]
    Timeout(u64),
    /// A passing condition (an upload abandoned, an item evicted with its requests gone,
    /// the cache restarting): retrying may succeed.
    #[error("{0}")]
    Unavailable(String),
    #[error("encoder failure: {0}")]
    Internal(String),
}

#[tarpc::service]
pub trait Encoder {
    /// Resolves once every item's embedding rows are in the arena and marked ready.
    /// Items already ready, or being encoded for another request, are not encoded again.
    /// Returns the timings of the items this call had encoded (none for the others).
    /// `request_id`: the client-facing id of the request asking (for log lines).
    async fn encode(request_id: String, items: Vec<EncodeItem>) -> Result<Vec<ItemTiming>, EncoderError>;
    async fn stats() -> EncoderStats;
}
