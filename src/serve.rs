//! `mmserve serve`: resolves the run's configuration ([`config`]), starts the four
//! processes in dependency order, each with its section of it, waits (with a timeout)
//! for each one's readiness line, prints the URL, and supervises. On Ctrl-C or
//! SIGTERM, or when a child dies, it stops every child and removes every shared-memory
//! segment and socket of the run.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};
use mmserve_config::ModelDir;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};
use tokio::sync::mpsc;

use crate::config;

/// What only `serve` has; every service's settings are added to its command by
/// [`config::with_child_settings`](crate::config::with_child_settings).
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Hugging Face model directory (every service serves this one).
    #[arg(long, env = "MMSERVE_MODEL", default_value = "assets/models/llava-tiny")]
    pub model: PathBuf,
    /// Use the embed-cache service at this socket instead of starting one.
    #[arg(long, env = "MMSERVE_EMBED_CACHE_SOCKET")]
    pub embed_cache_socket: Option<PathBuf>,
    /// Longest wait for one process to become ready, in seconds.
    #[arg(long, env = "MMSERVE_READY_TIMEOUT_S", default_value_t = 300)]
    pub ready_timeout_s: u64,
    /// How long a child gets to exit after SIGTERM before SIGKILL, in seconds.
    #[arg(long, env = "MMSERVE_STOP_GRACE_S", default_value_t = 10)]
    pub stop_grace_s: u64,
    /// Print the resolved configuration (a file for --config) and exit.
    #[arg(long)]
    pub print_config: bool,
}

/// `serve`'s parsed command line with what resolving the children's settings needs.
pub struct Settings {
    pub command: clap::Command,
    pub matches: clap::ArgMatches,
    /// Ids that `[serve]` of the `--config` file set.
    pub from_file: HashSet<String>,
    pub file: Option<toml::Table>,
    pub children: Vec<clap::Command>,
}

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

