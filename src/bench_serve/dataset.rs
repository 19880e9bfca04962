//! The requests of a `bench serve` run, made from `--seed`: the same flags give the same
//! requests, and their digest is saved with the result so that two runs can be checked
//! to have sent the same load. Dataset names and flags are vLLM's (`random`, `random-mm`,
//! `custom` as `jsonl`), plus `random-audio`.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use base64::Engine;
use sha2::{Digest, Sha256};

use super::rng::Rng;

/// One request to send.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchRequest {
    pub prompt: String,
    /// Media parts, before the text: data URLs (generated) or the URLs a dataset names.
    pub media: Vec<Media>,
    /// Output tokens asked for (`max_tokens`, EOS ignored).
    pub output_len: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Media {
    Image(String),
    Audio(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DatasetName {
    /// Text: `--random-input-len` words in, `--random-output-len` tokens out.
    Random,
    /// Text and generated images (`--random-mm-*`).
    RandomMm,
    /// Text and generated audio clips (`--random-audio-*`).
    RandomAudio,
    /// A JSON-lines file (`--dataset-path`): `prompt`, `image` and `audio` (a path, URL
    /// or list of them), `output_len`.
    Jsonl,
}

/// The dataset flags, as vLLM names them.
#[derive(Debug, Clone, clap::Args)]
pub struct DatasetArgs {
    #[arg(long, value_enum, default_value = "random", env = "MMSERVE_BENCH_DATASET")]
    pub dataset_name: DatasetName,
    /// The `jsonl` dataset's file.
    #[arg(long, env = "MMSERVE_BENCH_DATASET_PATH")]
    pub dataset_path: Option<PathBuf>,
    /// Prompt length in words (each about one token in common vocabularies), before the
    /// chat template.
    #[arg(long, default_value_t = 1024, env = "MMSERVE_BENCH_RANDOM_INPUT_LEN")]
    pub random_input_len: u32,
    #[arg(long, default_value_t = 128, env = "MMSERVE_BENCH_RANDOM_OUTPUT_LEN")]
    pub random_output_len: u32,
    /// Lengths are drawn uniformly from [len·(1−r), len·(1+r)].
    #[arg(long, default_value_t = 0.0, env = "MMSERVE_BENCH_RANDOM_RANGE_RATIO")]
    pub random_range_ratio: f64,
    /// Image sizes and their probabilities, as vLLM writes them:
    /// `{(336, 336, 1): 0.5, (720, 1280, 1): 0.5}` (height, width, frames: 1 for images).
    #[arg(long, default_value = "{(336, 336, 1): 1.0}", env = "MMSERVE_BENCH_RANDOM_MM_BUCKET_CONFIG")]
    pub random_mm_bucket_config: String,
    /// Media items per request (before the range ratio).
    #[arg(long, default_value_t = 1, env = "MMSERVE_BENCH_RANDOM_MM_BASE_ITEMS_PER_REQUEST")]
    pub random_mm_base_items_per_request: u32,
    /// Items per request are drawn uniformly from [base·(1−r), base·(1+r)].
    #[arg(long, default_value_t = 0.0, env = "MMSERVE_BENCH_RANDOM_MM_NUM_MM_ITEMS_RANGE_RATIO")]
    pub random_mm_num_mm_items_range_ratio: f64,
    /// The share of items that repeat an item sent before (embed-cache hits); the rest
    /// are each distinct.
    #[arg(long, default_value_t = 0.0, env = "MMSERVE_BENCH_RANDOM_MM_REPEAT_RATIO")]
    pub random_mm_repeat_ratio: f64,
    /// Clip length in seconds (`random-audio`), with `--random-range-ratio`.
    #[arg(long, default_value_t = 5.0, env = "MMSERVE_BENCH_RANDOM_AUDIO_SECONDS")]
    pub random_audio_seconds: f64,
}

/// Common words that most vocabularies hold as one token with a leading space.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he",
    "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were", "their",
    "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no",
    "time", "some", "what", "only", "into", "them", "out", "new", "also", "two", "first", "over", "like",
];

/// `base` spread by `ratio`: uniform in [base·(1−r), base·(1+r)], at least `min`.
fn spread(rng: &mut Rng, base: f64, ratio: f64, min: f64) -> f64 {
    let ratio = ratio.clamp(0.0, 1.0);
    (base * (1.0 - ratio + 2.0 * ratio * rng.next_f64())).max(min)
}

/// `n` requests of the dataset the flags describe.
pub fn build(args: &DatasetArgs, n: usize, seed: u64) -> anyhow::Result<Vec<BenchRequest>> {
    let mut rng = Rng::new(seed);
    if args.dataset_name == DatasetName::Jsonl {
        let path = args.dataset_path.as_deref().context("--dataset-name jsonl needs --dataset-path")?;
        return jsonl(path, n, args.random_output_len);
    }
    let buckets = match args.dataset_name {
        DatasetName::RandomMm => parse_buckets(&args.random_mm_bucket_config)?,
        _ => Vec::new(),
    };
    let mut sent: Vec<Media> = Vec::new();
    let mut made = 0u64;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let words = spread(&mut rng, f64::from(args.random_input_len), args.random_range_ratio, 1.0) as usize;
        let output_len = spread(&mut rng, f64::from(args.random_output_len), args.random_range_ratio, 1.0) as u32;
        // A distinct head so that requests share no prefix-cache block, then common words.
        let mut prompt = format!("Request {i:06} {seed}:");
        for _ in 0..words.saturating_sub(3) {
            prompt.push(' ');
            prompt.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
        }
        let items = match args.dataset_name {
            DatasetName::Random | DatasetName::Jsonl => 0,
            DatasetName::RandomMm | DatasetName::RandomAudio => spread(
                &mut rng,
                f64::from(args.random_mm_base_items_per_request),
                args.random_mm_num_mm_items_range_ratio,
                0.0,
            )
            .round() as usize,
        };
        let mut media = Vec::with_capacity(items);
        for _ in 0..items {
            if !sent.is_empty() && rng.next_f64() < args.random_mm_repeat_ratio {
                media.push(sent[rng.below(sent.len() as u64) as usize].clone());
                continue;
            }
            made += 1;
            let item = match args.dataset_name {
                DatasetName::RandomAudio => {
                    let seconds = spread(&mut rng, args.random_audio_seconds, args.random_range_ratio, 0.1);
                    Media::Audio(data_url("audio/wav", &wav(made, seconds)))
                }
                _ => {
                    let (h, w) = pick_bucket(&buckets, &mut rng);
                    Media::Image(data_url("image/jpeg", &jpeg(made, h, w)?))
                }
            };
            sent.push(item.clone());
            media.push(item);
        }
        out.push(BenchRequest { prompt, media, output_len });
    }
    Ok(out)
}

