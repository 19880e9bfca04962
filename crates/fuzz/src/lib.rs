//! The fuzz targets: each takes arbitrary bytes and runs the code that hostile input
//! reaches, which must answer with an error, never panic, hang or allocate without
//! bound. `fuzz/` runs them under libFuzzer (`cargo fuzz`, coverage-guided, stable Rust
//! with `-s none`); `tests/corpus.rs` replays the committed seeds and every crash found
//! (`fuzz/regressions/<target>/`) in `cargo test`.

use mmserve_api::openai::ChatRequest;
use mmserve_media::audio::{AudioLimits, decode_audio, probe_duration};
use mmserve_media::{ImageLimits, decode_image, image_header};

/// Every target, by the name its corpus directory has.
pub const TARGETS: &[(&str, fn(&[u8]))] =
    &[("image", image), ("audio", audio), ("chat_request", chat_request), ("media_url", media_url)];

/// Image header probes and full decoding (our JPEG decoder among the formats), with a
/// pixel limit that keeps each run small.
pub fn image(data: &[u8]) {
    let _ = image_header(data);
    let _ = decode_image(data, &ImageLimits { max_pixels: 1 << 20 });
}

/// Audio containers and codecs, with the first byte choosing the format hint.
pub fn audio(data: &[u8]) {
    let hints = [None, Some("wav"), Some("mp3"), Some("flac"), Some("ogg"), Some("m4a")];
    let (hint, bytes) = match data.split_first() {
        Some((&h, rest)) => (hints[usize::from(h) % hints.len()], rest),
        None => (None, data),
    };
    let _ = probe_duration(bytes, hint);
    let _ = decode_audio(bytes, hint, &AudioLimits { max_seconds: 5.0, ..AudioLimits::default() });
}

/// A chat completion request's body: JSON, messages and parts, tools, output constraints
/// and sampling fields.
pub fn chat_request(data: &[u8]) {
    let Ok(req) = serde_json::from_slice::<ChatRequest>(data) else { return };
    let _ = mmserve_api::prompt::parse_messages(&req.messages);
    let parser = mmserve_api::tools::ToolParser::Hermes;
    let Ok(tools) = mmserve_api::tools::Tools::parse(req.tools.as_ref(), req.tool_choice.as_ref(), parser) else {
        return;
    };
    let Ok(constraint) = mmserve_api::generate::output_constraint(&req, tools.as_ref()) else { return };
    let _ = mmserve_api::generate::sampling(&req, constraint.map(|(_, c)| c), 10, 4096, 32_000);
}

/// Media URLs as a part carries them: `data:` URLs and base64 payloads, and the whole of
/// `fetch` under a policy that reaches nothing (no host and no local path allowed: every
/// http(s) and file URL is parsed and refused before any I/O), and the address check of
/// IP literals.
pub fn media_url(data: &[u8]) {
    let Ok(url) = std::str::from_utf8(data) else { return };
    let _ = mmserve_api::fetch::data_url(url, 1 << 16, "url");
    let _ = mmserve_api::fetch::data_url_type(url);
    let _ = mmserve_api::fetch::base64_payload(url, 1 << 16, "data");
    let policy = mmserve_api::fetch::FetchPolicy {
        allowed_domains: Vec::new(),
        allow_all_domains: false,
        allow_private_addresses: false,
        local_root: None,
        max_bytes: 1 << 16,
        timeout: std::time::Duration::from_secs(1),
        max_redirects: 3,
    };
    let _ = runtime().block_on(mmserve_api::fetch::fetch(url, &policy, "url"));
    if let Ok(parsed) = url::Url::parse(url) {
        match parsed.host() {
            Some(url::Host::Ipv4(ip)) => drop(mmserve_api::fetch::is_public(ip.into())),
            Some(url::Host::Ipv6(ip)) => drop(mmserve_api::fetch::is_public(ip.into())),
            _ => {}
        }
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime"))
}
