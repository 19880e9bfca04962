//! How other processes see the cache's arenas. The layout is the cache's business: the
//! api reads and writes item bytes through this view, and the encoder and the engine
//! get the embedding rows from it as one dense region ([`ArenaView::embed_rows`]) that
//! they register with their device (`mmserve_models::ArenaRows`, which converts between
//! the arena's dtype and the model's).
//!
//! Embedding arena: `[slots, layers, hidden]` in the LLM's dtype, row-major; slot `s`
//! starts at byte `s × layers × hidden × dtype size`. Data arena: raw item bytes at the
//! offsets `alloc` returns.

use mmserve_protocol::{ArenaDtype, ArenaInfo};
use mmserve_shm::{Segment, ShmError};

pub struct ArenaView {
    pub info: ArenaInfo,
    embed: Segment,
    data: Segment,
}

/// See [`ArenaView::embed_rows`]; valid while its view lives.
#[derive(Debug, Clone, Copy)]
pub struct EmbedRows {
    pub ptr: *mut u8,
    pub slots: usize,
    pub row_len: usize,
    pub dtype: ArenaDtype,
}

impl ArenaView {
    pub fn open(info: &ArenaInfo) -> Result<Self, ShmError> {
        let embed = Segment::open(&info.embed_segment, info.slots as usize * info.slot_bytes())?;
        let data = Segment::open(&info.data_segment, info.data_bytes as usize)?;
        Ok(ArenaView { info: info.clone(), embed, data })
    }

    /// Values in one slot.
    pub fn row_len(&self) -> usize {
        self.info.layers as usize * self.info.hidden as usize
    }

    /// The embeddings as one dense region, `[slots, row_len]` of `info.dtype`, for a
    /// model process to register with its device (the only layout it may assume).
    pub fn embed_rows(&self) -> EmbedRows {
        EmbedRows {
            ptr: self.embed.as_ptr(),
            slots: self.info.slots as usize,
            row_len: self.row_len(),
            dtype: self.info.dtype,
        }
    }

    /// An item's raw bytes.
    pub fn read_data(&self, offset: u64, len: u64) -> Result<Vec<u8>, ShmError> {
        // Check the range before allocating for it.
        if offset.checked_add(len).is_none_or(|end| end > self.info.data_bytes) {
            return Err(ShmError::Size {
                name: self.info.data_segment.clone(),
                expected: usize::MAX,
                actual: self.data.len(),
            });
        }
        let mut out = vec![0u8; len as usize];
        self.data.read(offset as usize, &mut out)?;
        Ok(out)
    }

    /// Writes an item's raw bytes (the api, for items it created).
    pub fn write_data(&self, offset: u64, bytes: &[u8]) -> Result<(), ShmError> {
        self.data.write(offset as usize, bytes)
    }
}
