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
    let text = String::from_utf8_lossy(&seen).to_string();
    let url = text.split("mmserve: serving").nth(1).and_then(|r| r.split(" at http://").nth(1)).unwrap();
    let addr = url.split_whitespace().next().unwrap().to_string();
    // A client streaming a long answer when the engine dies.
    let client = std::thread::spawn(move || {
        use std::io::Write;
        let body = r#"{"messages":[{"role":"user","content":"Tell a long story."}],"max_tokens":480,"ignore_eos":true,"stream":true}"#;
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        write!(s, "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut got = Vec::new();
        let t0 = Instant::now();
        let mut chunk = [0u8; 4096];
        loop {
            match s.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&chunk[..n]),
                Err(e) => panic!("the stream hung after the engine died: {e}"),
            }
            if String::from_utf8_lossy(&got).contains("\"content\"") && t0.elapsed() > Duration::from_secs(60) {
                panic!("still streaming a minute on");
            }
        }
        (String::from_utf8_lossy(&got).to_string(), t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(300));
    let engine = *kids.iter().find(|&&k| cmdline(k).contains(" engine ")).expect("an engine child");
    // SAFETY: killing a process of this test's own tree.
    unsafe { libc::kill(engine as i32, libc::SIGKILL) };
    let (streamed, took) = client.join().unwrap();
    assert!(took < Duration::from_secs(30), "the client waited {took:?}");
    assert!(streamed.starts_with("HTTP/1.1 200"), "{streamed}");

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

/// A `serve` killed with its whole group cannot remove its run directory: the next
/// start does (and leaves a live run's alone).
#[test]
fn run_directories_of_dead_runs_are_swept_at_the_next_start() {
    let mut gone = Command::new("true").spawn().unwrap();
    let dead_pid = gone.id();
    gone.wait().unwrap();
    let tmp = std::env::temp_dir();
    let dead = tmp.join(format!("mmserve-{dead_pid}-0badf00d"));
    let live = tmp.join(format!("mmserve-{}-0badf00d", std::process::id()));
    // A live run in another PID namespace: its pid means nothing here, its lock does.
    let unlocked = tmp.join(format!("mmserve-{}-0badf00e", std::process::id()));
    let locked = tmp.join(format!("mmserve-{dead_pid}-0badf00e"));
    for d in [&dead, &live, &unlocked, &locked] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("engine.sock"), b"").unwrap();
    }
    std::fs::write(unlocked.join("lock"), b"").unwrap();
    let held = std::fs::File::create(locked.join("lock")).unwrap();
    // SAFETY: flock on a file this test owns.
    assert_eq!(unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&held), libc::LOCK_EX) }, 0);
    let server = common::Server::start(&[]);
    assert!(!dead.exists(), "the dead run's directory was swept");
    assert!(!unlocked.exists(), "a run whose lock nobody holds is gone, whatever its pid");
    assert!(live.exists(), "a live process's directory stays");
    assert!(locked.exists(), "a locked run's directory stays, whatever its pid");
    for d in [&live, &locked] {
        std::fs::remove_dir_all(d).unwrap();
    }
    drop(held);
    server.stop();
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
