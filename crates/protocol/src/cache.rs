//! The embed-cache service: records of media items keyed by digest, reference counts,
//! the shared-memory embedding arena. Semantics after LightLLM's cache (see ARCHITECTURE.md).

use std::fmt;

use serde::{Deserialize, Serialize};

/// md5 of an item's bytes, its modality and the fingerprint of everything that changes
/// its embedding. Computed the same way in every process.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ItemKey(pub [u8; 16]);

/// Hex in human-readable formats (JSON for scripts), raw bytes on the wire.
impl Serialize for ItemKey {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() { s.collect_str(self) } else { self.0.serialize(s) }
    }
}

impl<'de> Deserialize<'de> for ItemKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            let s = String::deserialize(d)?;
            s.parse().map_err(serde::de::Error::custom)
        } else {
            <[u8; 16]>::deserialize(d).map(ItemKey)
        }
    }
}

/// An item's identity: the md5 key the cache is indexed by, and a SHA-256 over the same
/// input that confirms a hit (md5 collisions can be manufactured; SHA-256 ones cannot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ItemDigest {
    pub key: ItemKey,
    pub confirm: [u8; 32],
}

impl ItemDigest {
    /// Digests of `bytes ‖ 0 ‖ fingerprint ‖ 0 ‖ modality`. The bytes come first, so the
    /// key is exactly as strong as md5 of the bytes (a common suffix preserves a collision,
    /// which the collision test relies on).
    pub fn compute(modality: Modality, fingerprint: &str, bytes: &[u8]) -> Self {
        use md5::Digest as _;
        let modality = modality.to_string();
        let suffix = [&[0u8][..], fingerprint.as_bytes(), &[0u8], modality.as_bytes()];
        let mut md5 = md5::Md5::new();
        let mut sha = sha2::Sha256::new();
        md5.update(bytes);
        sha.update(bytes);
        for part in suffix {
            md5.update(part);
            sha.update(part);
        }
        ItemDigest { key: ItemKey(md5.finalize().into()), confirm: sha.finalize().into() }
    }
}

impl std::str::FromStr for ItemKey {
    type Err = String;

    /// 32 hex digits.
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!("{s:?} is not a digest (32 hex digits)"));
        }
        let mut out = [0u8; 16];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
        }
        Ok(ItemKey(out))
    }
}

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
    pub digest: ItemDigest,
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
    /// Where the raw bytes live in the data arena (`ArenaInfo::data_segment`).
    pub data_offset: u64,
    pub data_len: u64,
    /// True for exactly one caller: the one whose `alloc` created the record and who
    /// must write the raw bytes and call `set_items_data`.
    pub write_data: bool,
}

/// What `alloc` grants: a record per requested item, in request order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Allocation {
    /// The cache instance whose arenas the records' offsets refer to.
    pub instance: u64,
    pub records: Vec<ItemRecord>,
}

/// Where the cache's two shared-memory arenas live and how they are laid out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArenaInfo {
    /// Random per start of the cache: a restarted cache has new arenas, and clients
    /// that see a new instance map them again.
    pub instance: u64,
    /// Embeddings, `[slots, layers, hidden]` of `dtype`.
    pub embed_segment: String,
    pub slots: u64,
    pub layers: u32,
    pub hidden: u32,
    /// The LLM's dtype: rows are stored as the LM will consume them.
    pub dtype: ArenaDtype,
    /// Raw item bytes.
    pub data_segment: String,
    pub data_bytes: u64,
}

impl ArenaInfo {
    /// Bytes of one slot.
    pub fn slot_bytes(&self) -> usize {
        self.layers as usize * self.hidden as usize * self.dtype.size()
    }
}

/// Element type of the embedding arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ArenaDtype {
    F32,
    Bf16,
    F16,
}

impl ArenaDtype {
    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            ArenaDtype::F32 => 4,
            ArenaDtype::Bf16 | ArenaDtype::F16 => 2,
        }
    }

    /// The name `config.json` uses.
    pub fn name(self) -> &'static str {
        match self {
            ArenaDtype::F32 => "float32",
            ArenaDtype::Bf16 => "bfloat16",
            ArenaDtype::F16 => "float16",
        }
    }
}

impl std::fmt::Display for ArenaDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ArenaDtype {
    type Err = String;

