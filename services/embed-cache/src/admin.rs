//! The admin listener: `CacheAdmin` over TCP (loopback by default), every call checked
//! against the admin token in constant time.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use mmserve_protocol::cache::{CacheAdminRequest, CacheAdminResponse};
use mmserve_protocol::{AdminError, CacheAdmin, CacheStats, ItemInfo, ItemKey};
use tarpc::context::Context;
use tarpc::server::{BaseChannel, Channel};
use tarpc::tokio_serde::formats::Bincode;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
use tokio_util::codec::{Decoder, Encoder, Framed, LengthDelimitedCodec};

use crate::CacheService;

/// Largest call a client may send (a token and a digest): an unauthenticated peer cannot
/// make the listener buffer more than this.
const MAX_CALL_FRAME: usize = 64 << 10;
/// Largest reply (`list` of every item).
const MAX_REPLY_FRAME: usize = 256 << 20;
/// Calls one connection may have in flight.
const MAX_IN_FLIGHT: usize = 4;
/// Longest pause after a failed accept (out of file descriptors, say).
const MAX_ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// The admin listener's bounds: a flood of connections from a local user without the
/// token must not wedge it, nor take time from the data path.
#[derive(Debug, Clone, Copy)]
pub struct AdminLimits {
    /// Connections served at once; beyond it a new connection takes the place of the
    /// oldest one that has not authenticated, or is closed at once.
    pub max_connections: usize,
    /// A connection that has not made an authenticated call by then is closed.
    pub auth_timeout: Duration,
    /// How long a connection beyond the cap waits for the place of the one it evicted.
    pub eviction_wait: Duration,
    /// An authenticated connection with no call for this long is closed.
    pub idle_timeout: Duration,
}

/// Binds the admin address now (so a bad address fails the start).
pub fn bind(addr: &str) -> std::io::Result<std::net::TcpListener> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Serves the admin listener on a thread and runtime of its own, so that however busy
/// it is, the data path's runtime never runs admin work; it shares only the cache's lock,
/// which unauthenticated calls never take. Ends with the process.
pub fn spawn(
    listener: std::net::TcpListener,
    cache: CacheService,
    token: String,
    limits: AdminLimits,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    std::thread::Builder::new().name("admin".into()).spawn(move || {
        rt.block_on(async move {
            match TcpListener::from_std(listener) {
                Ok(listener) => serve(listener, Admin { cache, token: Arc::new(token) }, limits).await,
                Err(e) => tracing::error!("admin listener: {e}"),
            }
        })
    })
}

/// What the accept loop knows of a connection it serves.
struct Served {
    authenticated: Arc<AtomicBool>,
    /// Told to close, to make room for a newer connection.
    evict: Arc<Notify>,
}

async fn serve(listener: TcpListener, admin: Admin, limits: AdminLimits) {
    let places = Arc::new(Semaphore::new(limits.max_connections));
    // Connections in the order they came; the oldest one that has not authenticated
    // makes room when all places are taken, so that a flood of connections without the
    // token cannot keep an operator out: the flood evicts itself.
    let mut served: VecDeque<Weak<Served>> = VecDeque::new();
    let mut backoff = Duration::from_millis(10);
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => {
                backoff = Duration::from_millis(10);
                accepted
            }
            Err(e) => {
                // Out of descriptors or memory: pending connections stay in the backlog
                // while connections we hold time out and free theirs.
                tracing::warn!("admin accept failed: {e}; pausing {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_ACCEPT_BACKOFF);
                continue;
            }
        };
        let place = match places.clone().try_acquire_owned() {
            Ok(place) => place,
            Err(_) => {
                evict_oldest_unauthenticated(&mut served);
                match tokio::time::timeout(limits.eviction_wait, places.clone().acquire_owned()).await {
                    Ok(Ok(place)) => place,
                    // Every place is held by an operator's connection: closed at once
                    // (never left in CLOSE-WAIT), the client sees a reset.
                    _ => continue,
                }
            }
        };
        let state =
            Arc::new(Served { authenticated: Arc::new(AtomicBool::new(false)), evict: Arc::new(Notify::new()) });
        served.retain(|w| w.strong_count() > 0);
        served.push_back(Arc::downgrade(&state));
        let admin = admin.clone();
        tokio::spawn(async move {
            serve_connection(stream, peer, admin, limits, &state).await;
            drop(place);
        });
    }
}

fn evict_oldest_unauthenticated(served: &mut VecDeque<Weak<Served>>) {
    let mut kept = VecDeque::new();
    while let Some(w) = served.pop_front() {
        let Some(s) = w.upgrade() else { continue };
        if !s.authenticated.load(Ordering::Relaxed) {
            s.evict.notify_one();
            break;
        }
        kept.push_back(w);
    }
    kept.append(served);
    *served = kept;
}

