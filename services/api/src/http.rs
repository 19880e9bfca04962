//! The HTTP listener. Each accepted connection takes one of `--max-connections` places
//! (the rest wait in the kernel's backlog) and is served by hyper's HTTP/1 with a
//! header read timeout, so connections that send their headers slowly, or never, are
//! closed instead of held forever; bodies have their own timeout where they are read
//! (`routes::read_body`). TCP_NODELAY on every connection: tokens stream as small
//! writes, and Nagle would hold each behind the client's delayed ACK (40 ms).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    /// How long open connections get to finish at shutdown.
    pub shutdown_grace: Duration,
}

/// Serves `app` until `shutdown` resolves, then lets open connections finish their
/// requests (at most `limits.shutdown_grace`).
pub async fn serve(listener: TcpListener, app: Router, limits: HttpLimits, shutdown: impl Future<Output = ()>) {
    let max = limits.max_connections.clamp(1, u32::MAX as usize);
    let places = Arc::new(Semaphore::new(max));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut backoff = Duration::from_millis(10);
    tokio::pin!(shutdown);
    loop {
        let place = tokio::select! {
            p = places.clone().acquire_owned() => p.expect("never closed"),
            _ = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, peer)) => {
                    backoff = Duration::from_millis(10);
                    (stream, peer)
                }
                Err(e) => {
                    // Out of descriptors, say: retrying at once would spin.
                    tracing::warn!("accept failed: {e}; pausing {backoff:?}");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = &mut shutdown => break,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        if let Err(e) = stream.set_nodelay(true) {
            tracing::warn!("TCP_NODELAY: {e}");
        }
        // Each request learns its peer (the access log's client address).
        let peer = crate::access::ClientAddr(peer);
        let service = TowerToHyperService::new(tower::ServiceExt::map_request(
            app.clone(),
            move |mut r: axum::http::Request<hyper::body::Incoming>| {
                r.extensions_mut().insert(peer);
                r
            },
        ));
        let mut stop = stop_rx.clone();
        let grace = limits.shutdown_grace;
        tokio::spawn(async move {
            let _place = place;
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = async { stop.wait_for(|&s| s).await.map(drop) } => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(grace, conn).await;
                }
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // Every connection gives its place back when it ends.
    let _ = tokio::time::timeout(limits.shutdown_grace * 2, places.acquire_many(max as u32)).await;
}
