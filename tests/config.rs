//! One configuration: `serve` resolves flags, variables and a `--config` file into a
//! section per service, prints it with `--print-config`, refuses what no service has,
//! and every child runs with its section whole.

mod common;

use std::process::{Command, Output};

use common::Server;
use common::cache::temp_dir;

fn mmserve(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mmserve"));
    cmd.args(args).env("MMSERVE_LOG", "warn");
    // The test's own environment must not leak settings in.
    for (key, _) in std::env::vars() {
        if key.starts_with("MMSERVE_") {
            cmd.env_remove(key);
        }
    }
    cmd.envs(env.iter().copied()).output().expect("running mmserve")
}

/// `key = value` of `[section]` in a printed configuration.
fn setting(printed: &str, section: &str, key: &str) -> Option<String> {
    let body = printed.split(&format!("[{section}]\n")).nth(1)?;
    let body = body.split("\n[").next()?;
    body.lines().find_map(|l| l.strip_prefix(&format!("{key} = ")).map(str::to_string))
}

#[test]
fn flags_beat_variables_beat_the_service_section_beat_serve_section_beat_defaults() {
    let dir = temp_dir("config-precedence");
    let file = dir.join("mmserve.toml");
    std::fs::write(
        &file,
        r#"
[serve]
max-batch = 8
device = "cpu"
kv_cache_memory = "1G"
ready_timeout_s = 60

[encoder]
max_batch = 4
encoder_timeout_ms = 5000

[engine]
block_size = 32

[api]
allowed_media_domains = ["a.example", "*.b.example"]
max_body_bytes = "2MiB"
token_timeout_s = 7
"#,
    )
    .unwrap();
    let out = mmserve(
        &["serve", "--config", file.to_str().unwrap(), "--print-config", "--block-size", "64"],
        &[("MMSERVE_TOKEN_TIMEOUT_S", "9"), ("MMSERVE_MAX_ITEM_BYTES", "1M"), ("MMSERVE_MAX_AUDIO_SECONDS", "1.5e-1")],
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8(out.stdout).unwrap();
    let s =
        |section, key| setting(&printed, section, key).unwrap_or_else(|| panic!("no [{section}] {key}:\n{printed}"));
    assert_eq!(s("encoder", "max_batch"), "4", "the service's section beats [serve]");
    assert_eq!(s("encoder", "encoder_timeout_ms"), "5000");
    assert_eq!(s("encoder", "device"), "\"cpu\"", "[serve] sets every service that has the setting");
    assert_eq!(s("engine", "device"), "\"cpu\"");
    assert_eq!(s("engine", "kv_cache_memory"), "\"1G\"");
    assert_eq!(s("engine", "block_size"), "64", "a flag beats the file");
    assert_eq!(s("api", "token_timeout_s"), "9", "a variable beats the file");
    assert_eq!(s("api", "max_item_bytes"), "\"1M\"", "sizes take the same forms everywhere");
    assert_eq!(s("api", "max_body_bytes"), "\"2MiB\"");
    assert_eq!(s("api", "allowed_media_domains"), r#"["a.example", "*.b.example"]"#);
    assert_eq!(s("api", "rpc_timeout_s"), "10", "defaults are printed too");
    assert_eq!(s("serve", "ready_timeout_s"), "60");
    assert_eq!(s("engine", "chunked_prefill_size"), "512");
    assert_eq!(s("embed-cache", "embed_cache_request_share"), "0.5", "fractions stay numbers");
    assert_eq!(s("api", "max_audio_seconds"), "0.15", "so do exponents");

    // Secrets are never printed (nor written into the run's file).
    let secret = mmserve(&["serve", "--print-config", "--api-key", "sk-very-secret"], &[]);
    assert!(secret.status.success());
    assert!(!String::from_utf8_lossy(&secret.stdout).contains("sk-very-secret"));

    // What is printed is a configuration: read back, it resolves to itself.
    let again_file = dir.join("printed.toml");
    std::fs::write(&again_file, &printed).unwrap();
    let again = mmserve(&["serve", "--config", again_file.to_str().unwrap(), "--print-config"], &[]);
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(String::from_utf8(again.stdout).unwrap(), printed);
}

#[test]
fn what_no_service_has_is_refused_with_its_name() {
    let dir = temp_dir("config-refusals");
    let cases: &[(&str, &str)] = &[
        ("[encoder]\nbogus = 1\n", "[encoder] bogus"),
        ("[encoder]\nmax_batch = \"many\"\n", "max-batch"),
        ("[engine]\nsocket = \"/tmp/x\"\n", "[engine] socket"),
        ("[embed-cache]\nadmin_token = \"t\"\n", "admin_token"),
        ("[encoderz]\nmax_batch = 1\n", "[encoderz]"),
        ("[api]\nallow_all_media_domains = \"yes\"\n", "allow_all_media_domains"),
        ("[api]\nport = [1, 2]\n", "port"),
        ("not toml at all [", "not TOML"),
    ];
    for (i, (text, named)) in cases.iter().enumerate() {
        let file = dir.join(format!("bad{i}.toml"));
        std::fs::write(&file, text).unwrap();
        let out = mmserve(&["serve", "--config", file.to_str().unwrap(), "--print-config"], &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{text:?} was accepted");
        assert!(err.contains(named), "{text:?}: the error does not name {named:?}:\n{err}");
    }
}

#[test]
fn every_child_flag_is_a_flag_of_serve() {
    let help = |cmd: &str| {
        let out = mmserve(&[cmd, "--help"], &[]);
        String::from_utf8(out.stdout).unwrap()
    };
    let flags = |text: &str| -> Vec<String> {
        text.lines()
            .filter_map(|l| l.trim_start().split([' ', ',', '=']).find(|w| w.starts_with("--")).map(str::to_string))
            .collect()
    };
    let serve = flags(&help("serve"));
    let wiring = ["--socket", "--cache-socket", "--encoder-socket", "--engine-socket", "--shm-prefix"];
    let wiring = [&wiring[..], &["--embed-dim", "--embed-dtype", "--help", "--config"]].concat();
    for child in ["embed-cache", "encoder", "engine", "api"] {
        for flag in flags(&help(child)) {
            if !wiring.contains(&flag.as_str()) {
                assert!(serve.contains(&flag), "{child}'s {flag} is not a flag of serve");
            }
        }
    }
}

#[tokio::test]
async fn a_child_runs_with_its_section_of_the_file() {
    let dir = temp_dir("config-run");
    let file = dir.join("mmserve.toml");
    std::fs::write(&file, "[api]\nserved_model_name = \"from-the-file\"\n").unwrap();
    let server = Server::start(&["--config", file.to_str().unwrap()]);
    let models: serde_json::Value =
        server.http.get(format!("{}/v1/models", server.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "from-the-file", "{models}");
    server.stop();
}
