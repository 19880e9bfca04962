//! `mmserve serve`: starts the four processes in dependency order, waits (with a
//! timeout) for each one's readiness line, prints the URL, and supervises. On Ctrl-C or
//! SIGTERM, or when a child dies, it stops every child and removes every shared-memory
//! segment and socket of the run.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use mmserve_config::ModelDir;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};
use tokio::sync::mpsc;

#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Hugging Face model directory.
    #[arg(long, env = "MMSERVE_MODEL", default_value = "assets/models/llava-tiny")]
    pub model: PathBuf,
    #[arg(long, env = "MMSERVE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// 0 picks a free port.
    #[arg(long, env = "MMSERVE_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Use the embed-cache service at this socket instead of starting one.
    #[arg(long, env = "MMSERVE_EMBED_CACHE_SOCKET")]
    pub embed_cache_socket: Option<PathBuf>,
    #[command(flatten)]
    pub cache: mmserve_embed_cache::CapacityArgs,
    #[command(flatten)]
    pub admin: mmserve_embed_cache::AdminArgs,
    #[command(flatten)]
    pub admin_limits: mmserve_embed_cache::AdminLimitArgs,
    /// Longest wait in line for embed-cache capacity, in seconds (then 503).
    #[arg(long, env = "MMSERVE_EMBED_CACHE_WAIT_TIMEOUT_S", default_value_t = 30)]
    pub embed_cache_wait_timeout_s: u64,
    #[command(flatten)]
    pub media: mmserve_api::MediaArgs,
    #[command(flatten)]
    pub load: mmserve_api::LoadArgs,
    #[command(flatten)]
    pub prompt: mmserve_api::PromptArgs,
    /// Most sequences decoding at once.
    #[arg(long, env = "MMSERVE_MAX_RUNNING_REQUESTS", default_value_t = 32)]
    pub max_running_requests: usize,
    #[command(flatten)]
    pub kv: mmserve_engine::KvArgs,
    #[command(flatten)]
    pub placement: mmserve_models::PlacementArgs,
    /// Longest wait for one process to become ready, in seconds.
    #[arg(long, env = "MMSERVE_READY_TIMEOUT_S", default_value_t = 300)]
    pub ready_timeout_s: u64,
}

/// How long a child gets to exit after SIGTERM before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

struct Running {
    name: &'static str,
    pid: u32,
}

/// Where this run keeps its sockets and how its shared memory is named. The directory
/// holds a `lock` file this process keeps `flock`ed while it lives, so a later start
/// knows whether the run is gone, whatever PID namespace it ran in.
struct RunPaths {
    dir: PathBuf,
    shm_prefix: String,
    _lock: std::fs::File,
}

impl RunPaths {
    fn new() -> anyhow::Result<Self> {
        let swept = sweep_dead_run_dirs(&std::env::temp_dir());
        if swept > 0 {
            tracing::info!("removed {swept} run directories of mmserve processes that are gone");
        }
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.subsec_nanos();
        let tag = format!("{}-{nanos:08x}", std::process::id());
        let dir = std::env::temp_dir().join(format!("mmserve-{tag}"));
        // Made under another name and renamed once locked: a sweep never sees it unlocked.
        let making = std::env::temp_dir().join(format!("mmserve-{tag}.new"));
        std::fs::create_dir(&making).with_context(|| format!("creating {}", making.display()))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&making, std::fs::Permissions::from_mode(0o700))?;
        let lock = std::fs::File::create(making.join("lock"))?;
        anyhow::ensure!(try_lock(&lock), "locking {}", making.display());
        std::fs::rename(&making, &dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(RunPaths { dir, shm_prefix: format!("mmserve-{tag}"), _lock: lock })
    }

    fn socket(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.sock"))
    }
}