/// The digest of the requests: equal for equal loads.
pub fn digest(requests: &[BenchRequest]) -> String {
    let mut h = Sha256::new();
    for r in requests {
        h.update(r.prompt.as_bytes());
        h.update(r.output_len.to_le_bytes());
        for m in &r.media {
            let (kind, url) = match m {
                Media::Image(u) => (b'i', u),
                Media::Audio(u) => (b'a', u),
            };
            h.update([kind]);
            h.update(url.as_bytes());
        }
        h.update([0xff]);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// vLLM's bucket syntax: `{(h, w, frames): probability, …}`; images only (frames 1).
pub fn parse_buckets(text: &str) -> anyhow::Result<Vec<(u32, u32, f64)>> {
    let bad = || anyhow::anyhow!("buckets: {text:?} is not {{(h, w, frames): p, …}}");
    let mut rest = text.trim().strip_prefix('{').and_then(|t| t.strip_suffix('}')).ok_or_else(bad)?.trim();
    let mut out = Vec::new();
    while !rest.is_empty() {
        let (shape, after) = rest.strip_prefix('(').and_then(|r| r.split_once(')')).ok_or_else(bad)?;
        let dims: Vec<u32> = shape.split(',').map(|d| d.trim().parse()).collect::<Result<_, _>>().map_err(|_| bad())?;
        let after = after.trim_start().strip_prefix(':').ok_or_else(bad)?;
        let (p, after) = after.split_once(',').unwrap_or((after, ""));
        let p: f64 = p.trim().parse().map_err(|_| bad())?;
        match dims[..] {
            [h, w, 1] if h > 0 && w > 0 && p >= 0.0 => out.push((h, w, p)),
            [_, _, f] if f != 1 => bail!("buckets: {f} frames: only images (1 frame) are generated"),
            _ => return Err(bad()),
        }
        rest = after.trim();
    }
    if out.iter().map(|b| b.2).sum::<f64>() <= 0.0 {
        bail!("buckets: {text:?} needs shapes with probabilities that sum above 0");
    }
    Ok(out)
}

fn pick_bucket(buckets: &[(u32, u32, f64)], rng: &mut Rng) -> (u32, u32) {
    let total: f64 = buckets.iter().map(|b| b.2).sum();
    let mut u = rng.next_f64() * total;
    for &(h, w, p) in buckets {
        if u < p {
            return (h, w);
        }
        u -= p;
    }
    let last = buckets[buckets.len() - 1];
    (last.0, last.1)
}

fn data_url(mime: &str, bytes: &[u8]) -> String {
    format!("data:{mime};base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// A JPEG of h×w that differs for every `seed`: smooth waves with the seed in their
/// phases, as a photo's compression would see it.
fn jpeg(seed: u64, h: u32, w: u32) -> anyhow::Result<Vec<u8>> {
    let k = (seed % 100_003) as f32;
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        let (fx, fy) = (x as f32, y as f32);
        let c = |a: f32, b: f32, p: f32| (127.5 + 127.5 * ((fx * a + fy * b) * 0.05 + p).sin()) as u8;
        image::Rgb([c(1.0, 0.3, k), c(0.2, 1.1, k * 1.7), c(0.7, -0.6, k * 2.3)])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Jpeg)?;
    Ok(out.into_inner())
}

/// A 16 kHz mono 16-bit WAV of `seconds`: a tone whose pitch depends on `seed`.
fn wav(seed: u64, seconds: f64) -> Vec<u8> {
    let rate = 16_000u32;
    let n = (seconds * f64::from(rate)) as u32;
    let freq = 220.0 + (seed % 997) as f64;
    let mut out = Vec::with_capacity(44 + 2 * n as usize);
    let data = 2 * n;
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    out.extend_from_slice(&16u32.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes()); // PCM
    out.extend_from_slice(&1u16.to_le_bytes()); // mono
    out.extend_from_slice(&rate.to_le_bytes());
    out.extend_from_slice(&(2 * rate).to_le_bytes());
    out.extend_from_slice(&2u16.to_le_bytes());
    out.extend_from_slice(&16u16.to_le_bytes());
    out.extend_from_slice(b"data");
    out.extend_from_slice(&data.to_le_bytes());
    for i in 0..n {
        let t = f64::from(i) / f64::from(rate);
        let s = (0.3 * (2.0 * std::f64::consts::PI * freq * t).sin() * f64::from(i16::MAX)) as i16;
        out.extend_from_slice(&s.to_le_bytes());
    }
    out
}

/// The `jsonl` dataset: the first `n` lines (cycled when there are fewer).
fn jsonl(path: &Path, n: usize, default_output: u32) -> anyhow::Result<Vec<BenchRequest>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut rows = Vec::new();
    for (k, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}:{}: not JSON", path.display(), k + 1))?;
        let prompt = v["prompt"].as_str().with_context(|| format!("{}:{}: needs `prompt`", path.display(), k + 1))?;
        let mut media = Vec::new();
        for (field, image) in [("image", true), ("audio", false)] {
            let refs: Vec<&str> = match &v[field] {
                serde_json::Value::Null => Vec::new(),
                serde_json::Value::String(s) => vec![s.as_str()],
                serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_str()).collect(),
                _ => bail!("{}:{}: `{field}` is a path, a URL or a list of them", path.display(), k + 1),
            };
            for r in refs {
                let url = media_url(dir, r)?;
                media.push(if image { Media::Image(url) } else { Media::Audio(url) });
            }
        }
        let output_len = v["output_len"].as_u64().map_or(default_output, |o| o as u32);
        rows.push(BenchRequest { prompt: prompt.to_string(), media, output_len });
    }
    if rows.is_empty() {
        bail!("{}: no requests", path.display());
    }
    Ok((0..n).map(|i| rows[i % rows.len()].clone()).collect())
}

