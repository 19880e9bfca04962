//! How other processes see the cache's arenas. The layout is the cache's business, so
//! the encoder and the engine read and write rows only through this view.
//!
//! Embedding arena: `[slots, layers, hidden]` in the LLM's dtype, row-major; slot `s`
//! starts at byte `s × layers × hidden × dtype size`. Callers speak f32; the view converts
//! (round to nearest even on the way in, exact on the way out). Data arena: raw item
//! bytes at the offsets `alloc` returns.

use half::{bf16, f16};
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

    /// Writes whole rows starting at `slot`.
    pub fn write_rows(&self, slot: u64, rows: &[f32]) -> Result<(), ShmError> {
        let offset = self.slot_offset(slot)?;
        match self.info.dtype {
            ArenaDtype::F32 => self.embed.write_f32(offset, rows),
            ArenaDtype::Bf16 => self.embed.write(offset, &narrow(rows, |v| bf16::from_f32(v).to_bits())),
            ArenaDtype::F16 => self.embed.write(offset, &narrow(rows, |v| f16::from_f32(v).to_bits())),
        }
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
        let offset = self.slot_offset(slot)?;
        let to_f32: fn(u16) -> f32 = match self.info.dtype {
            ArenaDtype::F32 => return self.embed.read_f32(offset, out),
            ArenaDtype::Bf16 => |b| bf16::from_bits(b).to_f32(),
            ArenaDtype::F16 => |b| f16::from_bits(b).to_f32(),
        };
        let mut bytes = vec![0u8; out.len() * 2];
        self.embed.read(offset, &mut bytes)?;
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
            *o = to_f32(u16::from_ne_bytes([b[0], b[1]]));
        }
        Ok(())
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

/// f32 values as 2-byte values in native byte order.
fn narrow(values: &[f32], to_bits: impl Fn(f32) -> u16) -> Vec<u8> {
    values.iter().flat_map(|&v| to_bits(v).to_ne_bytes()).collect()
}
