//! The arena stores rows in the LLM's dtype: slot counts follow the element size and
//! rows come back as the dtype rounds them.

use clap::Parser;
use half::bf16;
use mmserve_embed_cache::{ArenaView, CacheArgs, CacheService};
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
fn rows_round_trip_through_each_dtype() {
    let row: Vec<f32> = (0..16).map(|i| (i as f32 - 7.3) * 1.0009765).collect();
    for (name, tag) in [("float32", "rt32"), ("bf16", "rtb16"), ("float16", "rtf16")] {
        let cache = service(name, tag);
        let view = ArenaView::open(cache.info()).unwrap();
        view.write_rows(3, &row).unwrap();
        let mut back = vec![f32::NAN; row.len()];
        view.read_rows(3, &mut back).unwrap();
        let expect: Vec<f32> = match cache.info().dtype {
            ArenaDtype::F32 => row.clone(),
            ArenaDtype::Bf16 => row.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
            ArenaDtype::F16 => row.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
        };
        assert_eq!(back, expect, "{name}");
        if cache.info().dtype != ArenaDtype::F32 {
            assert_ne!(back, row, "{name} should round");
        }
    }
}

#[test]
fn unknown_dtype_is_refused_by_the_flag_parser() {
    let r = Cli::try_parse_from(["t", "--socket", "/x", "--embed-dim", "8", "--embed-dtype", "int8"]);
    assert!(r.unwrap_err().to_string().contains("unknown dtype"));
}
