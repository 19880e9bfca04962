//! The tarpc face of the cache.
//!
//! One mutex guards the records and the queue of waiting allocs. That mutex is the
//! global lock of the design: every `alloc`, from any api process, is decided under it,
//! so each request gets all its items or none and no two requests can each hold part of
//! what the other needs. Requests that do not fit yet wait in FIFO order holding
//! nothing; releases hand capacity to the head of the line first, so a large request is
//! not starved by a stream of small ones.
//!
//! Each connection is an owner: its references are released when it closes, so a killed
//! api process cannot leave items referenced forever. Within a connection, an api
//! process holds each request's references under a lease of its own and gives the lease
//! back however the request ended, so a request whose client vanished while its alloc
//! was in flight cannot leave references behind either.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::StreamExt;
use mmserve_protocol::cache::{Allocation, CacheOp, CacheOpResult};
use mmserve_protocol::{AllocItem, ArenaInfo, CacheError, CacheStats, EmbedCache, ItemRecord, PinState};
use mmserve_shm::{InstanceLock, Segment};
use tarpc::context::Context;
use tarpc::server::{BaseChannel, Channel};
use tokio::net::UnixListener;
use tokio::sync::{Notify, oneshot};

use crate::state::{CacheState, Holder, Limits, Owner, Refusal};
use crate::{CacheArgs, CacheServiceError};

/// Longest wait any call may ask for (one hour): keeps deadline arithmetic in range.
const MAX_WAIT_MS: u64 = 3_600_000;

struct Waiter {
    ticket: u64,
    owner: Holder,
    items: Vec<AllocItem>,
    tx: oneshot::Sender<Vec<ItemRecord>>,
}

struct Inner {
    state: CacheState,
    queue: VecDeque<Waiter>,
    /// Owners whose connection closed: nothing may be granted to them any more.
    gone: HashSet<Owner>,
    cancelled: Cancelled,
}

/// Leases released before their alloc was decided (the release overtook the alloc on
/// the way, or the alloc still waits to be read): an alloc under one is refused. Each is
/// forgotten when its alloc comes, when its connection closes, or once no alloc under it
/// can still arrive (the linger its client names).
#[derive(Default)]
struct Cancelled {
    until: HashMap<Holder, Instant>,
    by_expiry: BTreeSet<(Instant, Holder)>,
}

/// The longest a cancelled lease is remembered.
const MAX_LINGER_MS: u64 = MAX_WAIT_MS + 60_000;

impl Cancelled {
    fn insert(&mut self, h: Holder, linger_ms: u64, now: Instant) {
        self.sweep(now);
        let until = now + Duration::from_millis(linger_ms.min(MAX_LINGER_MS));
        if let Some(old) = self.until.insert(h, until) {
            self.by_expiry.remove(&(old, h));
        }
        self.by_expiry.insert((until, h));
    }

    /// Whether an alloc under `h` must be refused (and forgets `h`: one alloc per lease).
    fn take(&mut self, h: Holder, now: Instant) -> bool {
        self.sweep(now);
        match self.until.remove(&h) {
            Some(until) => self.by_expiry.remove(&(until, h)),
            None => false,
        }
    }

    fn forget_conn(&mut self, conn: Owner) {
        self.until.retain(|h, _| h.conn != conn);
        self.by_expiry.retain(|(_, h)| h.conn != conn);
    }

    fn sweep(&mut self, now: Instant) {
        while let Some(&(t, h)) = self.by_expiry.first()
            && t <= now
        {
            self.by_expiry.pop_first();
            self.until.remove(&h);
        }
    }

    fn len(&self) -> usize {
        self.until.len()
    }
}

impl Inner {
    /// Gives back what `holder` holds and takes it out of the line; remembers it as
    /// cancelled if it held nothing and waited for nothing. Returns the references dropped.
    fn release_lease(&mut self, holder: Holder, linger_ms: u64) -> u64 {
        let released = self.state.release_lease(holder);
        let waiting = self.queue.len();
        self.queue.retain(|w| w.owner != holder);
        if released == 0 && waiting == self.queue.len() && linger_ms > 0 {
            self.cancelled.insert(holder, linger_ms, Instant::now());
        }
        self.drain();
        released
    }

    /// Grants waiting allocs in order while the head fits.
    fn drain(&mut self) {
        self.state.expire_unwritten(Instant::now());
        while let Some(head) = self.queue.front() {
            if head.tx.is_closed() || self.gone.contains(&head.owner.conn) {
                self.queue.pop_front();
                continue;
            }
            match self.state.try_alloc(head.owner, &head.items) {
                Ok(records) => {
                    let w = self.queue.pop_front().expect("head exists");
                    if let Err(records) = w.tx.send(records) {
                        // The waiter gave up a moment ago: take the grant back.
                        let ids: Vec<u64> = records.iter().map(|r| r.id).collect();
                        let _ = self.state.release(w.owner, &ids);
                    }
                }
                Err(Refusal::NotNow { .. }) => break,
                Err(Refusal::Never(_)) => {
                    // Checked before queueing; capacity does not shrink. Drop it.
                    self.queue.pop_front();
                }
            }
        }
    }
}

