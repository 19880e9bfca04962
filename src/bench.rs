//! `mmserve bench cache`: drives a real embed-cache service over its Unix socket with
//! N concurrent clients (each its own connection, like N api processes), each
//! allocating and releasing requests of k items, a mix of hits and misses. Reports
//! item allocations per second and the latency of `alloc`.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use mmserve_protocol::cache::Allocation;
use mmserve_protocol::reconnect::{CacheConnection, Lease};
use mmserve_protocol::{AllocItem, EmbedCacheClient, ItemDigest, Modality, deadline, transport};

#[derive(Debug, clap::Subcommand)]
pub enum Bench {
    /// The embed cache's alloc/release path.
    Cache(CacheBench),
    /// Decoding and preprocessing, one thread, per file (and with `--threads`, the set's
    /// throughput at several thread counts).
    Preprocess(PreprocessBench),
    /// The serving engine through `mmserve serve`: throughput, scheduler time, TTFT.
    Engine(crate::bench_engine::EngineBench),
    /// The model code alone on a device: decode, prefill, vision tower, against ceilings.
    Model(crate::bench_model::ModelBench),
    /// `mmserve caption` over generated images, at several concurrencies.
    Caption(crate::bench_caption::CaptionBench),
    /// Any OpenAI-compatible server under load, as `vllm bench serve` measures it:
    /// datasets with images or audio, a request rate, latency percentiles.
    Serve(crate::bench_serve::ServeBench),
    /// Two saved `bench serve` results side by side.
    Compare(crate::bench_serve::CompareBench),
}

#[derive(Debug, clap::Args)]
pub struct PreprocessBench {
    /// A preprocessor_config.json (CLIP, Qwen2-VL or Whisper).
    #[arg(long)]
    pub preprocessor: PathBuf,
    /// Runs per file.
    #[arg(long, default_value_t = 5)]
    pub repeat: u32,
    /// Print JSON lines instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also the whole set's throughput at these thread counts (comma-separated): each
    /// thread decodes and preprocesses every file `repeat` times, as the encoder's
    /// preprocessing pool does items, all threads at once.
    #[arg(long, value_delimiter = ',')]
    pub threads: Vec<usize>,
    pub files: Vec<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct CacheBench {
    /// Socket of a running cache; without it, one is started for the run.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Concurrent clients, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub clients: Vec<usize>,
    /// Connections the clients share (0: one per client, as separate api processes;
    /// otherwise clients multiplex over this many, as one api process's requests do).
    #[arg(long, default_value_t = 0)]
    pub connections: usize,
    /// Items per request, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub items: Vec<usize>,
    /// Fraction of items that are hits.
    #[arg(long, default_value_t = 0.5)]
    pub hit_ratio: f64,
    /// Seconds per configuration.
    #[arg(long, default_value_t = 3.0)]
    pub seconds: f64,
    /// Embedding rows per item.
    #[arg(long, default_value_t = 64)]
    pub tokens: u32,
    /// Print JSON lines instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Call the service one request at a time (`alloc`, `release`, ... each its own
    /// message) instead of through the api's coalescing client.
    #[arg(long)]
    pub direct: bool,
}

/// A client connection as the bench uses it: plain calls, or the api's coalescing client.
#[derive(Clone)]
enum Link {
    Direct(EmbedCacheClient),
    Coalesced(Arc<CacheConnection>),
}

const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// What an alloc holds: the connection's references, or (as the api holds them) a
/// lease, given back by dropping it.
enum Grant {
    Direct(Vec<u64>),
    Leased(Lease),
}

impl Link {
    async fn alloc(&self, items: Vec<AllocItem>) -> Option<(Allocation, Grant)> {
        match self {
            Link::Direct(c) => {
                let a = c.alloc(deadline(CALL_TIMEOUT), 0, items, 1000).await.ok()?.ok()?;
                let ids = a.records.iter().map(|r| r.id).collect();
                Some((a, Grant::Direct(ids)))
            }
            Link::Coalesced(c) => {
                let mut lease = c.lease();
                let a = c.alloc(&mut lease, items, Duration::from_secs(1), CALL_TIMEOUT).await.ok()?.ok()?;
                Some((a, Grant::Leased(lease)))
            }
        }
    }

