//! `file://` reads that no path trick can lead out of the allowed directory.
//!
//! The file is opened once, relative to a descriptor of the root: with `openat2`'s
//! `RESOLVE_BENEATH` (no `..`, absolute or symlinked step may leave the root, checked by
//! the kernel during this very lookup, so a symlink swapped in meanwhile cannot escape; magic
//! links of `/proc` are refused too), or, on kernels without `openat2` (before 5.6, or behind
//! a seccomp filter that refuses it), one `openat` per component that follows no symlink at
//! all. What is checked afterwards (a regular file, its size) is the opened descriptor, not
//! the path, and reading stops at one byte past the cap. Opening is non-blocking, so a FIFO
//! cannot stall the open; it is then refused as not a regular file.

use std::ffi::{CString, OsStr};
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use crate::error::ApiError;

/// How media files are opened: read-only, not inherited by children, never blocking
/// (a FIFO), never becoming our controlling terminal (a tty).
const FILE_FLAGS: libc::c_int = libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_NOCTTY;

/// Why a local file was not read.
#[derive(Debug)]
pub(super) enum LocalError {
    /// Outside the root, or reached through a link that is not followed.
    Outside,
    NotFound,
    /// Not a regular file: what it is.
    NotRegular(&'static str),
    TooLarge,
    Io(io::Error),
}

impl LocalError {
    pub(super) fn into_api(self, param: &str, max: usize) -> ApiError {
        match self {
            LocalError::Outside => super::bad(
                param,
                "the file is outside the allowed local media path, or reached through a symbolic link \
                 this server does not follow",
            ),
            LocalError::NotFound => super::bad(param, "no such file under the allowed local media path"),
            LocalError::NotRegular(what) => super::bad(param, format!("the path is {what}, not a regular file")),
            LocalError::TooLarge => super::too_large(param, max),
            LocalError::Io(e) => super::bad(param, format!("reading the file: {e}")),
        }
    }
}

impl From<io::Error> for LocalError {
    fn from(e: io::Error) -> Self {
        match e.raw_os_error() {
            // EXDEV: `RESOLVE_BENEATH` refused an escape; ELOOP: a symlink not followed
            // (`O_NOFOLLOW`, a magic link) or a loop.
            Some(libc::EXDEV | libc::ELOOP) => LocalError::Outside,
            Some(libc::ENOENT | libc::ENOTDIR) => LocalError::NotFound,
            // Opening a socket, or a device without a driver.
            Some(libc::ENXIO) => LocalError::NotRegular("a socket or a device"),
            _ => LocalError::Io(e),
        }
    }
}

/// `path` relative to `root`, when it lies beneath it by its plain components (no `..`).
/// `.` for the root itself.
pub(super) fn relative_beneath(path: &Path, root: &Path) -> Option<PathBuf> {
    let rel = path.strip_prefix(root).ok()?;
    if !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return None;
    }
    Some(if rel.as_os_str().is_empty() { PathBuf::from(".") } else { rel.to_path_buf() })
}

/// The bytes of `rel` beneath `root`, at most `max`.
pub(super) fn read_beneath(root: &Path, rel: &Path, max: usize) -> Result<Vec<u8>, LocalError> {
    // `O_PATH`: the root needs no read permission, only search, as for a path lookup.
    let dir = OpenOptions::new().read(true).custom_flags(libc::O_PATH | libc::O_DIRECTORY).open(root)?;
    let file = File::from(open_beneath(dir.as_fd(), rel)?);
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(LocalError::NotRegular(kind(&meta.file_type())));
    }
    if meta.len() > max as u64 {
        return Err(LocalError::TooLarge);
    }
    read_capped(file, max, meta.len())
}

fn kind(t: &std::fs::FileType) -> &'static str {
    match () {
        _ if t.is_dir() => "a directory",
        _ if t.is_fifo() => "a FIFO (named pipe)",
        _ if t.is_char_device() => "a character device",
        _ if t.is_block_device() => "a block device",
        _ if t.is_socket() => "a socket",
        _ => "not a regular file",
    }
}