struct Shared {
    inner: Mutex<Inner>,
    data_ready: Notify,
    info: ArenaInfo,
    /// The arenas and the instance's owner lock; dropped at shutdown.
    held: Mutex<Option<(Segment, Segment, InstanceLock)>>,
    next_owner: AtomicU64,
    next_ticket: AtomicU64,
}

#[derive(Clone)]
pub struct CacheService {
    shared: Arc<Shared>,
    owner: Owner,
}

impl CacheService {
    pub fn new(args: &CacheArgs) -> Result<Self, CacheServiceError> {
        let cap = &args.capacity;
        let slot_bytes = u64::from(args.embed_dim) * args.embed_dtype.size() as u64;
        if slot_bytes == 0 {
            return Err(CacheServiceError::Capacity("--embed-dim must be positive".into()));
        }
        let slots = cap.embed_cache_size.0 / slot_bytes;
        if slots == 0 {
            return Err(CacheServiceError::Capacity(format!(
                "--embed-cache-size {} holds no slot of {slot_bytes} bytes",
                cap.embed_cache_size
            )));
        }
        if !(cap.embed_cache_request_share > 0.0 && cap.embed_cache_request_share <= 1.0) {
            return Err(CacheServiceError::Capacity("--embed-cache-request-share must be in (0, 1]".into()));
        }
        let limits = Limits {
            slots,
            items: cap.embed_cache_items,
            data_bytes: cap.embed_cache_data_size.0,
            request_slots: ((slots as f64) * cap.embed_cache_request_share).floor().max(1.0) as u64,
        };
        let data_timeout = crate::positive_secs(cap.embed_cache_data_timeout_s, "--embed-cache-data-timeout-s")?;
        let prefix = args.shm_prefix.clone().unwrap_or_else(default_prefix);
        let lock = InstanceLock::acquire(&prefix)?;
        let embed_segment = format!("{prefix}.arena");
        let data_segment = format!("{prefix}.data");
        let usize_of = |b: u64| usize::try_from(b).map_err(|_| CacheServiceError::Capacity(format!("{b} bytes")));
        let arena = Segment::create(&embed_segment, usize_of(slots * slot_bytes)?)?;
        let data = Segment::create(&data_segment, usize_of(cap.embed_cache_data_size.0)?)?;
        let instance = random_u64();
        let info = ArenaInfo {
            instance,
            embed_segment,
            slots,
            layers: 1,
            hidden: args.embed_dim,
            dtype: args.embed_dtype,
            data_segment,
            data_bytes: cap.embed_cache_data_size.0,
        };
        Ok(CacheService {
            shared: Arc::new(Shared {
                inner: Mutex::new(Inner {
                    // Ids differ between instances, so a client releasing ids of a previous
                    // instance after a restart cannot hit live records.
                    state: CacheState::with_first_id(limits, (instance & 0xffff_ffff) << 31)
                        .with_data_timeout(data_timeout),
                    queue: VecDeque::new(),
                    gone: HashSet::new(),
                    cancelled: Cancelled::default(),
                }),
                data_ready: Notify::new(),
                info,
                held: Mutex::new(Some((arena, data, lock))),
                next_owner: AtomicU64::new(1),
                next_ticket: AtomicU64::new(1),
            }),
            owner: 0,
        })
    }

