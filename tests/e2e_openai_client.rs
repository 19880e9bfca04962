//! Python's side: the real `openai` client (`tests/python/client_test.py`) against two
//! servers, one with images and one with audio, both behind an API key; and the
//! Kubernetes manifests of `docs/gateway` against the official schemas. The Python
//! comes from `MMSERVE_TEST_PYTHON`, else `target/pyenv` (made by `tests/python/setup.sh`,
//! which CI runs). Without either the tests say so and pass, unless
//! `MMSERVE_REQUIRE_PYTHON` is set (CI sets it), when they fail.

mod common;

use common::*;
use std::path::PathBuf;

/// The Python with tests/python/requirements.txt, or `None` (said, or a failure where it
/// is required).
fn python() -> Option<PathBuf> {
    let candidate = match std::env::var_os("MMSERVE_TEST_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => repo().join("target/pyenv/bin/python"),
    };
    let ok = std::process::Command::new(&candidate)
        .args(["-c", "import openai, kubernetes_validate, yaml"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let msg =
            "no Python with tests/python/requirements.txt: run tests/python/setup.sh (or set MMSERVE_TEST_PYTHON)";
        assert!(std::env::var_os("MMSERVE_REQUIRE_PYTHON").is_none(), "{msg}");
        eprintln!("SKIPPED: {msg}");
    }
    ok.then_some(candidate)
}

#[test]
fn gateway_manifests_pass_the_kubernetes_schemas() {
    let Some(python) = python() else { return };
    let out = std::process::Command::new(python).arg(repo().join("docs/gateway/validate.py")).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && stdout.contains("valid"), "{stdout}\n{stderr}");
}

#[tokio::test]
async fn the_openai_python_client_parses_everything() {
    let Some(python) = python() else { return };
    let key = "sk-test-key";
    let vision = Server::start(&["--api-key", key]);
    let audio_dir = repo().join("assets/models/qwen2-audio-tiny");
    let audio = Server::start_model(&audio_dir, &["--api-key", key]);
    let (vision_url, audio_url) = (vision.url.clone(), audio.url.clone());
    let script = repo().join("tests/python/client_test.py");
    let png = llava_dir().join("input.png");
    let wav = audio_dir.join("input.wav");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python)
            .arg(script)
            .args([&vision_url, &audio_url, key])
            .arg(png)
            .arg(wav)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "client_test.py failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
    vision.stop();
    audio.stop();
}
