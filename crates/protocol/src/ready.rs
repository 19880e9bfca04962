//! How a child process tells `serve` it is ready: one line on stdout, which `serve`
//! reads (with a timeout) instead of polling the socket.

use std::io::Write;

/// The line's prefix; the service's name follows.
pub const READY_LINE: &str = "mmserve-ready ";

/// Prints the readiness line and flushes it.
pub fn announce(service: &str) {
    announce_with(service, "");
}

/// Prints the readiness line with a detail after the name (the api's URL).
pub fn announce_with(service: &str, detail: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{READY_LINE}{service} {detail}");
    let _ = out.flush();
}

/// Parses a readiness line into (service, detail).
pub fn parse(line: &str) -> Option<(&str, &str)> {
    let rest = line.strip_prefix(READY_LINE)?;
    Some(rest.split_once(' ').unwrap_or((rest, "")))
}

/// Starts the thread a service cannot live without (the engine's model thread, the
/// encoder's worker). If it panics, the process exits at once with a clear log line:
/// a process whose worker is dead would answer `/health` and fail every request, and the
/// supervisor notices a dead child at once.
pub fn spawn_vital(name: &str, f: impl FnOnce() + Send + 'static) -> std::io::Result<std::thread::JoinHandle<()>> {
    let owned = name.to_string();
    std::thread::Builder::new().name(owned.clone()).spawn(move || {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
            tracing::error!("the {owned} thread panicked; the process exits so that it is noticed and replaced");
            std::process::exit(70);
        }
    })
}

/// Resolves on SIGINT or SIGTERM. The handlers are installed when this is called, not at
/// the first poll: a signal that came between a ready line and that poll would otherwise
/// kill the process by the default action, skipping its cleanup. Call it in a runtime.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing a SIGINT handler");
    async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
}
