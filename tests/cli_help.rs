//! Every limit a hostile client runs into is a flag of `serve` whose `--help` names its
//! default (the README's security section lists what each protects).

use std::process::Command;

const LIMITS: &[&str] = &[
    "--max-body-bytes",
    "--body-read-timeout-s",
    "--header-read-timeout-s",
    "--max-connections",
    "--max-queued-requests",
    "--max-queued-prompt-tokens",
    "--max-items-per-request",
    "--max-item-bytes",
    "--max-image-pixels",
    "--max-audio-seconds",
    "--media-workers",
    "--media-fetch-timeout-s",
    "--media-max-redirects",
    "--special-tokens-in-content",
    "--embed-cache-request-share",
    "--embed-cache-wait-timeout-s",
    "--embed-cache-data-timeout-s",
    "--admin-max-connections",
    "--admin-auth-timeout-s",
    "--admin-idle-timeout-s",
    "--admin-eviction-wait-s",
    "--token-timeout-s",
    "--encode-timeout-s",
    "--connect-timeout-s",
    "--rpc-timeout-s",
    "--cpu-wait-timeout-s",
    "--health-timeout-s",
    "--engine-poll-s",
    "--sse-keep-alive-s",
    "--shutdown-grace-s",
    "--encoder-timeout-ms",
    "--ready-timeout-s",
    "--stop-grace-s",
];

#[test]
fn every_limit_says_its_default() {
    let out = Command::new(env!("CARGO_BIN_EXE_mmserve")).args(["serve", "--help"]).output().unwrap();
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in LIMITS {
        let at = help.find(&format!("{flag} <")).unwrap_or_else(|| panic!("{flag} is not a flag of serve"));
        let entry = &help[at..];
        let end = entry[2..].find("\n      --").map_or(entry.len(), |e| e + 2);
        assert!(entry[..end].contains("[default: "), "{flag} does not say its default:\n{}", &entry[..end]);
    }
}
