//! `mmserve bench caption`: `mmserve caption` as a user runs it, over a folder of
//! generated distinct images of mixed sizes, at each `--concurrency` in turn against one
//! server (started here, or `--url`): images per second and output tokens per second,
//! each concurrency also as a ratio to the first.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};

#[derive(Debug, clap::Args)]
pub struct CaptionBench {
    /// Model directory of the server started for the run.
    #[arg(long, default_value = "assets/models/llava-tiny")]
    pub model: PathBuf,
    /// A running server instead.
    #[arg(long)]
    pub url: Option<String>,
    /// More flags for the server started for the run.
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    pub serve_args: Vec<String>,
    /// Distinct images generated.
    #[arg(long, default_value_t = 1000)]
    pub images: usize,
    /// Smallest and largest side of the images, in pixels (sizes spread between them).
    #[arg(long, value_delimiter = ',', default_value = "336,1024")]
    pub sizes: Vec<u32>,
    /// Concurrencies to run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    pub concurrency: Vec<usize>,
    /// Output tokens per caption.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
}

/// `n` distinct PNG images, sides spread over `lo..=hi`.
fn generate(dir: &Path, n: usize, (lo, hi): (u32, u32)) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    for i in 0..n {
        let side = lo + ((hi - lo) as usize * i / n.max(1)) as u32;
        let seed = i as u32;
        let img = image::RgbImage::from_fn(side, side, |x, y| {
            image::Rgb([
                (x.wrapping_mul(7) ^ seed) as u8,
                (y.wrapping_mul(5) + seed) as u8,
                ((x + y) ^ (seed >> 8)) as u8,
            ])
        });
        img.save(dir.join(format!("img{i:06}.png")))?;
    }
    Ok(())
}

pub async fn run(b: CaptionBench) -> anyhow::Result<()> {
    let (lo, hi) = match b.sizes[..] {
        [s] => (s, s),
        [lo, hi] if lo <= hi => (lo, hi),
        _ => bail!("--sizes is one side or `smallest,largest`"),
    };
    let work = std::env::temp_dir().join(format!("mmserve-bench-caption-{}", std::process::id()));
    let images = work.join("images");
    let t0 = Instant::now();
    generate(&images, b.images, (lo, hi))?;
    println!("{} images of {lo}² to {hi}² generated in {:.1} s", b.images, t0.elapsed().as_secs_f64());
    let server = match &b.url {
        Some(_) => None,
        None => Some(crate::embedded::OwnServer::start(&b.model, &b.serve_args).await?),
    };
    let url = b.url.clone().or_else(|| server.as_ref().map(|s| s.url.clone())).context("no server")?;
    println!("concurrency   images/s   output tok/s   seconds   ratio");
    let mut first = None;
    let result: anyhow::Result<()> = async {
        for &c in &b.concurrency {
            let out = work.join(format!("captions-{c}.jsonl"));
            let _ = std::fs::remove_file(&out);
            let t = Instant::now();
            let status = tokio::process::Command::new(std::env::current_exe()?)
                .args(["caption", "--quiet", "--url", &url, "--out"])
                .arg(&out)
                .arg(&images)
                .args(["--concurrency", &c.to_string(), "--max-tokens", &b.max_tokens.to_string()])
                .status()
                .await?;
            let secs = t.elapsed().as_secs_f64();
            if !status.success() {
                bail!("mmserve caption at concurrency {c} failed ({status})");
            }
            let text = std::fs::read_to_string(&out)?;
            let tokens: u64 = text
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter_map(|v| v["completion_tokens"].as_u64())
                .sum();
            let rate = b.images as f64 / secs;
            let ratio = rate / *first.get_or_insert(rate);
            println!("{c:>11} {rate:>10.2} {:>14.1} {secs:>9.1} {ratio:>7.2}", tokens as f64 / secs);
        }
        Ok(())
    }
    .await;
    if let Some(s) = server {
        s.stop().await;
    }
    let _ = std::fs::remove_dir_all(&work);
    result
}