/// One connection: closed when its peer closes, when it has not authenticated within
/// the auth timeout, when it has been idle too long, or when it is evicted.
async fn serve_connection(stream: TcpStream, peer: SocketAddr, admin: Admin, limits: AdminLimits, state: &Served) {
    let _ = stream.set_nodelay(true);
    let framed = Framed::new(stream, Frames::default());
    let transport = tarpc::tokio_serde::Framed::new(framed, Bincode::<ClientMessage, ServerMessage>::default());
    let conn = Connection { admin, authenticated: state.authenticated.clone(), activity: Default::default() };
    let calls = BaseChannel::with_defaults(transport)
        .execute(conn.clone().serve())
        .for_each_concurrent(MAX_IN_FLIGHT, |response| response);
    let watchdog = async {
        tokio::time::sleep(limits.auth_timeout).await;
        if !conn.authenticated.load(Ordering::Relaxed) {
            tracing::debug!(%peer, "admin connection closed: no authenticated call within {:?}", limits.auth_timeout);
            return;
        }
        // Idle: no call began within the idle timeout.
        loop {
            let notified = conn.activity.notified();
            if tokio::time::timeout(limits.idle_timeout, notified).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = calls => {}
        _ = watchdog => {}
        _ = state.evict.notified() => tracing::debug!(%peer, "admin connection closed to make room"),
    }
}

/// Length-delimited frames, as `tarpc::serde_transport::tcp` uses, with a small limit on
/// what is read and a large one on what is written.
struct Frames {
    read: LengthDelimitedCodec,
    write: LengthDelimitedCodec,
}

impl Default for Frames {
    fn default() -> Self {
        let codec = |max| LengthDelimitedCodec::builder().max_frame_length(max).new_codec();
        Frames { read: codec(MAX_CALL_FRAME), write: codec(MAX_REPLY_FRAME) }
    }
}

impl Decoder for Frames {
    type Item = BytesMut;
    type Error = std::io::Error;
    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<BytesMut>, std::io::Error> {
        self.read.decode(src)
    }
}

impl Encoder<Bytes> for Frames {
    type Error = std::io::Error;
    fn encode(&mut self, item: Bytes, dst: &mut BytesMut) -> Result<(), std::io::Error> {
        self.write.encode(item, dst)
    }
}

type ClientMessage = tarpc::ClientMessage<CacheAdminRequest>;
type ServerMessage = tarpc::Response<CacheAdminResponse>;

#[derive(Clone)]
struct Admin {
    cache: CacheService,
    token: Arc<String>,
}

/// The admin service as one connection sees it.
#[derive(Clone)]
struct Connection {
    admin: Admin,
    authenticated: Arc<AtomicBool>,
    activity: Arc<tokio::sync::Notify>,
}

impl Connection {
    fn check(&self, given: &str) -> Result<(), AdminError> {
        self.activity.notify_waiters();
        let (a, b) = (self.admin.token.as_bytes(), given.as_bytes());
        // Constant time in the token's contents (its length is not a secret worth hiding).
        let diff = a.len() ^ b.len() | a.iter().zip(b).fold(0usize, |acc, (x, y)| acc | usize::from(x ^ y));
        if diff != 0 {
            return Err(AdminError::Unauthorized);
        }
        self.authenticated.store(true, Ordering::Relaxed);
        Ok(())
    }
}

impl CacheAdmin for Connection {
    async fn stats(self, _: Context, token: String) -> Result<CacheStats, AdminError> {
        self.check(&token)?;
        Ok(self.admin.cache.stats_now())
    }

    async fn list(self, _: Context, token: String) -> Result<Vec<ItemInfo>, AdminError> {
        self.check(&token)?;
        Ok(self.admin.cache.with_state(|s| s.list()))
    }

    async fn evict(self, _: Context, token: String, digest: ItemKey) -> Result<u64, AdminError> {
        self.check(&token)?;
        self.admin.cache.with_state(|s| s.evict(digest))
    }

    async fn clear(self, _: Context, token: String) -> Result<u64, AdminError> {
        self.check(&token)?;
        Ok(self.admin.cache.with_state(|s| s.clear_unreferenced()))
    }

    async fn drop_item(self, _: Context, token: String, digest: ItemKey, force: bool) -> Result<u64, AdminError> {
        self.check(&token)?;
        let dropped = self.admin.cache.with_state(|s| s.drop_item(digest, force, std::time::Instant::now()))?;
        // Requests waiting for a dropped item's bytes fail now instead of at their timeout.
        self.admin.cache.notify_data_waiters();
        Ok(dropped)
    }
}
