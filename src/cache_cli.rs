//! `mmserve cache stats | ls [--stuck] | evict DIGEST | clear | drop DIGEST`: the embed cache's admin RPC from
//! the command line. Tables for people, `--json` for scripts.

use std::time::Duration;

use anyhow::{Context, bail};
use mmserve_embed_cache::AdminArgs;
use mmserve_protocol::{AdminError, CacheAdminClient, CacheStats, ItemInfo, ItemKey, deadline};
use tarpc::serde_transport::tcp;
use tarpc::tokio_serde::formats::Bincode;

#[derive(Debug, clap::Args)]
pub struct CacheCli {
    #[command(flatten)]
    pub admin: AdminArgs,
    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
    /// Longest connect, and longest call, in seconds.
    #[arg(long, global = true, env = "MMSERVE_CACHE_CLI_TIMEOUT_S", default_value_t = 5)]
    pub timeout_s: u64,
    #[command(subcommand)]
    pub op: Op,
}

#[derive(Debug, clap::Subcommand)]
pub enum Op {
    /// Counters and capacity.
    Stats,
    /// Every item, most recently used first.
    Ls {
        /// Only stuck items: referenced, but their bytes never came (the uploading
        /// request vanished or missed the data timeout).
        #[arg(long)]
        stuck: bool,
    },
    /// Evict the item with this digest (refused while it is in use).
    Evict { digest: ItemKey },
    /// Evict every item not in use.
    Clear,
    /// Drop a stuck item and the references that pin it (`--force`: any item; whatever
    /// still reads it may see its slots reused).
    Drop {
        digest: ItemKey,
        #[arg(long)]
        force: bool,
    },
}

pub async fn run(cli: CacheCli) -> anyhow::Result<()> {
    let timeout = Duration::from_secs(cli.timeout_s.max(1));
    let Some(token) = cli.admin.token()? else {
        bail!("no admin token: pass --admin-token, set MMSERVE_ADMIN_TOKEN or use --admin-token-file");
    };
    let addr = &cli.admin.admin_addr;
    let transport = tokio::time::timeout(timeout, tcp::connect(addr, Bincode::default))
        .await
        .map_err(|_| anyhow::anyhow!("the embed-cache admin listener at {addr} did not answer within 5 s"))?
        .with_context(|| {
            format!(
                "cannot reach the embed-cache admin listener at {addr} (is the server running, with an admin token?)"
            )
        })?;
    let client = CacheAdminClient::new(Default::default(), transport).spawn();
    let ctx = || deadline(timeout);
    let unreachable = |e| anyhow::anyhow!("the embed-cache admin listener at {addr} failed: {e}");
    match cli.op {
        Op::Stats => {
            let s = client.stats(ctx(), token).await.map_err(unreachable)?.map_err(admin_error)?;
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                print_stats(&s);
            }
        }
        Op::Ls { stuck } => {
            let mut items = client.list(ctx(), token).await.map_err(unreachable)?.map_err(admin_error)?;
            items.retain(|i| i.stuck || !stuck);
            if cli.json {
                println!("{}", serde_json::to_string_pretty(&items)?);
            } else {
                print_items(&items);
            }
        }
        Op::Evict { digest } => {
            let n = client.evict(ctx(), token, digest).await.map_err(unreachable)?.map_err(admin_error)?;
            if cli.json {
                println!("{}", serde_json::json!({"evicted": n}));
            } else {
                println!("evicted {n} item{} with digest {digest}", if n == 1 { "" } else { "s" });
            }
        }
        Op::Clear => {
            let n = client.clear(ctx(), token).await.map_err(unreachable)?.map_err(admin_error)?;
            if cli.json {
                println!("{}", serde_json::json!({"evicted": n}));
            } else {
                println!("evicted {n} unreferenced item{}", if n == 1 { "" } else { "s" });
            }
        }
        Op::Drop { digest, force } => {
            let n = client.drop_item(ctx(), token, digest, force).await.map_err(unreachable)?.map_err(admin_error)?;
            if cli.json {
                println!("{}", serde_json::json!({"dropped": n}));
            } else {
                println!("dropped {n} item{} with digest {digest}", if n == 1 { "" } else { "s" });
            }
        }
    }
    Ok(())
}

fn admin_error(e: AdminError) -> anyhow::Error {
    match e {
        AdminError::Unauthorized => anyhow::anyhow!("the admin token was refused"),
        other => anyhow::anyhow!("{other}"),
    }
}

fn print_stats(s: &CacheStats) {
    let pct = |a: u64, b: u64| if b == 0 { 0.0 } else { 100.0 * a as f64 / b as f64 };
    let lookups = s.hits + s.misses;
    let rows = [
        ("items", format!("{} of {}", s.items, s.max_items)),
        ("slots used", format!("{} of {} ({:.1}%)", s.slots_used, s.slots_total, pct(s.slots_used, s.slots_total))),
        ("slots free", (s.slots_total - s.slots_used).to_string()),
        ("largest free block", s.largest_free_block.to_string()),
        ("references held", s.references.to_string()),
        ("hits", format!("{} ({:.1}% of {lookups})", s.hits, pct(s.hits, lookups))),
        ("misses", s.misses.to_string()),
        ("evictions", s.evictions.to_string()),
        ("raw bytes", format!("{} of {}", s.data_bytes, s.data_bytes_total)),
        ("waiting requests", s.waiting.to_string()),
        ("cancelled leases", s.cancelled_leases.to_string()),
    ];
    for (k, v) in rows {
        println!("{k:<20} {v}");
    }
}

fn human_ms(ms: u64) -> String {
    match ms {
        0..1000 => format!("{ms}ms"),
        1000..60_000 => format!("{:.1}s", ms as f64 / 1e3),
        60_000..3_600_000 => format!("{:.1}m", ms as f64 / 6e4),
        _ => format!("{:.1}h", ms as f64 / 3.6e6),
    }
}

fn print_items(items: &[ItemInfo]) {
    println!(
        "{:<32}  {:<8} {:>12} {:>6} {:>5} {:>10} {:>6} {:>8} {:>8}",
        "DIGEST", "MODALITY", "SLOTS", "COUNT", "REFS", "BYTES", "READY", "IDLE", "AGE"
    );
    for i in items {
        println!(
            "{:<32}  {:<8} {:>12} {:>6} {:>5} {:>10} {:>6} {:>8} {:>8}",
            i.digest.to_string(),
            i.modality.to_string(),
            format!("{}..", i.start_slot),
            i.slots,
            i.references,
            i.data_bytes,
            match (i.embed_ready, i.stuck, i.data_ready) {
                (true, _, _) => "yes",
                (false, true, _) => "STUCK",
                (false, false, true) => "no",
                (false, false, false) => "nodata",
            },
            human_ms(i.idle_ms),
            human_ms(i.age_ms)
        );
    }
    println!("{} item{}", items.len(), if items.len() == 1 { "" } else { "s" });
}