    pub fn info(&self) -> &ArenaInfo {
        &self.shared.info
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every mutation validates before it changes anything, so the state is consistent
        // even if a holder panicked.
        self.shared.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn with_state<T>(&self, f: impl FnOnce(&mut CacheState) -> T) -> T {
        let mut inner = self.lock();
        let out = f(&mut inner.state);
        // Whatever freed capacity goes to the line first.
        inner.drain();
        out
    }

    pub(crate) fn notify_data_waiters(&self) {
        self.shared.data_ready.notify_waiters();
    }

    pub(crate) fn stats_now(&self) -> CacheStats {
        let inner = self.lock();
        let mut s = inner.state.stats();
        s.waiting = inner.queue.len() as u64;
        s.cancelled_leases = inner.cancelled.len() as u64;
        s
    }

    /// Serves one owner per connection until the listener fails.
    pub async fn run_listener(self, listener: UnixListener) {
        let mut backoff = Duration::from_millis(10);
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => {
                    backoff = Duration::from_millis(10);
                    stream
                }
                Err(e) => {
                    // Out of descriptors, say: retrying at once would spin.
                    tracing::warn!("accept failed: {e}; pausing {backoff:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            };
            let owner = self.shared.next_owner.fetch_add(1, Ordering::Relaxed);
            let conn = CacheService { shared: self.shared.clone(), owner };
            let channel = BaseChannel::with_defaults(mmserve_protocol::transport::server_transport(stream));
            tokio::spawn(async move {
                // Released however the task ends, a panic included.
                let _closed = ClosedGuard(conn.clone());
                channel
                    .execute(EmbedCache::serve(conn.clone()))
                    // Responses run inside the connection's task: no spawn per request.
                    .for_each_concurrent(None, |response| response)
                    .await;
            });
        }
    }

    /// The owner's connection closed: release what it holds, cancel what it waits for.
    fn connection_closed(&self) {
        let mut inner = self.lock();
        inner.gone.insert(self.owner);
        let released = inner.state.release_owner(self.owner);
        inner.queue.retain(|w| w.owner.conn != self.owner);
        inner.cancelled.forget_conn(self.owner);
        inner.drain();
        drop(inner);
        self.shared.data_ready.notify_waiters();
        if released > 0 {
            tracing::warn!(owner = self.owner, released, "a client disconnected holding references; released them");
        }
    }

    /// Unlinks both arenas and the owner file.
    pub fn shutdown(&self) {
        self.shared.held.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

/// Runs `connection_closed` when the connection's task ends.
struct ClosedGuard(CacheService);

impl Drop for ClosedGuard {
    fn drop(&mut self) {
        self.0.connection_closed();
    }
}

/// A queued alloc. If the call is dropped while waiting (its client went away or its
/// deadline passed), the ticket leaves the line and any grant that raced in is taken back.
struct WaitTicket<'a> {
    service: &'a CacheService,
    holder: Holder,
    ticket: u64,
    rx: oneshot::Receiver<Vec<ItemRecord>>,
    done: bool,
}

impl Drop for WaitTicket<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut inner = self.service.lock();
        if let Some(pos) = inner.queue.iter().position(|w| w.ticket == self.ticket) {
            inner.queue.remove(pos);
        } else if let Ok(records) = self.rx.try_recv() {
            let ids: Vec<u64> = records.iter().map(|r| r.id).collect();
            let _ = inner.state.release(self.holder, &ids);
        }
        inner.drain();
    }
}

fn default_prefix() -> String {
    format!("mmserve-{}-{:08x}", std::process::id(), random_u64() as u32)
}

/// A random value from the kernel (no per-process seeded hashing involved).
fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b)).is_err() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        return t.as_nanos() as u64 ^ u64::from(std::process::id()).rotate_left(40);
    }
    u64::from_le_bytes(b)
}

impl EmbedCache for CacheService {
    async fn alloc(
        self,
        _: Context,
        lease: u64,
        items: Vec<AllocItem>,
        wait_ms: u64,
    ) -> Result<Allocation, CacheError> {
        let instance = self.shared.info.instance;
        let wait_ms = wait_ms.min(MAX_WAIT_MS);
        let holder = Holder { conn: self.owner, lease };
        let (ticket, rx, needed) = {
            let mut inner = self.lock();
            if inner.gone.contains(&self.owner) {
                return Err(CacheError::Disconnected);
            }
            if lease != 0 && inner.cancelled.take(holder, Instant::now()) {
                return Err(CacheError::Cancelled);
            }
            // Drop dead heads first, then: nobody jumps the line; try now only if nobody waits.
            inner.drain();
            let needed = match inner.queue.is_empty() {
                true => match inner.state.try_alloc(holder, &items) {
                    Ok(records) => return Ok(Allocation { instance, records }),
                    Err(Refusal::Never(e)) => return Err(e),
                    Err(Refusal::NotNow { needed_slots, needed_items }) => (needed_slots, needed_items),
                },
                false => {
                    inner.state.check_request(&items)?;
                    (0, 0)
                }
            };
            let full = CacheError::Full { needed_slots: needed.0, needed_items: needed.1, waited_ms: wait_ms };
            if wait_ms == 0 {
                return Err(full);
            }
            let (tx, rx) = oneshot::channel();
            let ticket = self.shared.next_ticket.fetch_add(1, Ordering::Relaxed);
            inner.queue.push_back(Waiter { ticket, owner: holder, items, tx });
            (ticket, rx, full)
        };
        let mut wait = WaitTicket { service: &self, holder, ticket, rx, done: false };
        let granted = tokio::time::timeout(Duration::from_millis(wait_ms), &mut wait.rx).await;
        match granted {
            Ok(Ok(records)) => {
                wait.done = true;
                Ok(Allocation { instance, records })
            }
            // Taken out of the line by its lease's release.
            Ok(Err(_)) => Err(CacheError::Cancelled),
            // Timed out: the ticket's drop leaves the line (or takes back a grant that
            // raced in) and lets the next waiter try.
            Err(_) => Err(needed),
        }
    }

