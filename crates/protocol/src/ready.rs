//! How a child process tells `serve` it is ready: one line on stdout, which `serve`
//! reads (with a timeout) instead of polling the socket.

use std::io::Write;

/// The line's prefix; the service's name follows.
pub const READY_LINE: &str = "mmserve-ready ";

/// Prints the readiness line and flushes it.
pub fn announce(service: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{READY_LINE}{service}");
    let _ = out.flush();
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing a SIGINT handler");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