/// Removes `mmserve-<pid>-<tag>` run directories whose `serve` process is gone (killed
/// with its whole group, say: it had no chance to remove its own): their `lock` file is
/// no longer locked (or, for a directory without one, the pid is gone). A directory of a
/// live run, or of another user, is left alone.
fn sweep_dead_run_dirs(tmp: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(tmp) else { return 0 };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(run_dir_pid) else { continue };
        let dead = match std::fs::File::open(entry.path().join("lock")) {
            Ok(lock) => try_lock(&lock),
            Err(_) => pid != std::process::id() && !process_alive(pid),
        };
        if dead && std::fs::remove_dir_all(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Takes `flock(LOCK_EX)` without waiting; false if another process holds it.
fn try_lock(f: &std::fs::File) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor we own; it touches no memory.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// The pid in a run directory's name (`mmserve-<pid>-<8 hex digits>`).
fn run_dir_pid(name: &str) -> Option<u32> {
    let (pid, tag) = name.strip_prefix("mmserve-")?.split_once('-')?;
    (tag.len() == 8 && tag.bytes().all(|b| b.is_ascii_hexdigit())).then_some(())?;
    pid.parse().ok()
}

fn process_alive(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else { return false };
    // SAFETY: signal 0 checks for existence only; nothing is delivered.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let dir = ModelDir::open(&args.model).with_context(|| format!("opening model {}", args.model.display()))?;
    let paths = RunPaths::new()?;
    let (exit_tx, mut exit_rx) = mpsc::channel::<(&'static str, std::io::Result<ExitStatus>)>(8);
    let mut running: Vec<Running> = Vec::new();
    let started = start_all(&args, &dir, &paths, &exit_tx, &mut running).await;
    let mut exited: Vec<&'static str> = Vec::new();
    let outcome = match started {
        Err(e) => Err(e),
        Ok(url) => {
            println!("mmserve: serving {} at {url}", dir.name);
            tokio::select! {
                _ = mmserve_protocol::ready::shutdown_signal() => {
                    eprintln!("mmserve: shutting down");
                    Ok(())
                }
                Some((name, status)) = exit_rx.recv() => {
                    exited.push(name);
                    Err(anyhow::anyhow!("the {name} process exited unexpectedly ({})", describe(status)))
                }
            }
        }
    };
    stop_all(&running, exited, &mut exit_rx).await;
    let removed = mmserve_shm::remove_with_prefix(&paths.shm_prefix);
    if removed > 0 {
        tracing::info!("removed {removed} shared-memory segments left by stopped processes");
    }
    let _ = std::fs::remove_dir_all(&paths.dir);
    outcome
}

fn describe(status: std::io::Result<ExitStatus>) -> String {
    match status {
        Ok(s) => s.to_string(),
        Err(e) => format!("wait failed: {e}"),
    }
}

/// Starts the processes in order; returns the api's URL.
async fn start_all(
    args: &ServeArgs,
    dir: &ModelDir,
    paths: &RunPaths,
    exit_tx: &mpsc::Sender<(&'static str, std::io::Result<ExitStatus>)>,
    running: &mut Vec<Running>,
) -> anyhow::Result<String> {
    let model = args.model.to_string_lossy().into_owned();
    let cache_socket = args.embed_cache_socket.clone().unwrap_or_else(|| paths.socket("embed-cache"));
    let s = |p: &Path| p.to_string_lossy().into_owned();
    let cap = &args.cache;
    // Refused here, with the model named, rather than by the cache child's flag parser.
    let embed_dtype: mmserve_protocol::ArenaDtype =
        dir.config.dtype().parse().map_err(|e| anyhow::anyhow!("{model}: config.json: {e}"))?;
    let mut cache_args = vec![
        "--socket".into(),
        s(&cache_socket),
        "--shm-prefix".into(),
        paths.shm_prefix.clone(),
        "--embed-dim".into(),
        dir.config.lm_hidden_size().to_string(),
        "--embed-dtype".into(),
        embed_dtype.name().into(),
        "--embed-cache-size".into(),
        cap.embed_cache_size.0.to_string(),
        "--embed-cache-data-size".into(),
        cap.embed_cache_data_size.0.to_string(),
        "--embed-cache-items".into(),
        cap.embed_cache_items.to_string(),
        "--embed-cache-request-share".into(),
        cap.embed_cache_request_share.to_string(),
        "--embed-cache-data-timeout-s".into(),
        cap.embed_cache_data_timeout_s.to_string(),
        "--admin-addr".into(),
        args.admin.admin_addr.clone(),
    ];
    cache_args.extend(args.admin_limits.to_args());
    if let Some(f) = &args.admin.admin_token_file {
        cache_args.extend(["--admin-token-file".into(), s(f)]);
    }
    let mut encoder_args = vec![
        "--socket".into(),
        s(&paths.socket("encoder")),
        "--cache-socket".into(),
        s(&cache_socket),
        "--model".into(),
        model.clone(),
    ];
    let mut engine_args = vec![
        "--socket".into(),
        s(&paths.socket("engine")),
        "--cache-socket".into(),
        s(&cache_socket),
        "--model".into(),
        model.clone(),
        "--max-running-requests".into(),
        args.max_running_requests.to_string(),
    ];
    engine_args.extend(args.kv.to_args());
    encoder_args.extend(args.placement.to_args());
    engine_args.extend(args.placement.to_args());
    let mut api_args = vec![
        "--host".into(),
        args.host.clone(),
        "--port".into(),
        args.port.to_string(),
        "--model".into(),
        model,
        "--cache-socket".into(),
        s(&cache_socket),
        "--encoder-socket".into(),
        s(&paths.socket("encoder")),
        "--engine-socket".into(),
        s(&paths.socket("engine")),
        "--embed-cache-wait-timeout-s".into(),
        args.embed_cache_wait_timeout_s.to_string(),
    ];
    api_args.extend(args.media.to_args());
    api_args.extend(args.load.to_args());
    api_args.extend(args.prompt.to_args());
    let timeout = Duration::from_secs(args.ready_timeout_s);
    if args.embed_cache_socket.is_none() {
        // The token travels in the environment, not on the command line (ps shows that).
        let env: Vec<(&str, String)> =
            args.admin.admin_token.iter().map(|t| ("MMSERVE_ADMIN_TOKEN", t.clone())).collect();
        let (admin, cache) = start_one("embed-cache", cache_args, &env, timeout, exit_tx).await?;
        if !admin.is_empty() {
            println!("mmserve: embed-cache admin listener at {admin}");
        }
        running.push(cache);
    }
    // The encoder and the engine load their weights at the same time.
    let (encoder, engine) = tokio::join!(
        start_one("encoder", encoder_args, &[], timeout, exit_tx),
        start_one("engine", engine_args, &[], timeout, exit_tx)
    );
    let (encoder, engine) = (encoder.map(|r| running.push(r.1)), engine.map(|r| running.push(r.1)));
    encoder?;
    engine?;
    let (url, api) = start_one("api", api_args, &[], timeout, exit_tx).await?;
    running.push(api);
    Ok(url)
}

/// Spawns `mmserve <name> <args>` and waits for its readiness line; returns the line's
/// detail. A child that exits or stays silent past `timeout` is killed and reported.
async fn start_one(
    name: &'static str,
    args: Vec<String>,
    env: &[(&str, String)],
    timeout: Duration,
    exit_tx: &mpsc::Sender<(&'static str, std::io::Result<ExitStatus>)>,
) -> anyhow::Result<(String, Running)> {
    let exe = std::env::current_exe().context("locating the mmserve binary")?;
    let mut cmd = Command::new(exe);
    cmd.arg(name).args(&args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
    // Children get their settings as flags; a token only from here.
    cmd.env_remove("MMSERVE_ADMIN_TOKEN");
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent; it asks the
    // kernel to SIGTERM the child when `serve` dies, so no child outlives a killed supervisor.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child: Child = cmd.spawn().with_context(|| format!("starting the {name} process"))?;
    let pid = child.id().unwrap_or(0);
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut lines = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(timeout, wait_ready(name, &mut lines)).await;
    let detail = match ready {
        Ok(Ok(detail)) => detail,
        Ok(Err(e)) => {
            let status = child.wait().await;
            bail!("the {name} process {e} ({})", describe(status));
        }
        Err(_) => {
            let _ = child.kill().await;
            bail!("the {name} process was not ready within {} s", timeout.as_secs());
        }
    };
    tracing::info!("{name} ready (pid {pid})");
    tokio::spawn(async move {
        // Keep forwarding what the child prints.
        while let Ok(Some(line)) = lines.next_line().await {
            println!("{line}");
        }
    });
    let tx = exit_tx.clone();
    tokio::spawn(async move {
        let status = child.wait().await;
        let _ = tx.send((name, status)).await;
    });
    Ok((detail, Running { name, pid }))
}

async fn wait_ready(name: &str, lines: &mut tokio::io::Lines<BufReader<ChildStdout>>) -> Result<String, String> {
    loop {
        match lines.next_line().await {
            Ok(Some(line)) => match mmserve_protocol::ready::parse(&line) {
                Some((service, detail)) if service == name => return Ok(detail.trim().to_string()),
                _ => println!("{line}"),
            },
            Ok(None) => return Err("exited before it was ready".into()),
            Err(e) => return Err(format!("could not be read: {e}")),
        }
    }
}

/// Stops the children one at a time, the api first (so no request is cut off by a
/// service behind it vanishing): SIGTERM, then SIGKILL if one is still there after the
/// grace time.
async fn stop_all(
    running: &[Running],
    mut gone: Vec<&'static str>,
    exits: &mut mpsc::Receiver<(&'static str, std::io::Result<ExitStatus>)>,
) {
    for r in running.iter().rev() {
        if gone.contains(&r.name) {
            continue;
        }
        signal(r.pid, libc::SIGTERM);
        let deadline = tokio::time::Instant::now() + STOP_GRACE;
        loop {
            match tokio::time::timeout_at(deadline, exits.recv()).await {
                Ok(Some((name, _))) => {
                    gone.push(name);
                    if name == r.name {
                        break;
                    }
                }
                Ok(None) => return,
                Err(_) => {
                    tracing::warn!("the {} process did not stop in time; killing it", r.name);
                    signal(r.pid, libc::SIGKILL);
                    break;
                }
            }
        }
    }
}

fn signal(pid: u32, sig: i32) {
    if let Ok(pid) = i32::try_from(pid)
        && pid > 0
    {
        // SAFETY: kill(2) with a pid we spawned; it has no memory effects on us.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}