    async fn release_lease(self, _: Context, lease: u64, linger_ms: u64) -> u64 {
        let released = self.lock().release_lease(Holder { conn: self.owner, lease }, linger_ms);
        self.shared.data_ready.notify_waiters();
        released
    }

    async fn release(self, _: Context, ids: Vec<u64>) -> Result<(), CacheError> {
        let owner = self.owner;
        let r = self.with_state(|s| s.release(owner, &ids));
        // Records may have gone or been abandoned: waiters for their data re-check.
        self.shared.data_ready.notify_waiters();
        r
    }

    async fn batch(self, _: Context, ops: Vec<CacheOp>) -> Vec<CacheOpResult> {
        let instance = self.shared.info.instance;
        let mut notify = false;
        let mut inner = self.lock();
        // Once one alloc of the batch must wait, the later ones wait behind it.
        let mut line_closed = false;
        let results = ops
            .into_iter()
            .map(|op| match op {
                CacheOp::Alloc { lease, items } => {
                    let holder = Holder { conn: self.owner, lease };
                    if inner.gone.contains(&self.owner) {
                        return CacheOpResult::Failed(CacheError::Disconnected);
                    }
                    if lease != 0 && inner.cancelled.take(holder, Instant::now()) {
                        return CacheOpResult::Failed(CacheError::Cancelled);
                    }
                    inner.drain();
                    if line_closed || !inner.queue.is_empty() {
                        line_closed = true;
                        return match inner.state.check_request(&items) {
                            Ok(()) => CacheOpResult::MustWait,
                            Err(e) => CacheOpResult::Failed(e),
                        };
                    }
                    match inner.state.try_alloc(holder, &items) {
                        Ok(records) => CacheOpResult::Allocated(Allocation { instance, records }),
                        Err(Refusal::Never(e)) => CacheOpResult::Failed(e),
                        Err(Refusal::NotNow { .. }) => {
                            line_closed = true;
                            CacheOpResult::MustWait
                        }
                    }
                }
                CacheOp::ReleaseLease { lease, linger_ms } => {
                    notify = true;
                    let n = inner.release_lease(Holder { conn: self.owner, lease }, linger_ms);
                    CacheOpResult::Released(n)
                }
                CacheOp::SetData(ids) => {
                    notify = true;
                    inner.state.set_data_ready(&ids).map_or_else(CacheOpResult::Failed, |()| CacheOpResult::Done)
                }
            })
            .collect();
        drop(inner);
        if notify {
            self.shared.data_ready.notify_waiters();
        }
        results
    }

    async fn set_items_data(self, _: Context, ids: Vec<u64>) -> Result<(), CacheError> {
        self.with_state(|s| s.set_data_ready(&ids))?;
        self.shared.data_ready.notify_waiters();
        Ok(())
    }

    async fn wait_items_data(self, _: Context, ids: Vec<u64>, timeout_ms: u64) -> Result<(), CacheError> {
        let timeout_ms = timeout_ms.min(MAX_WAIT_MS);
        let deadline = Instant::now() + Duration::from_millis(timeout_ms);
        loop {
            // Register for the notification before checking, so a wake-up between the
            // check and the wait is not lost.
            let notified = self.shared.data_ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let item_deadline = {
                let mut inner = self.lock();
                inner.state.expire_unwritten(Instant::now());
                if inner.state.data_ready(&ids)?.iter().all(|&r| r) {
                    return Ok(());
                }
                inner.state.data_deadline(&ids)
            };
            // An item whose writer misses its deadline is abandoned then: look again.
            let wake = item_deadline.map_or(deadline, |d| d.min(deadline));
            if tokio::time::timeout_at(wake.into(), notified).await.is_err() && wake == deadline {
                return Err(CacheError::Timeout(timeout_ms));
            }
        }
    }

    async fn pin_unready(self, _: Context, ids: Vec<u64>) -> Vec<PinState> {
        let owner = self.owner;
        self.with_state(|s| s.pin_unready(owner, &ids))
    }

    async fn encoded(self, _: Context, ready: Vec<u64>, unpin: Vec<u64>) -> Result<(), CacheError> {
        let owner = self.owner;
        self.with_state(|s| {
            s.set_embed_ready(&ready);
            s.release(owner, &unpin)
        })
    }

    async fn arena(self, _: Context) -> ArenaInfo {
        self.shared.info.clone()
    }

    async fn stats(self, _: Context) -> CacheStats {
        self.stats_now()
    }
}