    /// Accepts `config.json`'s names and the short ones (`f32`, `bf16`, `f16`, `half`), as
    /// the model loader does.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "float32" | "f32" => Ok(ArenaDtype::F32),
            "bfloat16" | "bf16" => Ok(ArenaDtype::Bf16),
            "float16" | "f16" | "half" => Ok(ArenaDtype::F16),
            other => Err(format!("unknown dtype {other:?} (float32, bfloat16 or float16)")),
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CacheStats {
    pub items: u64,
    pub max_items: u64,
    pub slots_total: u64,
    pub slots_used: u64,
    pub largest_free_block: u64,
    pub references: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Raw item bytes held in the data arena.
    pub data_bytes: u64,
    pub data_bytes_total: u64,
    /// `alloc` calls waiting for capacity.
    pub waiting: u64,
    /// Leases released before their alloc arrived, remembered so it is refused.
    pub cancelled_leases: u64,
}

#[derive(Debug, Clone, thiserror::Error, Serialize, Deserialize)]
pub enum CacheError {
    /// Did not fit within the wait: try again later.
    #[error(
        "the embedding cache stayed full for {waited_ms} ms ({needed_slots} slots and {needed_items} items needed, in use by other requests)"
    )]
    Full { needed_slots: u64, needed_items: u64, waited_ms: u64 },
    /// Can never fit, whatever else happens.
    #[error("the request's media needs {needed} {what}, more than the limit of {limit} ({flag})")]
    TooLarge { what: String, needed: u64, limit: u64, flag: String },
    #[error("no cache item with id {0}")]
    UnknownItem(u64),
    #[error("cache item {0} is not referenced by this client")]
    NotReferenced(u64),
    #[error("shared memory: {0}")]
    SharedMemory(String),
    #[error("the client's connection closed")]
    Disconnected,
    #[error("the request that uploads item {0} went away before writing it; retry")]
    Abandoned(u64),
    #[error("timed out after {0} ms waiting for item data")]
    Timeout(u64),
    #[error("the request's reservation was cancelled")]
    Cancelled,
}

/// One operation of an [`EmbedCache::batch`] call.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum CacheOp {
    /// As [`EmbedCache::alloc`] without waiting: granted now, refused, or [`CacheOpResult::MustWait`].
    Alloc {
        lease: u64,
        items: Vec<AllocItem>,
    },
    /// As [`EmbedCache::release_lease`].
    ReleaseLease {
        lease: u64,
        linger_ms: u64,
    },
    SetData(Vec<u64>),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum CacheOpResult {
    Allocated(Allocation),
    Done,
    /// A lease's release: how many references it dropped.
    Released(u64),
    Failed(CacheError),
    /// The alloc would have to wait in line: call [`EmbedCache::alloc`] with a wait.
    MustWait,
}

#[tarpc::service]
pub trait EmbedCache {
    /// All-or-nothing: a record (new or existing) and one reference for every item, or
    /// an error and nothing held. When the items would fit once others are released, the
    /// call waits in line (first come, first served, holding nothing) up to `wait_ms`.
    /// References belong to `lease` of the calling connection (0: the connection
    /// itself) and are released with the lease, or when the connection closes.
    async fn alloc(lease: u64, items: Vec<AllocItem>, wait_ms: u64) -> Result<Allocation, CacheError>;
    /// Drops one reference per id (ids may repeat) held by this connection (lease 0).
    async fn release(ids: Vec<u64>) -> Result<(), CacheError>;
    /// Drops everything `lease` holds and takes it out of the line. If the lease holds
    /// nothing yet (this call overtook its alloc), an alloc under it arriving within
    /// `linger_ms` is refused, so a grant never outlives the request that asked.
    /// Returns how many references it dropped.
    async fn release_lease(lease: u64, linger_ms: u64) -> u64;
    /// Several requests' operations in one call, decided in order under one lock pass
    /// (an api process coalesces what its concurrent requests ask for meanwhile).
    async fn batch(ops: Vec<CacheOp>) -> Vec<CacheOpResult>;
    async fn set_items_data(ids: Vec<u64>) -> Result<(), CacheError>;
    /// Resolves when every item's raw data is written, or fails after `timeout_ms`.
    async fn wait_items_data(ids: Vec<u64>, timeout_ms: u64) -> Result<(), CacheError>;
    /// What the encoder asks of a batch in one round trip: each item's state, pinned (a
    /// reference of this connection, so no slot is reused under it) if it still needs
    /// its embedding.
    async fn pin_unready(ids: Vec<u64>) -> Vec<PinState>;
    /// The encoder is done with a batch: `ready` have their embeddings, and one
    /// reference of this connection to each of `unpin` is released (ids that are gone
    /// are skipped).
    async fn encoded(ready: Vec<u64>, unpin: Vec<u64>) -> Result<(), CacheError>;
    async fn arena() -> ArenaInfo;
    async fn stats() -> CacheStats;
}

