//! The arena stores rows in the LLM's dtype: slot counts follow the element size (the
//! rounding of rows in and out is `mmserve_ops::ArenaRows`'s, tested there).

use clap::Parser;
use mmserve_embed_cache::{CacheArgs, CacheService};
use mmserve_protocol::ArenaDtype;

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    args: CacheArgs,
}

fn service(dtype: &str, tag: &str) -> CacheService {
    let prefix = format!("mmserve-test-dtype-{tag}-{}", std::process::id());
    let cli = Cli::parse_from([
        "t",
        "--socket",
        "/nonexistent",
        "--shm-prefix",
        &prefix,
        "--embed-dim",
        "8",
        "--embed-dtype",
        dtype,
        "--embed-cache-size",
        "1024",
        "--embed-cache-data-size",
        "4096",
    ]);
    CacheService::new(&cli.args).unwrap()
}

#[test]
fn slot_count_follows_the_element_size() {
    let f32_cache = service("float32", "f32");
    let bf16_cache = service("bfloat16", "bf16");
    assert_eq!(f32_cache.info().slots, 1024 / (8 * 4));
    assert_eq!(bf16_cache.info().slots, 1024 / (8 * 2));
    assert_eq!(bf16_cache.info().dtype, ArenaDtype::Bf16);
}

#[test]
fn unknown_dtype_is_refused_by_the_flag_parser() {
    let r = Cli::try_parse_from(["t", "--socket", "/x", "--embed-dim", "8", "--embed-dtype", "int8"]);
    assert!(r.unwrap_err().to_string().contains("unknown dtype"));
}
