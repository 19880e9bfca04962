//! Child processes of the client subcommands (`bench`, `caption`): a `mmserve serve` or a
//! single service of our own, started on the same binary, read until ready, stopped on
//! drop.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, BufReader};

/// A `mmserve serve` of our own, on a free port; stopped (SIGTERM) when dropped.
pub struct OwnServer {
    child: tokio::process::Child,
    pub url: String,
}

impl Drop for OwnServer {
    fn drop(&mut self) {
        terminate(&self.child);
    }
}

impl OwnServer {
    /// Starts it serving `model` with `extra` flags and waits (at most `wait`) until it serves.
    pub async fn start(model: &Path, extra: &[String]) -> anyhow::Result<Self> {
        let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
        cmd.arg("serve");
        // A free port unless the caller names one.
        if !extra.iter().any(|a| a == "--port" || a.starts_with("--port=")) {
            cmd.args(["--port", "0"]);
        }
        cmd.arg("--model").arg(model).args(extra);
        let url = |line: &str| line.strip_prefix("mmserve: serving ")?.split(" at ").nth(1).map(str::to_string);
        let (child, url) = spawn_until(cmd, "mmserve serve", Duration::from_secs(300), url).await?;
        Ok(OwnServer { child, url })
    }

    /// SIGTERM, then waits for it to exit (at most 30 s).
    pub async fn stop(mut self) {
        terminate(&self.child);
        let _ = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await;
    }
}

/// Starts `cmd` (quiet logs, stdout piped, killed on drop) and reads its stdout until
/// `ready` finds what it waits for in a line, at most `wait`; then drains the rest of
/// stdout so the child never blocks on a full pipe.
pub async fn spawn_until<T>(
    mut cmd: tokio::process::Command,
    what: &str,
    wait: Duration,
    ready: impl Fn(&str) -> Option<T>,
) -> anyhow::Result<(tokio::process::Child, T)> {
    // SAFETY: prctl is async-signal-safe and touches no memory of ours: the kernel sends
    // the child SIGTERM when this process dies, even by SIGKILL, so no server outlives
    // the client that started it.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .env("MMSERVE_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
    let found = tokio::time::timeout(wait, async {
        while let Ok(Some(line)) = lines.next_line().await {
            if let Some(v) = ready(&line) {
                return Some(v);
            }
        }
        None
    })
    .await;
    let Ok(Some(v)) = found else { bail!("{what} did not come up within {wait:?}") };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok((child, v))
}

/// SIGTERM to a child we started (it shuts down cleanly, removing its segments).
pub fn terminate(child: &tokio::process::Child) {
    if let Some(pid) = child.id() {
        // SAFETY: signalling our own child, whose pid `child` still holds.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    }
}
