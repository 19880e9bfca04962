//! `mmserve serve` as a supervisor: a child that dies is named, and nothing is left behind.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::llava_dir;

fn children(pid: u32) -> Vec<u32> {
    let path = format!("/proc/{pid}/task/{pid}/children");
    std::fs::read_to_string(path).unwrap_or_default().split_whitespace().map(|p| p.parse().unwrap()).collect()
}

fn cmdline(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap_or_default().replace('\0', " ")
}

#[test]
fn a_dead_child_is_named_and_serve_exits_non_zero_leaving_nothing() {
    let mut serve = Command::new(env!("CARGO_BIN_EXE_mmserve"))
        .args(["serve", "--port", "0", "--model"])
        .arg(llava_dir())
        .env("MMSERVE_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = serve.id();
    let mut stdout = serve.stdout.take().unwrap();
    // Wait for the URL line: then all four children run.
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&seen).contains("mmserve: serving") {
        assert!(Instant::now() < deadline, "serve did not start");
        let n = stdout.read(&mut buf).unwrap();
        assert!(n > 0, "serve exited early");
        seen.extend_from_slice(&buf[..n]);
    }
    let kids = children(pid);
    assert_eq!(kids.len(), 4, "{kids:?}");
    let engine = *kids.iter().find(|&&k| cmdline(k).contains(" engine ")).expect("an engine child");
    // SAFETY: killing a process of this test's own tree.
    unsafe { libc::kill(engine as i32, libc::SIGKILL) };

    let status = serve.wait().unwrap();
    assert!(!status.success(), "serve must exit non-zero when a child dies");
    let mut err = String::new();
    serve.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(err.contains("the engine process exited unexpectedly"), "stderr: {err}");
    for k in kids {
        assert!(
            !std::path::Path::new(&format!("/proc/{k}")).exists() || cmdline(k).is_empty(),
            "child {k} left running"
        );
    }
    let left = mmserve_shm::list_with_prefix(&format!("mmserve-{pid}-"));
    assert!(left.is_empty(), "shared memory left: {left:?}");
}

#[test]
fn a_config_dtype_the_arena_cannot_hold_is_refused_before_any_child_starts() {
    let dir = common::cache::temp_dir("bad-dtype");
    for entry in std::fs::read_dir(llava_dir()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap();
        if name != "config.json" {
            std::os::unix::fs::symlink(&path, dir.join(name)).unwrap();
        }
    }
    let config = std::fs::read_to_string(llava_dir().join("config.json")).unwrap();
    std::fs::write(dir.join("config.json"), config.replace("\"float32\"", "\"int8\"")).unwrap();

    let child = Command::new(env!("CARGO_BIN_EXE_mmserve"))
        .args(["serve", "--port", "0", "--model"])
        .arg(&dir)
        .env("MMSERVE_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    let out = rx.recv_timeout(Duration::from_secs(60)).expect("serve did not exit").unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("config.json") && err.contains("\"int8\""), "stderr: {err}");
}
