//! `mmserve`: one binary for every process of the server and its clients.
//!
//! `serve` starts and supervises the four service processes, each of which is this
//! same binary run with the service's subcommand (usable on its own, too).

mod bench;
mod bench_engine;
mod bench_model;
mod cache_cli;
mod preprocess;
mod serve;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "mmserve", version, about = "A multimodal LLM server: images in, text out")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start the server: embed-cache, encoder, engine and api processes.
    Serve(serve::ServeArgs),
    /// Run the embed-cache service alone.
    EmbedCache(mmserve_embed_cache::CacheArgs),
    /// Run the encoder service alone.
    Encoder(mmserve_encoder::EncoderArgs),
    /// Run the engine service alone.
    Engine(mmserve_engine::EngineArgs),
    /// Run the HTTP api service alone.
    Api(mmserve_api::ApiArgs),
    /// Inspect and manage a running embed cache (its admin listener).
    Cache(cache_cli::CacheCli),
    /// Write what the encoder would receive for one image or audio file.
    Preprocess(preprocess::PreprocessArgs),
    /// Benchmarks against real services.
    #[command(subcommand)]
    Bench(bench::Bench),
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MMSERVE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let cli = Cli::parse();
    keep_freed_memory();
    // The cache decides everything under one lock in microseconds: one thread serves it
    // best (no work stealing, no lock handoffs between threads). The others use all cores.
    let rt = match cli.command {
        Command::EmbedCache(_) | Command::Bench(_) | Command::Preprocess(_) => {
            tokio::runtime::Builder::new_current_thread().enable_all().build()?
        }
        _ => tokio::runtime::Builder::new_multi_thread().enable_all().build()?,
    };
    let shutdown = mmserve_protocol::ready::shutdown_signal;
    rt.block_on(async move {
        match cli.command {
            Command::Serve(args) => serve::run(args).await,
            Command::EmbedCache(args) => Ok(mmserve_embed_cache::run(args, shutdown()).await?),
            Command::Encoder(args) => Ok(mmserve_encoder::run(args, shutdown()).await?),
            Command::Engine(args) => Ok(mmserve_engine::run(args, shutdown()).await?),
            Command::Api(args) => Ok(mmserve_api::run(args, shutdown()).await?),
            Command::Cache(cli) => cache_cli::run(cli).await,
            Command::Bench(b) => bench::run(b).await,
            Command::Preprocess(args) => preprocess::run(args),
        }
    })
}

/// Keeps freed buffers in the heap for reuse instead of returning them to the kernel.
/// glibc hands allocations above its mmap threshold (128 KiB at first) to fresh `mmap`s and
/// unmaps them on free, and trims the heap's top: every decoded image and feature buffer
/// then pays page faults and zeroing for every page, which was 30% of preprocessing a
/// 512² JPEG. No allocation goes to its own `mmap` (`M_MMAP_MAX` 0): even above the
/// largest threshold glibc takes (32 MiB), a Qwen2-VL 2048² image's 100 MB of
/// `pixel_values` paid a quarter of its time in page faults. The heap keeps up to 256 MiB
/// of free memory at its top before giving it back.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's tunables; it is called before any
    // thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}
