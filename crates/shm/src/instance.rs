//! Telling live instances from dead ones: each holds `flock(LOCK_EX)` on
//! `/dev/shm/<prefix>.owner` while it lives; the kernel drops the lock when the process
//! dies, however it dies.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::{SHM_DIR, ShmError};

/// Held for the life of an instance; unlinks the owner file on drop.
pub struct InstanceLock {
    file: File,
    path: PathBuf,
}

/// Whether `path` still names the very file `file` has open (not a replacement).
fn same_file(file: &File, path: &Path) -> bool {
    match (file.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
        _ => false,
    }
}

fn try_lock(file: &File) -> bool {
    // SAFETY: flock on a file descriptor we own; no memory is shared with the kernel.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

impl InstanceLock {
    /// Claims `prefix`. The owner file is created and locked under a temporary name and
    /// then renamed, so no other process can ever see it unlocked.
    pub fn acquire(prefix: &str) -> Result<InstanceLock, ShmError> {
        crate::check_name(prefix)?;
        // A dot would make the sweep read a different prefix from our segment names.
        if prefix.contains('.') {
            return Err(ShmError::BadName(prefix.to_string()));
        }
        let path = Path::new(SHM_DIR).join(format!("{prefix}.owner"));
        // Hold the old owner file's lock (if any) until ours replaces it, so no sweeper
        // can take the prefix for dead in between.
        let _old = match File::open(&path) {
            Ok(existing) if !try_lock(&existing) => return Err(ShmError::InUse(prefix.to_string())),
            Ok(existing) => Some(existing),
            Err(_) => None,
        };
        let tmp = Path::new(SHM_DIR).join(format!("{prefix}.owner-{}", std::process::id()));
        let io = |e: std::io::Error| ShmError::Owner { prefix: prefix.to_string(), source: e };
        let file = OpenOptions::new().write(true).create(true).truncate(true).open(&tmp).map_err(io)?;
        if !try_lock(&file) {
            let _ = std::fs::remove_file(&tmp);
            return Err(ShmError::InUse(prefix.to_string()));
        }
        std::fs::rename(&tmp, &path).map_err(io)?;
        Ok(InstanceLock { file, path })
    }
}

impl Drop for InstanceLock {
    fn drop(&mut self) {
        if same_file(&self.file, &self.path) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Removes every `mmserve-*.…` segment whose instance is dead (its owner file is
/// missing or unlocked); live instances are left alone. Returns how many files went.
pub fn sweep_dead_instances() -> usize {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else { return 0 };
    let names: Vec<String> = dir.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    let prefixes: BTreeSet<&str> =
        names.iter().filter(|n| n.starts_with("mmserve-")).filter_map(|n| n.split_once('.').map(|(p, _)| p)).collect();
    let mut removed = 0;
    for prefix in prefixes {
        let owner = Path::new(SHM_DIR).join(format!("{prefix}.owner"));
        // Keep the lock (if we get it) while removing, so nobody claims the prefix meanwhile.
        let lock = match File::open(&owner) {
            // Locked, and still the file the name points to (not replaced by a new
            // instance between our open and our lock): dead.
            Ok(f) if try_lock(&f) && same_file(&f, &owner) => Some(f),
            Ok(_) => continue, // alive, or just claimed
            Err(_) => None,
        };
        for n in names.iter().filter(|n| n.strip_prefix(prefix).is_some_and(|r| r.starts_with('.'))) {
            if n.contains(".owner-") {
                continue; // another process is creating this prefix's owner file right now
            }
            if std::fs::remove_file(Path::new(SHM_DIR).join(n)).is_ok() {
                removed += 1;
            }
        }
        drop(lock);
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Segment, list_with_prefix};

    #[test]
    fn dead_instances_are_swept_and_live_ones_kept() {
        let live = format!("mmserve-test-live-{}", std::process::id());
        let dead = format!("mmserve-test-dead-{}", std::process::id());
        let _lock = InstanceLock::acquire(&live).unwrap();
        assert!(matches!(InstanceLock::acquire(&live), Err(ShmError::InUse(_))), "one owner at a time");
        let keep = Segment::create(&format!("{live}.arena"), 64).unwrap();
        // A dead instance: its owner file exists but nobody holds the lock, and its
        // segments were never unlinked (as after SIGKILL).
        std::fs::write(Path::new(SHM_DIR).join(format!("{dead}.owner")), b"").unwrap();
        std::mem::forget(Segment::create(&format!("{dead}.arena"), 64).unwrap());
        std::mem::forget(Segment::create(&format!("{dead}.data"), 64).unwrap());

        assert!(sweep_dead_instances() >= 3);
        assert!(list_with_prefix(&format!("{dead}.")).is_empty(), "dead instance swept");
        assert_eq!(list_with_prefix(&format!("{live}.")).len(), 2, "live instance kept");
        drop(keep);
    }
}