    async fn set_items_data(&self, ids: Vec<u64>) {
        let _ = match self {
            Link::Direct(c) => c.set_items_data(deadline(CALL_TIMEOUT), ids).await.map(drop),
            Link::Coalesced(c) => {
                let _ = c.set_items_data(ids).await;
                Ok(())
            }
        };
    }

    async fn release(&self, grant: Grant) {
        match (self, grant) {
            (Link::Direct(c), Grant::Direct(ids)) => drop(c.release(deadline(CALL_TIMEOUT), ids).await),
            // Queued behind whatever this connection sent before, as the api's requests do.
            (_, Grant::Leased(lease)) => drop(lease),
            (Link::Coalesced(_), Grant::Direct(_)) => unreachable!("a coalesced link leases"),
        }
    }
}

pub async fn run(bench: Bench) -> anyhow::Result<()> {
    match bench {
        Bench::Cache(b) => cache(b).await,
        Bench::Preprocess(b) => preprocess(b),
        Bench::Caption(b) => crate::bench_caption::run(b).await,
        Bench::Engine(b) => crate::bench_engine::run(b).await,
        Bench::Model(b) => crate::bench_model::run(b),
        Bench::Serve(b) => crate::bench_serve::run(b).await,
        Bench::Compare(b) => crate::bench_serve::compare(b).await,
    }
}

/// Per file: the encoder's work (decode and preprocess, into the vectors the tower's input
/// is made from; not `mmserve preprocess`'s serialisation) and the api's (header check and
/// digests), seconds per item, best of `repeat` runs after one warm-up.
fn preprocess(b: PreprocessBench) -> anyhow::Result<()> {
    use crate::preprocess::{Preprocessor, prepare};
    let pre = Preprocessor::load(&b.preprocessor)?;
    let model_config =
        serde_json::json!({"model_type": "llava", "vision_config": {"image_size": 336, "patch_size": 14}});
    if !b.json {
        println!("{:<40} {:>14} {:>12} {:>14}", "file", "encoder (ms)", "items/s", "api hash (ms)");
    }
    let files = (b.files.iter())
        .map(|f| std::fs::read(f).with_context(|| format!("reading {}", f.display())))
        .collect::<anyhow::Result<Vec<_>>>()?;
    for (file, bytes) in b.files.iter().zip(&files) {
        let time = |f: &dyn Fn() -> anyhow::Result<()>| -> anyhow::Result<f64> {
            f()?;
            let mut best = f64::MAX;
            for _ in 0..b.repeat.max(1) {
                let t0 = Instant::now();
                f()?;
                best = best.min(t0.elapsed().as_secs_f64());
            }
            Ok(best)
        };
        let encoder = time(&|| prepare(&pre, Some(&model_config), bytes).map(drop))?;
        let api = time(&|| {
            if matches!(pre, Preprocessor::Image(_)) {
                mmserve_media::image_header(bytes)?;
            }
            std::hint::black_box(ItemDigest::compute(Modality::Image, "bench", bytes));
            Ok(())
        })?;
        let name = file.display().to_string();
        if b.json {
            println!("{}", serde_json::json!({"file": name, "seconds": encoder, "api_seconds": api}));
        } else {
            println!("{name:<40} {:>14.3} {:>12.1} {:>14.3}", encoder * 1e3, 1.0 / encoder, api * 1e3);
        }
    }
    // Fewest threads first, so that one thread's figure (when asked for) is there to scale by.
    let mut counts: Vec<usize> = b.threads.iter().map(|&t| t.max(1)).collect();
    counts.sort_unstable();
    counts.dedup();
    let mut one_thread = None;
    for threads in counts {
        let per_second = preprocess_throughput(&pre, &model_config, &files, threads, b.repeat.max(1))?;
        if threads == 1 {
            one_thread = Some(per_second);
        }
        let scaling = one_thread.map(|one| per_second / one);
        if b.json {
            println!("{}", serde_json::json!({"threads": threads, "items_per_second": per_second, "scaling": scaling}));
        } else {
            let scaling = scaling.map(|s| format!(" ({s:.2}x one thread)")).unwrap_or_default();
            println!("{threads} threads: {per_second:.1} items/s{scaling}");
        }
    }
    Ok(())
}

/// Items a second when `threads` threads each prepare every one of `files` `rounds` times,
/// all at once (the per-file runs before warmed every file up). Each thread starts at its
/// own file, so that the sizes are mixed at every moment.
fn preprocess_throughput(
    pre: &crate::preprocess::Preprocessor,
    model_config: &serde_json::Value,
    files: &[Vec<u8>],
    threads: usize,
    rounds: u32,
) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || -> anyhow::Result<()> {
                    for _ in 0..rounds {
                        for i in 0..files.len() {
                            let file = &files[(i + t) % files.len()];
                            std::hint::black_box(crate::preprocess::prepare(pre, Some(model_config), file)?);
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().map_err(|_| anyhow::anyhow!("a preprocessing thread panicked"))?)
    })?;
    Ok((threads * files.len()) as f64 * f64::from(rounds) / t0.elapsed().as_secs_f64())
}

