//! `mmserve`: one binary for every process of the server and its clients.
//!
//! `serve` starts and supervises the four service processes, each of which is this
//! same binary run with the service's subcommand (usable on its own, too).

mod bench;
mod bench_caption;
mod bench_engine;
mod bench_model;
mod bench_serve;
mod cache_cli;
mod caption;
mod config;
mod embedded;
mod logging;
mod preprocess;
mod prom;
mod serve;

use std::collections::HashSet;
use std::ffi::OsString;
use std::path::PathBuf;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "mmserve", version, about = "A multimodal LLM server: images in, text out")]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log lines as text, or as one JSON object each (filter with `MMSERVE_LOG`).
    #[arg(long, env = "MMSERVE_LOG_FORMAT", value_enum, default_value = "text", global = true)]
    log_format: logging::LogFormat,
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
    /// Caption (or transcribe) folders, lists and batch files; resumable.
    Caption(caption::CaptionArgs),
    /// Write what the encoder would receive for one image or audio file.
    Preprocess(preprocess::PreprocessArgs),
    /// Benchmarks against real services.
    #[command(subcommand)]
    Bench(bench::Bench),
}

fn main() -> anyhow::Result<()> {
    let (cli, settings) = parse()?;
    logging::init(cli.log_format);
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
            Command::Serve(args) => serve::run(args, settings.expect("serve's settings")).await,
            Command::EmbedCache(args) => Ok(mmserve_embed_cache::run(args, shutdown()).await?),
            Command::Encoder(args) => Ok(mmserve_encoder::run(args, shutdown()).await?),
            Command::Engine(args) => Ok(mmserve_engine::run(args, shutdown()).await?),
            Command::Api(args) => Ok(mmserve_api::run(args, shutdown()).await?),
            Command::Cache(cli) => cache_cli::run(cli).await,
            Command::Caption(args) => caption::run(args).await,
            Command::Bench(b) => bench::run(b).await,
            Command::Preprocess(args) => preprocess::run(args),
        }
    })
}

/// The command line: every service takes `--config FILE`, and `serve` takes every
/// service's settings too ([`config`]).
fn command() -> (clap::Command, Vec<clap::Command>) {
    let mut cmd = Cli::command();
    for name in config::SECTIONS {
        cmd = cmd.mut_subcommand(name, |c| {
            c.arg(config::config_arg(
                "TOML file of settings: its section named after this command (flags and variables win)",
            ))
        });
    }
    let children: Vec<clap::Command> =
        config::SECTIONS.iter().filter_map(|n| cmd.find_subcommand(n).cloned()).collect();
    let cmd = cmd.mut_subcommand("serve", |s| {
        let s = s.arg(config::config_arg(
            "TOML file of settings: [serve] as on this command line, and a section per service ([embed-cache], \
             [encoder], [engine], [api]); flags and variables win, then the service's section, then [serve]",
        ));
        config::with_child_settings(s, &children)
    });
    (cmd, children)
}

/// Parses the command line, with the `--config` file's settings where no flag or
/// variable gives them.
fn parse() -> anyhow::Result<(Cli, Option<serve::Settings>)> {
    let (cmd, children) = command();
    let argv: Vec<OsString> = std::env::args_os().collect();
    let mut matches = cmd.clone().get_matches_from(&argv);
    let (mut from_file, mut file) = (HashSet::new(), None);
    if let Some((name, sub)) = matches.subcommand()
        && let Ok(Some(path)) = sub.try_get_one::<PathBuf>("config")
    {
        let table = config::load(path)?;
        let sub_cmd = cmd.find_subcommand(name).expect("the matched subcommand");
        let (flags, ids) = config::file_flags(sub_cmd, sub, &table, name)?;
        if !flags.is_empty() {
            matches = cmd.clone().try_get_matches_from(argv.iter().cloned().chain(flags)).unwrap_or_else(|e| e.exit());
        }
        (from_file, file) = (ids, Some(table));
    }
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let settings = match matches.subcommand() {
        Some(("serve", m)) => Some(serve::Settings {
            command: cmd.find_subcommand("serve").cloned().expect("serve"),
            matches: m.clone(),
            from_file,
            file,
            children,
        }),
        _ => None,
    };
    Ok((cli, settings))
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