pub async fn run(args: ServeArgs, settings: Settings) -> anyhow::Result<()> {
    let sections =
        config::resolve_children(&settings.matches, &settings.from_file, settings.file.as_ref(), &settings.children)?;
    let resolved = config::render(&settings.command, &settings.matches, &sections);
    if args.print_config {
        print!("{resolved}");
        return Ok(());
    }
    // Listening for the signal from here on: one during start-up stops what has started
    // (the child being started is killed on drop); one after the ready line stops all.
    let mut shutdown = std::pin::pin!(mmserve_protocol::ready::shutdown_signal());
    let admin_token = settings.matches.get_one::<String>("admin_token").cloned();
    let api_keys: Vec<String> =
        settings.matches.get_many::<String>("api_key").map(|k| k.cloned().collect()).unwrap_or_default();
    let dir = ModelDir::open(&args.model).with_context(|| format!("opening model {}", args.model.display()))?;
    let paths = RunPaths::new()?;
    let config_file = paths.dir.join("config.toml");
    std::fs::write(&config_file, &resolved).with_context(|| format!("writing {}", config_file.display()))?;
    let (exit_tx, mut exit_rx) = mpsc::channel::<(&'static str, std::io::Result<ExitStatus>)>(8);
    let mut running: Vec<Running> = Vec::new();
    let run = Run { args: &args, dir: &dir, paths: &paths, config_file: &config_file, admin_token, api_keys };
    let started = tokio::select! {
        started = run.start_all(&exit_tx, &mut running) => Some(started),
        _ = &mut shutdown => None,
    };
    let mut exited: Vec<&'static str> = Vec::new();
    let outcome = match started {
        None => {
            tracing::info!("shutting down");
            Ok(())
        }
        Some(Err(e)) => Err(e),
        Some(Ok(url)) => {
            println!("mmserve: serving {} at {url}", dir.name);
            tokio::select! {
                _ = &mut shutdown => {
                    tracing::info!("shutting down");
                    Ok(())
                }
                Some((name, status)) = exit_rx.recv() => {
                    exited.push(name);
                    Err(anyhow::anyhow!("the {name} process exited unexpectedly ({})", describe(status)))
                }
            }
        }
    };
    stop_all(&running, exited, &mut exit_rx, Duration::from_secs(args.stop_grace_s)).await;
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

/// One run's wiring: what each child gets besides its section of the configuration.
struct Run<'a> {
    args: &'a ServeArgs,
    dir: &'a ModelDir,
    paths: &'a RunPaths,
    config_file: &'a Path,
    admin_token: Option<String>,
    /// `--api-key`s, handed to the api in its environment (never in a file or argv).
    api_keys: Vec<String>,
}

impl Run<'_> {
    /// `--config` and the wiring flags of child `name`.
    fn child_args(&self, wiring: &[(&str, String)]) -> Vec<String> {
        let mut a = vec![format!("--config={}", self.config_file.display())];
        a.extend(wiring.iter().map(|(flag, value)| format!("--{flag}={value}")));
        a
    }

    /// Starts the processes in order; returns the api's URL.
    async fn start_all(
        &self,
        exit_tx: &mpsc::Sender<(&'static str, std::io::Result<ExitStatus>)>,
        running: &mut Vec<Running>,
    ) -> anyhow::Result<String> {
        let (args, paths) = (self.args, self.paths);
        let model = args.model.to_string_lossy().into_owned();
        let s = |p: &Path| p.to_string_lossy().into_owned();
        let cache_socket = s(&args.embed_cache_socket.clone().unwrap_or_else(|| paths.socket("embed-cache")));
        let (encoder_socket, engine_socket) = (s(&paths.socket("encoder")), s(&paths.socket("engine")));
        // Refused here, with the model named, rather than by the cache child's flag parser.
        let embed_dtype: mmserve_protocol::ArenaDtype =
            self.dir.config.dtype().parse().map_err(|e| anyhow::anyhow!("{model}: config.json: {e}"))?;
        let timeout = Duration::from_secs(args.ready_timeout_s);
        if args.embed_cache_socket.is_none() {
            let cache_args = self.child_args(&[
                ("socket", cache_socket.clone()),
                ("shm-prefix", paths.shm_prefix.clone()),
                ("embed-dim", self.dir.config.lm_hidden_size().to_string()),
                ("embed-dtype", embed_dtype.name().into()),
            ]);
            // The token travels in the environment, not on the command line (ps shows that).
            let env: Vec<(&str, String)> =
                self.admin_token.iter().map(|t| ("MMSERVE_ADMIN_TOKEN", t.clone())).collect();
            let (admin, cache) = start_one("embed-cache", cache_args, &env, timeout, exit_tx).await?;
            if !admin.is_empty() {
                println!("mmserve: embed-cache admin listener at {admin}");
            }
            running.push(cache);
        }
        let tower = |socket: &str| {
            self.child_args(&[
                ("socket", socket.into()),
                ("cache-socket", cache_socket.clone()),
                ("model", model.clone()),
            ])
        };
        // The encoder and the engine load their weights at the same time.
        let (encoder, engine) = tokio::join!(
            start_one("encoder", tower(&encoder_socket), &[], timeout, exit_tx),
            start_one("engine", tower(&engine_socket), &[], timeout, exit_tx)
        );
        let (encoder, engine) = (encoder.map(|r| running.push(r.1)), engine.map(|r| running.push(r.1)));
        encoder?;
        engine?;
        let api_args = self.child_args(&[
            ("model", model.clone()),
            ("cache-socket", cache_socket.clone()),
            ("encoder-socket", encoder_socket),
            ("engine-socket", engine_socket),
        ]);
        let env: Vec<(&str, String)> =
            (!self.api_keys.is_empty()).then(|| ("MMSERVE_API_KEY", self.api_keys.join(","))).into_iter().collect();
        let (url, api) = start_one("api", api_args, &env, timeout, exit_tx).await?;
        running.push(api);
        Ok(url)
    }
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
    // Until its waiter below owns it, a child whose start is abandoned is killed.
    cmd.kill_on_drop(true);
    // A child's settings are its section of the run's file, whole: no variable of ours
    // (but the log filter) reaches it, and a token only from here.
    for (key, _) in std::env::vars_os() {
        if key.to_str().is_some_and(|k| k.starts_with("MMSERVE_") && k != "MMSERVE_LOG") {
            cmd.env_remove(key);
        }
    }
    cmd.env("MMSERVE_LOG_FORMAT", crate::logging::format().name());
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    // Its own process group: a terminal's Ctrl-C reaches `serve` alone, which stops the
    // children in order (the api first), instead of every process at once.
    cmd.process_group(0);
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
    grace: Duration,
) {
    for r in running.iter().rev() {
        if gone.contains(&r.name) {
            continue;
        }
        signal(r.pid, libc::SIGTERM);
        let deadline = tokio::time::Instant::now() + grace;
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
