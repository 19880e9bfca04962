//! How other processes see the cache's arenas. The layout is the cache's business, so
//! the encoder and the engine read and write rows only through this view.
//!
//! Embedding arena: `[slots, layers, hidden]` f32, row-major; slot `s` starts at byte
//! `s × layers × hidden × 4`. Data arena: raw item bytes at the offsets `alloc` returns.

use mmserve_protocol::ArenaInfo;
use mmserve_shm::{Segment, ShmError};

pub struct ArenaView {
    pub info: ArenaInfo,
    embed: Segment,
    data: Segment,
}

impl ArenaView {
    pub fn open(info: &ArenaInfo) -> Result<Self, ShmError> {
        if info.dtype != "float32" {
            return Err(ShmError::BadName(format!("arena dtype {} (only float32 is supported)", info.dtype)));
        }
        let embed = Segment::open(&info.embed_segment, info.slots as usize * info.slot_bytes())?;
        let data = Segment::open(&info.data_segment, info.data_bytes as usize)?;
        Ok(ArenaView { info: info.clone(), embed, data })
    }

    /// Values in one slot.
    pub fn row_len(&self) -> usize {
        self.info.layers as usize * self.info.hidden as usize
    }

    /// Writes whole rows starting at `slot`.
    pub fn write_rows(&self, slot: u64, rows: &[f32]) -> Result<(), ShmError> {
        self.embed.write_f32(self.slot_offset(slot)?, rows)
    }

    fn slot_offset(&self, slot: u64) -> Result<usize, ShmError> {
        (slot as usize).checked_mul(self.info.slot_bytes()).ok_or_else(|| ShmError::Size {
            name: self.info.embed_segment.clone(),
            expected: usize::MAX,
            actual: self.embed.len(),
        })
    }

    /// Reads whole rows starting at `slot` into `out`.
    pub fn read_rows(&self, slot: u64, out: &mut [f32]) -> Result<(), ShmError> {
        self.embed.read_f32(self.slot_offset(slot)?, out)
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
