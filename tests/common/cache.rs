//! A real `mmserve embed-cache` process for tests.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use mmserve_protocol::{EmbedCacheClient, transport};

pub struct CacheProc {
    pub child: Child,
    pub socket: PathBuf,
    pub prefix: String,
    /// The admin listener's address, when started with a token.
    pub admin: String,
}

/// A fresh directory under the temp dir, removed with everything in it when dropped.
pub struct TestDir(PathBuf);

impl std::ops::Deref for TestDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for TestDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh directory for sockets and files, named after the test and this process.
pub fn temp_dir(name: &str) -> TestDir {
    let d = std::env::temp_dir().join(format!("mmserve-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    TestDir(d)
}

impl CacheProc {
    /// Starts a cache of `slots` slots of 4 values, `items` items, 1 MiB of data.
    pub fn start(socket: &Path, prefix: &str, slots: u64, items: u64, token: Option<&str>) -> CacheProc {
        Self::start_with(socket, prefix, slots, items, token, &[])
    }

    /// As [`start`](Self::start), with more flags.
    pub fn start_with(
        socket: &Path,
        prefix: &str,
        slots: u64,
        items: u64,
        token: Option<&str>,
        extra: &[&str],
    ) -> CacheProc {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_mmserve"));
        cmd.args(["embed-cache", "--socket"])
            .arg(socket)
            .args(["--shm-prefix", prefix, "--embed-dim", "4"])
            .args(["--embed-cache-size", &(slots * 16).to_string()])
            .args(["--embed-cache-items", &items.to_string()])
            .args(["--embed-cache-data-size", "1MiB", "--embed-cache-request-share", "1"])
            .args(["--admin-addr", "127.0.0.1:0"])
            .args(extra)
            .env("MMSERVE_LOG", "warn")
            .env_remove("MMSERVE_ADMIN_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(t) = token {
            cmd.env("MMSERVE_ADMIN_TOKEN", t);
        }
        let mut child = cmd.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix("mmserve-ready embed-cache") {
                    let _ = tx.send(rest.trim().to_string());
                }
            }
        });
        let admin = rx.recv_timeout(Duration::from_secs(30)).expect("embed-cache did not start");
        CacheProc { child, socket: socket.to_path_buf(), prefix: prefix.to_string(), admin }
    }

    /// Wraps a cache process started by the caller, waiting for its readiness line.
    pub fn adopt(mut child: Child, socket: &Path, prefix: &str) -> CacheProc {
        let stdout = child.stdout.take().expect("stdout piped");
        let mut lines = BufReader::new(stdout).lines();
        let admin = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(rest) = line.strip_prefix("mmserve-ready embed-cache") {
                        break rest.trim().to_string();
                    }
                }
                _ => panic!("embed-cache exited before it was ready"),
            }
        };
        // Keep draining its stdout so it never writes into a closed pipe.
        std::thread::spawn(move || lines.for_each(drop));
        CacheProc { child, socket: socket.to_path_buf(), prefix: prefix.to_string(), admin }
    }

    /// A new client connection (a new owner of references).
    pub async fn client(&self) -> EmbedCacheClient {
        let t = transport::connect(&self.socket, Duration::from_secs(5)).await.unwrap();
        EmbedCacheClient::new(Default::default(), t).spawn()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait: a clean stop.
    pub fn stop(mut self) {
        self.stop_in_place();
    }

    /// As [`stop`](Self::stop), through a mutable reference.
    pub fn stop_in_place(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let status = self.child.wait().unwrap();
        assert!(status.success(), "embed-cache exited with {status}");
        let left = mmserve_shm::list_with_prefix(&format!("{}.", self.prefix));
        assert!(left.is_empty(), "segments left after a clean stop: {left:?}");
    }
}

impl Drop for CacheProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}