/// An item's state for the encoder ([`EmbedCache::pin_unready`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PinState {
    /// Gone or abandoned: nothing to encode, and nothing pinned.
    Gone,
    /// Its embedding is in the arena already: nothing pinned.
    Ready,
    /// Pinned: encode it, then release the pin.
    Pinned,
}

/// Item details for operators.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ItemInfo {
    pub digest: ItemKey,
    pub modality: Modality,
    pub start_slot: u64,
    pub slots: u32,
    pub references: u32,
    pub data_bytes: u64,
    pub embed_ready: bool,
    pub data_ready: bool,
    /// Referenced, but its bytes never came (its writer left or missed the data
    /// timeout): whatever holds it is stuck; `drop` removes it.
    pub stuck: bool,
    pub idle_ms: u64,
    pub age_ms: u64,
}

#[derive(Debug, Clone, thiserror::Error, Serialize, Deserialize)]
pub enum AdminError {
    #[error("unauthorized: wrong or missing admin token")]
    Unauthorized,
    #[error("no item with digest {0}")]
    NotFound(ItemKey),
    #[error("item {digest} is in use ({references} references); it can be evicted once released")]
    Referenced { digest: ItemKey, references: u32 },
    #[error(
        "item {digest} is in use ({references} references) and not stuck; drop it with force, or evict it once released"
    )]
    NotStuck { digest: ItemKey, references: u32 },
}

/// The operators' face of the cache, on its own (loopback TCP) listener. Every call
/// carries the admin token.
#[tarpc::service]
pub trait CacheAdmin {
    async fn stats(token: String) -> Result<CacheStats, AdminError>;
    async fn list(token: String) -> Result<Vec<ItemInfo>, AdminError>;
    /// Evicts the unreferenced item(s) with this digest.
    async fn evict(token: String, digest: ItemKey) -> Result<u64, AdminError>;
    /// Evicts every unreferenced item; returns how many.
    async fn clear(token: String) -> Result<u64, AdminError>;
    /// Drops the item(s) with this digest and every reference to them: stuck items
    /// only, unless `force`. Returns how many.
    async fn drop_item(token: String, digest: ItemKey, force: bool) -> Result<u64, AdminError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A published MD5 collision: two different 128-byte blocks with equal md5.
    pub const COLLISION: [&str; 2] = [
        "d131dd02c5e6eec4693d9a0698aff95c2fcab58712467eab4004583eb8fb7f8955ad340609f4b30283e488832571415a085125e8f7cdc99fd91dbdf280373c5bd8823e3156348f5bae6dacd436c919c6dd53e2b487da03fd02396306d248cda0e99f33420f577ee8ce54b67080a80d1ec69821bcb6a8839396f9652b6ff72a70",
        "d131dd02c5e6eec4693d9a0698aff95c2fcab50712467eab4004583eb8fb7f8955ad340609f4b30283e4888325f1415a085125e8f7cdc99fd91dbd7280373c5bd8823e3156348f5bae6dacd436c919c6dd53e23487da03fd02396306d248cda0e99f33420f577ee8ce54b67080280d1ec69821bcb6a8839396f965ab6ff72a70",
    ];

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn colliding_inputs_share_the_key_but_not_the_confirmation() {
        let (a, b) = (hex(COLLISION[0]), hex(COLLISION[1]));
        assert_ne!(a, b);
        let (da, db) = (ItemDigest::compute(Modality::Image, "fp", &a), ItemDigest::compute(Modality::Image, "fp", &b));
        assert_eq!(da.key, db.key, "the key is md5 of the bytes first: the collision carries over");
        assert_ne!(da.confirm, db.confirm);
        assert_ne!(da.key, ItemDigest::compute(Modality::Audio, "fp", &a).key);
        assert_ne!(da.key, ItemDigest::compute(Modality::Image, "fp2", &a).key);
    }

    #[test]
    fn keys_round_trip_through_hex() {
        let k = ItemDigest::compute(Modality::Image, "x", b"y").key;
        assert_eq!(k.to_string().parse::<ItemKey>().unwrap(), k);
        assert!("xyz".parse::<ItemKey>().is_err());
    }
}
