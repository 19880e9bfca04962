//! The embed-cache service: records of media items keyed by digest, reference counts,
//! the shared-memory embedding arena. Semantics after LightLLM's cache (see ARCHITECTURE.md).

use std::fmt;

use serde::{Deserialize, Serialize};

/// md5 of an item's bytes, its modality and the fingerprint of everything that changes
/// its embedding. Computed the same way in every process.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ItemKey(pub [u8; 16]);

impl fmt::Display for ItemKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for ItemKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ItemKey({self})")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Modality {
    Image,
    Audio,
}

impl fmt::Display for Modality {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Modality::Image => "image",
            Modality::Audio => "audio",
        })
    }
}

/// One item of an `alloc` call.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AllocItem {
    pub key: ItemKey,
    pub modality: Modality,
    /// Embedding rows (= virtual tokens) the item becomes.
    pub token_num: u32,
    /// Bytes of raw data the item's data segment must hold.
    pub data_len: u64,
}

/// The cache's answer for one requested item; the caller now holds one reference to it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ItemRecord {
    pub id: u64,
    pub key: ItemKey,
    /// First virtual token id of the item's range `[token_id, token_id + token_num)`.
    pub token_id: u64,
    pub token_num: u32,
    /// First arena slot of the item's contiguous block.
    pub start_index: u64,
    pub data_ready: bool,
    pub embed_ready: bool,
    /// Shared-memory segment (created by the cache) that holds the raw bytes.
    pub data_segment: String,
    pub data_len: u64,
    /// True for exactly one caller: the one whose `alloc` created the record and who
    /// must write the raw bytes and call `set_items_data`.
    pub write_data: bool,
}

/// Where the embedding arena lives and how it is laid out.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ArenaInfo {
    pub segment: String,
    pub slots: u64,
    /// f32 values per slot (the LLM's hidden size).
    pub hidden: u32,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CacheStats {
    pub items: u64,
    pub max_items: u64,
    pub slots_total: u64,
    pub slots_used: u64,
    pub references: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub data_bytes: u64,
}

#[derive(Debug, Clone, thiserror::Error, Serialize, Deserialize)]
pub enum CacheError {
    /// Would fit once other requests release their items: try again later.
    #[error(
        "the embedding cache is full: {needed_slots} slots and {needed_items} items needed, in use by other requests"
    )]
    Full { needed_slots: u64, needed_items: u64 },
    /// Can never fit, whatever else happens.
    #[error("the request's media needs {needed} {what}, more than the cache's limit of {limit}")]
    TooLarge { what: String, needed: u64, limit: u64 },
    #[error("no cache item with id {0}")]
    UnknownItem(u64),
    #[error("cache item {0} is not referenced")]
    NotReferenced(u64),
    #[error("shared memory: {0}")]
    SharedMemory(String),
    #[error("timed out after {0} ms waiting for item data")]
    Timeout(u64),
}

#[tarpc::service]
pub trait EmbedCache {
    /// All-or-nothing: a record (new or existing) and one reference for every item, or
    /// an error and nothing held.
    async fn alloc(items: Vec<AllocItem>) -> Result<Vec<ItemRecord>, CacheError>;
    /// Drops one reference per id (ids may repeat).
    async fn release(ids: Vec<u64>) -> Result<(), CacheError>;
    async fn set_items_data(ids: Vec<u64>) -> Result<(), CacheError>;
    async fn get_items_data(ids: Vec<u64>) -> Result<Vec<bool>, CacheError>;
    /// Resolves when every item's raw data is written, or fails after `timeout_ms`.
    async fn wait_items_data(ids: Vec<u64>, timeout_ms: u64) -> Result<(), CacheError>;
    async fn set_items_embed(ids: Vec<u64>) -> Result<(), CacheError>;
    async fn get_items_embed(ids: Vec<u64>) -> Result<Vec<bool>, CacheError>;
    async fn arena() -> ArenaInfo;
    async fn stats() -> CacheStats;
}
