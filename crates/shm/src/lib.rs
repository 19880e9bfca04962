//! Named POSIX shared-memory segments (over the `shared_memory` crate).
//!
//! Every segment of one cache instance is named `<prefix>.<what>`, with a prefix unique
//! to the instance. The instance holds an exclusive `flock` on `<prefix>.owner` for its
//! whole life ([`InstanceLock`]), so a later start can tell a dead instance's leftovers
//! from a live one's and remove only those ([`sweep_dead_instances`]).
//! The process that creates a segment owns it and unlinks it when the [`Segment`] drops;
//! others open it without owning it.

mod instance;

pub use instance::{InstanceLock, sweep_dead_instances};

use std::path::Path;

use shared_memory::{Shmem, ShmemConf, ShmemError};

#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("creating shared memory {name} ({size} bytes): {source}")]
    Create { name: String, size: usize, source: ShmemError },
    #[error("opening shared memory {name}: {source}")]
    Open { name: String, source: ShmemError },
    #[error("shared memory {name} has {actual} bytes, {expected} expected")]
    Size { name: String, expected: usize, actual: usize },
    #[error("shared memory name {0:?} is not a plain name")]
    BadName(String),
    #[error("shared-memory prefix {0} belongs to a running instance")]
    InUse(String),
    #[error("owner file of {prefix}: {source}")]
    Owner { prefix: String, source: std::io::Error },
}

/// A mapped shared-memory segment.
pub struct Segment {
    shmem: Shmem,
    name: String,
    len: usize,
}

// SAFETY: `Shmem` holds a raw pointer to a mapping that stays valid until it is dropped;
// nothing in it is tied to the creating thread. Concurrent access to the bytes is governed
// by the protocol between processes (a writer finishes before it announces the data ready).
unsafe impl Send for Segment {}
// SAFETY: as above; `&Segment` only hands out raw pointers and copies.
unsafe impl Sync for Segment {}

impl Segment {
    /// Creates and maps a new segment of `size` bytes (zero-filled), owned by this process.
    /// Fails if the name is taken.
    pub fn create(name: &str, size: usize) -> Result<Segment, ShmError> {
        check_name(name)?;
        // A zero-length mapping is invalid; keep one byte so empty items still work.
        let map_size = size.max(1);
        let shmem = ShmemConf::new().os_id(name).size(map_size).create().map_err(|source| ShmError::Create {
            name: name.into(),
            size,
            source,
        })?;
        Ok(Segment { shmem, name: name.into(), len: size })
    }

    /// Maps an existing segment without owning it; checks it holds at least `min_len` bytes.
    pub fn open(name: &str, min_len: usize) -> Result<Segment, ShmError> {
        check_name(name)?;
        let mut shmem =
            ShmemConf::new().os_id(name).open().map_err(|source| ShmError::Open { name: name.into(), source })?;
        shmem.set_owner(false);
        let len = shmem.len();
        if len < min_len {
            return Err(ShmError::Size { name: name.into(), expected: min_len, actual: len });
        }
        Ok(Segment { shmem, name: name.into(), len })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The mapping's first byte, for callers that hand the region to a device (pinned
    /// host memory); reading or writing through it is theirs to make sound.
    pub fn as_ptr(&self) -> *mut u8 {
        self.shmem.as_ptr()
    }

    /// Copies `src` into the segment at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), ShmError> {
        self.check_range(offset, src.len())?;
        // SAFETY: the range is inside the mapping (checked above); `src` is ordinary
        // process memory and cannot overlap a shared mapping of ours.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.shmem.as_ptr().add(offset), src.len());
        }
        Ok(())
    }

    /// Copies `dst.len()` bytes from the segment at `offset`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), ShmError> {
        self.check_range(offset, dst.len())?;
        // SAFETY: as in `write`, with the roles swapped.
        unsafe {
            std::ptr::copy_nonoverlapping(self.shmem.as_ptr().add(offset), dst.as_mut_ptr(), dst.len());
        }
        Ok(())
    }

    /// Writes f32 values at byte `offset` (native endianness: all processes share a host).
    pub fn write_f32(&self, offset: usize, values: &[f32]) -> Result<(), ShmError> {
        // SAFETY: any f32 slice is a valid byte slice of 4× its length.
        let bytes = unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), values.len() * 4) };
        self.write(offset, bytes)
    }

    /// Reads f32 values at byte `offset`.
    pub fn read_f32(&self, offset: usize, values: &mut [f32]) -> Result<(), ShmError> {
        // SAFETY: every byte pattern is a valid f32, so the slice may be filled bytewise.
        let bytes = unsafe { std::slice::from_raw_parts_mut(values.as_mut_ptr().cast::<u8>(), values.len() * 4) };
        self.read(offset, bytes)
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<(), ShmError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => {
                Err(ShmError::Size { name: self.name.clone(), expected: offset.saturating_add(len), actual: self.len })
            }
        }
    }
}

pub(crate) fn check_name(name: &str) -> Result<(), ShmError> {
    let ok = !name.is_empty()
        && name.len() < 200
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
    if ok { Ok(()) } else { Err(ShmError::BadName(name.into())) }
}

/// Where Linux shows POSIX shared memory.
pub const SHM_DIR: &str = "/dev/shm";

/// Names of the segments in `/dev/shm` that start with `prefix`.
pub fn list_with_prefix(prefix: &str) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(Path::new(SHM_DIR)) else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

/// Unlinks every segment whose name starts with `prefix` (what a killed process left);
/// returns how many it removed.
pub fn remove_with_prefix(prefix: &str) -> usize {
    if prefix.len() < 8 {
        // Refuse sweeping prefixes that could match other programs' segments.
        return 0;
    }
    list_with_prefix(prefix).into_iter().filter(|n| std::fs::remove_file(Path::new(SHM_DIR).join(n)).is_ok()).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_open_read_write_and_unlink_on_drop() {
        let name = format!("mmserve-test-{}-seg", std::process::id());
        let owner = Segment::create(&name, 64).unwrap();
        owner.write_f32(8, &[1.5, -2.0]).unwrap();
        let other = Segment::open(&name, 16).unwrap();
        let mut v = [0f32; 2];
        other.read_f32(8, &mut v).unwrap();
        assert_eq!(v, [1.5, -2.0]);
        assert!(other.write(60, &[0; 8]).is_err(), "writes past the end are refused");
        assert!(Segment::create(&name, 64).is_err(), "names are exclusive");
        drop(other);
        assert_eq!(list_with_prefix(&name), vec![name.clone()]);
        drop(owner);
        assert!(list_with_prefix(&name).is_empty(), "the owner unlinks on drop");
    }

    #[test]
    fn sweep_removes_leftovers() {
        let prefix = format!("mmserve-test-{}-sweep", std::process::id());
        let seg = Segment::create(&format!("{prefix}-a"), 8).unwrap();
        std::mem::forget(seg); // as if the owner had been killed
        assert_eq!(remove_with_prefix(&prefix), 1);
        assert!(list_with_prefix(&prefix).is_empty());
    }

    #[test]
    fn bad_names_are_refused() {
        assert!(Segment::create("../etc/passwd", 8).is_err());
        assert!(Segment::create("", 8).is_err());
    }
}