/// Reads to the end, refusing as soon as more than `max` bytes came (the file may have
/// grown since it was measured at `size`).
pub(super) fn read_capped(file: File, max: usize, size: u64) -> Result<Vec<u8>, LocalError> {
    let mut bytes = Vec::with_capacity(size.min(max as u64) as usize + 1);
    file.take(max as u64 + 1).read_to_end(&mut bytes)?;
    if bytes.len() > max {
        return Err(LocalError::TooLarge);
    }
    Ok(bytes)
}

pub(super) fn open_beneath(dir: BorrowedFd<'_>, rel: &Path) -> io::Result<OwnedFd> {
    match openat2_beneath(dir, rel) {
        // No openat2 (ENOSYS), or a seccomp filter of an older container runtime that
        // answers EPERM for syscalls it does not know: the stricter walk.
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOSYS | libc::EPERM)) => walk_nofollow(dir, rel),
        r => r,
    }
}

fn c_path(p: &OsStr) -> io::Result<CString> {
    CString::new(p.as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// `openat2` with `RESOLVE_BENEATH`; retried a few times on EAGAIN, which the kernel
/// answers when a rename raced a `..` step (in a symlink's target) and it could not
/// prove the step stayed beneath.
fn openat2_beneath(dir: BorrowedFd<'_>, rel: &Path) -> io::Result<OwnedFd> {
    let mut tries = 0;
    loop {
        match openat2_once(dir, rel) {
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) && tries < 3 => tries += 1,
            r => return r,
        }
    }
}

fn openat2_once(dir: BorrowedFd<'_>, rel: &Path) -> io::Result<OwnedFd> {
    let path = c_path(rel.as_os_str())?;
    // SAFETY: `open_how` is plain integers, for which all zeroes is valid (and means
    // "no flags"); libc marks it non-exhaustive, so it cannot be built by a literal.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = FILE_FLAGS as u64;
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: `path` is NUL-terminated and `how` is a valid `open_how` of the size passed;
    // both outlive the call, which only reads them. `dir` is an open descriptor.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            path.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    owned(fd as libc::c_int)
}

/// The fallback: one component at a time, each opened without following a symlink
/// (`O_NOFOLLOW`) and checked to be a directory before the next is looked up in it.
pub(super) fn walk_nofollow(dir: BorrowedFd<'_>, rel: &Path) -> io::Result<OwnedFd> {
    let mut names = Vec::new();
    for c in rel.components() {
        match c {
            Component::Normal(name) => names.push(name),
            Component::CurDir => {}
            // `..` or an absolute path could leave the root.
            _ => return Err(io::Error::from_raw_os_error(libc::EXDEV)),
        }
    }
    let (last, parents) = names.split_last().map_or((OsStr::new("."), &[][..]), |(l, p)| (*l, p));
    let mut at: Option<OwnedFd> = None;
    for name in parents {
        let next = File::from(openat(at.as_ref().map_or(dir, |f| f.as_fd()), name, libc::O_PATH | libc::O_NOFOLLOW)?);
        let t = next.metadata()?.file_type();
        if t.is_symlink() {
            return Err(io::Error::from_raw_os_error(libc::ELOOP));
        }
        if !t.is_dir() {
            return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
        }
        at = Some(next.into());
    }
    openat(at.as_ref().map_or(dir, |f| f.as_fd()), last, FILE_FLAGS | libc::O_NOFOLLOW)
}

fn openat(dir: BorrowedFd<'_>, name: &OsStr, flags: libc::c_int) -> io::Result<OwnedFd> {
    let name = c_path(name)?;
    // SAFETY: `name` is NUL-terminated and outlives the call; `dir` is an open descriptor;
    // no `O_CREAT`, so no mode argument is read.
    owned(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC) })
}

fn owned(fd: libc::c_int) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just returned to us, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
