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

/// SIGTERM while the children are still starting: serve stops the started ones and the
/// one being started, exits 0, and leaves no process or segment behind.
#[test]
fn sigterm_during_start_up_stops_what_has_started() {
    use std::io::BufRead;
    let mut serve = Command::new(env!("CARGO_BIN_EXE_mmserve"))
        .args(["serve", "--port", "0", "--model"])
        .arg(llava_dir())
        .env("MMSERVE_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = serve.id();
    let mut lines = std::io::BufReader::new(serve.stderr.take().unwrap()).lines();
    // The cache is up; the encoder and the engine are loading (or just done).
    lines.by_ref().map_while(Result::ok).find(|l| l.contains("embed-cache ready")).expect("the cache started");
    let started = children(pid);
    assert!(!started.is_empty());
    // SAFETY: signalling our own child.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    std::thread::spawn(move || lines.map_while(Result::ok).for_each(drop));
    let status = common::exit_status(serve, Duration::from_secs(60), "serve did not stop");
    assert!(status.success(), "serve exited with {status}");
    for child in started {
        assert!(!cmdline(child).contains("mmserve"), "child {child} outlived serve: {}", cmdline(child));
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

/// Requests in flight with distinct images (the encoder busy) and long answers (the
/// engine busy) when one child is SIGKILLed: every client gets an answer, a completion or
/// a 503, within its timeout; `serve` names the child, exits non-zero and leaves no
/// shared memory.
async fn kill_under_load(victim: &str) {
    let mut serve = tokio::process::Command::new(env!("CARGO_BIN_EXE_mmserve"))
        .args(["serve", "--port", "0", "--model"])
        .arg(llava_dir())
        .env("MMSERVE_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let pid = serve.id().unwrap();
    let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(serve.stdout.take().unwrap()));
    let url = tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(rest) = line.strip_prefix("mmserve: serving") {
                return rest.split(" at ").nth(1).unwrap().trim().to_string();
            }
        }
        panic!("serve exited before it was ready");
    })
    .await
    .expect("serve did not start");
    let png = common::fixture_png();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    // Clients arrive every 15 ms; the child dies at 150 ms: requests are caught while
    // their media are checked, reserved, encoded, and while they generate.
    let t0 = Instant::now();
    let mut clients = Vec::new();
    let mut killed = None;
    for i in 0..24u8 {
        if killed.is_none() && t0.elapsed() >= Duration::from_millis(150) {
            let child = *children(pid).iter().find(|&&k| cmdline(k).contains(&format!(" {victim} "))).expect("child");
            // SAFETY: killing a process of this test's own tree.
            unsafe { libc::kill(child as i32, libc::SIGKILL) };
            killed = Some(t0.elapsed());
        }
        let mut img = image::load_from_memory(&png).unwrap().to_rgb8();
        img.get_pixel_mut(1, 1).0 = [i, 99, 7];
        let mut bytes = Vec::new();
        img.write_to(&mut std::io::Cursor::new(&mut bytes), image::ImageFormat::Png).unwrap();
        let mut req = common::image_request(&common::data_url(&bytes), false);
        req["max_tokens"] = serde_json::json!(48);
        let (http, url) = (http.clone(), url.clone());
        let sent = t0.elapsed();
        clients.push((
            sent,
            tokio::spawn(async move {
                let r = http.post(format!("{url}/v1/chat/completions")).json(&req).send().await;
                r.map(|r| r.status().as_u16())
            }),
        ));
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    let killed = killed.expect("the child was killed");
    let mut seen = std::collections::BTreeMap::new();
    for (sent, c) in clients {
        let status = tokio::time::timeout(Duration::from_secs(60), c).await.expect("a client hung").unwrap();
        let key = status.as_ref().map_or_else(|e| format!("{e}").chars().take(40).collect(), |s| s.to_string());
        *seen.entry(key).or_insert(0) += 1;
        // Sent well before the kill: in flight, it gets an answer. (One sent just before
        // may not have been read when the api stops listening: it sees the connection close.)
        if sent + Duration::from_millis(100) < killed {
            assert!(matches!(status, Ok(200 | 503)), "{victim} killed: a client in flight got {status:?}");
        }
    }
    eprintln!("{victim} killed at {killed:?}: {seen:?}");
    let status = tokio::time::timeout(Duration::from_secs(30), serve.wait()).await.expect("serve stopped").unwrap();
    assert!(!status.success(), "serve must exit non-zero when the {victim} dies");
    let mut err = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut serve.stderr.take().unwrap(), &mut err).await.unwrap();
    assert!(err.contains(&format!("the {victim} process exited unexpectedly")), "stderr: {err}");
    let left = mmserve_shm::list_with_prefix(&format!("mmserve-{pid}-"));
    assert!(left.is_empty(), "shared memory left: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_encoder_under_load_answers_every_client() {
    kill_under_load("encoder").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engine_under_load_answers_every_client() {
    kill_under_load("engine").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_embed_cache_under_load_answers_every_client() {
    kill_under_load("embed-cache").await;
}