/// A cache started for the run; stopped on drop.
struct OwnCache {
    child: tokio::process::Child,
    dir: PathBuf,
}

impl Drop for OwnCache {
    fn drop(&mut self) {
        crate::embedded::terminate(&self.child);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn start_cache() -> anyhow::Result<(OwnCache, PathBuf)> {
    let dir = std::env::temp_dir().join(format!("mmserve-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let socket = dir.join("cache.sock");
    let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
    cmd.args(["embed-cache", "--socket"])
        .arg(&socket)
        // 64 values per row; room for ~16k items of 64 rows; 64 MiB of raw data.
        .args(["--embed-dim", "64", "--embed-cache-size", "256MiB", "--embed-cache-items", "16384"])
        .args(["--embed-cache-data-size", "64MiB"])
        .env_remove("MMSERVE_ADMIN_TOKEN");
    let ready = |line: &str| line.starts_with(mmserve_protocol::ready::READY_LINE).then_some(());
    let (child, ()) = crate::embedded::spawn_until(cmd, "the embed cache", Duration::from_secs(30), ready).await?;
    Ok((OwnCache { child, dir }, socket))
}

struct Outcome {
    items: u64,
    latencies_us: Vec<u32>,
    failures: u64,
}

async fn cache(b: CacheBench) -> anyhow::Result<()> {
    let (_own, socket) = match &b.socket {
        Some(s) => (None, s.clone()),
        None => {
            let (own, s) = start_cache().await?;
            (Some(own), s)
        }
    };
    let direct = b.direct;
    let connect = || async {
        if direct {
            let t = transport::connect(&socket, Duration::from_secs(5)).await?;
            return anyhow::Ok(Link::Direct(EmbedCacheClient::new(Default::default(), t).spawn()));
        }
        anyhow::Ok(Link::Coalesced(Arc::new(CacheConnection::connect(&socket, Duration::from_secs(5)).await?)))
    };
    // The hot set every client draws its hits from, made resident once.
    let hot: Arc<Vec<ItemDigest>> =
        Arc::new((0..256u32).map(|i| ItemDigest::compute(Modality::Image, "bench-hot", &i.to_le_bytes())).collect());
    let warm = connect().await?;
    for chunk in hot.chunks(32) {
        let items: Vec<AllocItem> = chunk.iter().map(|d| item(*d, b.tokens)).collect();
        let (a, grant) = warm.alloc(items).await.context("warming the hot set")?;
        warm.set_items_data(a.records.iter().map(|r| r.id).collect()).await;
        warm.release(grant).await;
    }
    let fresh = Arc::new(AtomicU64::new(0));
    if !b.json {
        let conns = if b.connections == 0 {
            "one connection per client".to_string()
        } else {
            format!("{} shared connections", b.connections)
        };
        let how = if b.direct { "one message per call" } else { "the api's coalescing client" };
        println!(
            "embed-cache alloc (+ set_items_data for misses) + release over a Unix socket, {conns}, {how}, {:.0}% hits, {} rows per item",
            b.hit_ratio * 100.0,
            b.tokens
        );
        println!(
            "{:>7} {:>5} {:>14} {:>12} {:>10} {:>10} {:>9}",
            "clients", "items", "item-allocs/s", "requests/s", "p50 (µs)", "p99 (µs)", "failures"
        );
    }
    for &n in &b.clients {
        for &k in &b.items {
            let conns = if b.connections == 0 { n } else { b.connections.min(n) };
            let links = futures::future::try_join_all((0..conns).map(|_| connect())).await?;
            let clients: Vec<Link> = (0..n).map(|c| links[c % conns].clone()).collect();
            let stop = Arc::new(AtomicBool::new(false));
            let start = Instant::now();
            let tasks: Vec<_> = clients
                .into_iter()
                .enumerate()
                .map(|(c, client)| {
                    let (hot, fresh, stop) = (hot.clone(), fresh.clone(), stop.clone());
                    let (tokens, hit_ratio) = (b.tokens, b.hit_ratio);
                    tokio::spawn(async move {
                        let mut out = Outcome { items: 0, latencies_us: Vec::new(), failures: 0 };
                        let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (c as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                        while !stop.load(Ordering::Relaxed) {
                            let items: Vec<AllocItem> = (0..k)
                                .map(|_| {
                                    rng ^= rng << 13;
                                    rng ^= rng >> 7;
                                    rng ^= rng << 17;
                                    let d = if (rng % 10_000) as f64 / 10_000.0 < hit_ratio {
                                        hot[(rng >> 20) as usize % hot.len()]
                                    } else {
                                        let n = fresh.fetch_add(1, Ordering::Relaxed);
                                        ItemDigest::compute(Modality::Image, "bench-fresh", &n.to_le_bytes())
                                    };
                                    item(d, tokens)
                                })
                                .collect();
                            let t0 = Instant::now();
                            let r = client.alloc(items).await;
                            let us = t0.elapsed().as_micros().min(u32::MAX as u128) as u32;
                            let Some((a, grant)) = r else {
                                out.failures += 1;
                                continue;
                            };
                            out.latencies_us.push(us);
                            out.items += k as u64;
                            let writers: Vec<u64> = a.records.iter().filter(|r| r.write_data).map(|r| r.id).collect();
                            if !writers.is_empty() {
                                client.set_items_data(writers).await;
                            }
                            client.release(grant).await;
                        }
                        out
                    })
                })
                .collect();
            tokio::time::sleep(Duration::from_secs_f64(b.seconds)).await;
            stop.store(true, Ordering::Relaxed);
            let outcomes = futures::future::try_join_all(tasks).await?;
            let elapsed = start.elapsed().as_secs_f64();
            let items: u64 = outcomes.iter().map(|o| o.items).sum();
            let failures: u64 = outcomes.iter().map(|o| o.failures).sum();
            let mut lat: Vec<u32> = outcomes.into_iter().flat_map(|o| o.latencies_us).collect();
            lat.sort_unstable();
            let pct = |p: f64| {
                lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1))).copied().unwrap_or(0)
            };
            let (rate, reqs) = (items as f64 / elapsed, lat.len() as f64 / elapsed);
            if b.json {
                println!(
                    "{}",
                    serde_json::json!({"clients": n, "items": k, "item_allocs_per_s": rate, "requests_per_s": reqs,
                                       "p50_us": pct(0.5), "p99_us": pct(0.99), "failures": failures})
                );
            } else {
                println!("{n:>7} {k:>5} {rate:>14.0} {reqs:>12.0} {:>10} {:>10} {failures:>9}", pct(0.5), pct(0.99));
            }
        }
    }
    Ok(())
}

fn item(digest: ItemDigest, tokens: u32) -> AllocItem {
    AllocItem { digest, modality: Modality::Image, token_num: tokens, data_len: 1024 }
}