/// A dataset's media reference as the request carries it: URLs as they are, files (relative
/// to the dataset) as data URLs of their bytes, read once.
fn media_url(dir: &Path, r: &str) -> anyhow::Result<String> {
    if ["http://", "https://", "data:", "file://"].iter().any(|p| r.starts_with(p)) {
        return Ok(r.to_string());
    }
    let path = dir.join(r);
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    let mime = match ext.as_str() {
        "png" => "image/png",
        "jpg" | "jpeg" => "image/jpeg",
        "webp" => "image/webp",
        "gif" => "image/gif",
        "wav" => "audio/wav",
        "mp3" => "audio/mpeg",
        "flac" => "audio/flac",
        "ogg" => "audio/ogg",
        _ => "application/octet-stream",
    };
    Ok(data_url(mime, &bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_read_as_vllm_writes_them() {
        assert_eq!(parse_buckets("{(336, 336, 1): 1.0}").unwrap(), [(336, 336, 1.0)]);
        assert_eq!(
            parse_buckets("{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}").unwrap(),
            [(256, 256, 0.5), (720, 1280, 0.5)]
        );
        for bad in ["(1, 1, 1): 1", "{(1, 1, 4): 1.0}", "{(1, 1): 1.0}", "{(1, 1, 1): x}", "{}", "{(1, 1, 1): 0}"] {
            assert!(parse_buckets(bad).is_err(), "{bad}");
        }
    }

    fn args(name: DatasetName) -> DatasetArgs {
        DatasetArgs {
            dataset_name: name,
            dataset_path: None,
            random_input_len: 20,
            random_output_len: 8,
            random_range_ratio: 0.5,
            random_mm_bucket_config: "{(32, 48, 1): 0.5, (40, 40, 1): 0.5}".into(),
            random_mm_base_items_per_request: 2,
            random_mm_num_mm_items_range_ratio: 0.0,
            random_mm_repeat_ratio: 0.0,
            random_audio_seconds: 0.5,
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_requests() {
        for name in [DatasetName::Random, DatasetName::RandomMm, DatasetName::RandomAudio] {
            let a = build(&args(name), 6, 1).unwrap();
            assert_eq!(a, build(&args(name), 6, 1).unwrap());
            assert_ne!(digest(&a), digest(&build(&args(name), 6, 2).unwrap()));
            for r in &a {
                assert!((4..=12).contains(&r.output_len), "{}", r.output_len);
                let words = r.prompt.split(' ').count();
                assert!((10..=30).contains(&words), "{words}");
            }
        }
        // Distinct images unless a repeat ratio is set; then some repeat.
        let mm = build(&args(DatasetName::RandomMm), 6, 1).unwrap();
        let all: Vec<&Media> = mm.iter().flat_map(|r| &r.media).collect();
        assert_eq!(all.len(), 12);
        assert!(all.iter().enumerate().all(|(i, m)| !all[..i].contains(m)));
        let mut repeat = args(DatasetName::RandomMm);
        repeat.random_mm_repeat_ratio = 0.5;
        let rep = build(&repeat, 20, 1).unwrap();
        let all: Vec<&Media> = rep.iter().flat_map(|r| &r.media).collect();
        let distinct = all.iter().enumerate().filter(|(i, m)| !all[..*i].contains(m)).count();
        assert!(distinct < 30 && distinct > 10, "{distinct} of 40");
    }
}
