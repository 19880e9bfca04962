//! The cache's records and the rules that govern them (no I/O, no waiting: the service
//! layer adds those).
//!
//! Invariants:
//! - an item with references is never evicted;
//! - `try_alloc` is all-or-nothing: on refusal nothing is held and nothing was evicted;
//! - a hit is confirmed by the SHA-256 digest, so inputs with equal md5 never share a record;
//! - virtual token-id ranges come from a counter and are never reused;
//! - references belong to a holder (one lease of a client connection: an api request, or
//!   the connection itself) and go when the holder releases its lease or the
//!   connection goes;
//! - a record whose bytes are not written within the data timeout is abandoned: hidden
//!   from lookups, waiting for it fails, and it goes with its last reference;
//! - every record owns one block of embedding slots and one block of data pages.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use mmserve_protocol::{
    AdminError, AllocItem, CacheError, CacheStats, ItemDigest, ItemInfo, ItemKey, ItemRecord, Modality, PinState,
    VIRTUAL_TOKEN_BASE,
};

use crate::slots::SlotAllocator;

/// Raw bytes are stored in pages of this size.
pub const DATA_PAGE: u64 = 4096;

/// A client connection.
pub type Owner = u64;

/// Who holds references: a lease of a connection. Lease 0 is the connection itself (the
/// encoder's pins); an api process names one lease per request, so a request that went
/// away can give back exactly what it held, whether or not it saw the grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Holder {
    pub conn: Owner,
    pub lease: u64,
}

impl From<Owner> for Holder {
    fn from(conn: Owner) -> Self {
        Holder { conn, lease: 0 }
    }
}

/// How long a new record's writer has to write its bytes by default.
pub const DEFAULT_DATA_TIMEOUT: Duration = Duration::from_secs(30);

/// Capacity settings.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub slots: u64,
    pub items: u64,
    pub data_bytes: u64,
    /// Most slots one request may use (the per-request share of `slots`).
    pub request_slots: u64,
}

struct Record {
    digest: ItemDigest,
    modality: Modality,
    token_id: u64,
    token_num: u32,
    start_index: u64,
    data_page: u64,
    data_len: u64,
    data_ready: bool,
    embed_ready: bool,
    /// The holder that must write the raw bytes (until they are written).
    writer: Holder,
    /// The writer left without writing, or its data timeout passed: the record is
    /// unfindable and dies with its last reference; waiting for its data fails at once.
    abandoned: bool,
    refs: u32,
    /// Tick of the last use; the key of this record in `lru` while unreferenced.
    last_use: u64,
    last_use_at: Instant,
    created: Instant,
}

impl Record {
    fn pages(&self) -> u64 {
        self.data_len.div_ceil(DATA_PAGE)
    }
}

/// Where a new item goes: (first slot, first data page).
type Block = (u64, u64);

/// Places every item or none: on failure the blocks taken so far are given back.
fn place_all(slots: &mut SlotAllocator, pages: &mut SlotAllocator, items: &[&AllocItem]) -> Option<Vec<Block>> {
    let mut placed = Vec::with_capacity(items.len());
    for i in items {
        let (n, p) = (u64::from(i.token_num), i.data_len.div_ceil(DATA_PAGE));
        let Some(s) = slots.alloc(n) else { return undo(slots, pages, items, placed) };
        let Some(d) = pages.alloc(p) else {
            slots.release(s, n);
            return undo(slots, pages, items, placed);
        };
        placed.push((s, d));
    }
    Some(placed)
}

fn undo(
    slots: &mut SlotAllocator,
    pages: &mut SlotAllocator,
    items: &[&AllocItem],
    placed: Vec<Block>,
) -> Option<Vec<Block>> {
    for (i, (s, d)) in items.iter().zip(placed) {
        slots.release(s, u64::from(i.token_num));
        pages.release(d, i.data_len.div_ceil(DATA_PAGE));
    }
    None
}

/// Why `try_alloc` refused.
#[derive(Debug)]
pub enum Refusal {
    /// Can never fit: the caller gets this error at once.
    Never(CacheError),
    /// Would fit once others release: the caller may wait.
    NotNow { needed_slots: u64, needed_items: u64 },
}

pub struct CacheState {
    records: HashMap<u64, Record>,
    /// md5 → ids; more than one only for inputs whose md5 collides.
    by_key: HashMap<ItemKey, Vec<u64>>,
    /// Unreferenced records by last use, oldest first: the eviction order.
    lru: BTreeMap<u64, u64>,
    slots: SlotAllocator,
    pages: SlotAllocator,
    held: HashMap<Holder, HashMap<u64, u32>>,
    /// Records whose bytes are not written yet, by creation time: the data deadlines.
    unwritten: BTreeSet<(Instant, u64)>,
    data_timeout: Duration,
    limits: Limits,
    next_id: u64,
    next_token_id: u64,
    tick: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
}

impl CacheState {
    /// `first_id` should differ between instances (ids must not repeat across a
    /// restart: a client may still release ids of the previous instance).
    pub fn new(limits: Limits) -> Self {
        Self::with_first_id(limits, 1)
    }

    pub fn with_first_id(limits: Limits, first_id: u64) -> Self {
        CacheState {
            records: HashMap::new(),
            by_key: HashMap::new(),
            lru: BTreeMap::new(),
            slots: SlotAllocator::new(limits.slots),
            pages: SlotAllocator::new(limits.data_bytes / DATA_PAGE),
            held: HashMap::new(),
            unwritten: BTreeSet::new(),
            data_timeout: DEFAULT_DATA_TIMEOUT,
            limits,
            next_id: first_id.max(1),
            next_token_id: VIRTUAL_TOKEN_BASE,
            tick: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
        }
    }

    /// How long a new record's writer has to write its bytes before it is abandoned.
    pub fn with_data_timeout(mut self, timeout: Duration) -> Self {
        self.data_timeout = timeout;
        self
    }

    pub fn data_timeout(&self) -> Duration {
        self.data_timeout
    }

    /// Abandons every record whose bytes did not arrive within the data timeout as of
    /// `now` (its writer is stuck or gone): later requests start afresh, waiters fail.
    /// Returns how many.
    pub fn expire_unwritten(&mut self, now: Instant) -> usize {
        let mut n = 0;
        while let Some(&(created, id)) = self.unwritten.first() {
            if now.saturating_duration_since(created) < self.data_timeout {
                break;
            }
            self.unwritten.pop_first();
            let refs = self.records.get(&id).map_or(0, |r| r.refs);
            if refs == 0 {
                self.remove(id);
            } else {
                self.abandon(id);
            }
            n += 1;
        }
        n
    }

    /// When the first of these records' data deadlines passes (none for written ones).
    pub fn data_deadline(&self, ids: &[u64]) -> Option<Instant> {
        ids.iter()
            .filter_map(|id| self.records.get(id))
            .filter(|r| !r.data_ready && !r.abandoned)
            .map(|r| r.created + self.data_timeout)
            .min()
    }

    /// Hides a record from lookups for good: the next request for its bytes starts afresh.
    fn abandon(&mut self, id: u64) {
        let Some(r) = self.records.get_mut(&id) else { return };
        if r.abandoned {
            return;
        }
        r.abandoned = true;
        let (key, created) = (r.digest.key, r.created);
        self.unwritten.remove(&(created, id));
        if let Some(ids) = self.by_key.get_mut(&key) {
            ids.retain(|&x| x != id);
            if ids.is_empty() {
                self.by_key.remove(&key);
            }
        }
    }

    fn find(&self, d: &ItemDigest) -> Option<u64> {
        self.by_key.get(&d.key)?.iter().copied().find(|id| self.records[id].digest.confirm == d.confirm)
    }

    /// Refuses at once what can never fit (the error names the limit).
    pub fn check_request(&self, items: &[AllocItem]) -> Result<(), CacheError> {
        let mut distinct: Vec<&AllocItem> = Vec::new();
        for item in items {
            if !distinct.iter().any(|d| d.digest == item.digest) {
                distinct.push(item);
            }
        }
        self.check_ever_fits(&distinct)
    }

    /// Refuses at once what can never fit, whatever else is released.
    fn check_ever_fits(&self, distinct: &[&AllocItem]) -> Result<(), CacheError> {
        let slots: u64 = distinct.iter().fold(0u64, |a, i| a.saturating_add(u64::from(i.token_num)));
        let pages: u64 = distinct.iter().fold(0u64, |a, i| a.saturating_add(i.data_len.div_ceil(DATA_PAGE)));
        let too_large = |what: &str, needed, limit, flag: &str| {
            Err(CacheError::TooLarge { what: what.into(), needed, limit, flag: flag.into() })
        };
        if distinct.len() as u64 > self.limits.items {
            return too_large("items", distinct.len() as u64, self.limits.items, "--embed-cache-items");
        }
        let share = self.limits.request_slots.min(self.limits.slots);
        if slots > share {
            return too_large("embedding slots", slots, share, "--embed-cache-size × --embed-cache-request-share");
        }
        if pages > self.pages.total() {
            return too_large(
                "bytes of raw media",
                pages.saturating_mul(DATA_PAGE),
                self.pages.total() * DATA_PAGE,
                "--embed-cache-data-size",
            );
        }
        Ok(())
    }

    /// Reserves every item for `owner` now, evicting least recently used unreferenced
    /// items as far as needed, or refuses and changes nothing.
    pub fn try_alloc(&mut self, owner: impl Into<Holder>, items: &[AllocItem]) -> Result<Vec<ItemRecord>, Refusal> {
        let owner = owner.into();
        let mut distinct: Vec<&AllocItem> = Vec::new();
        for item in items {
            if !distinct.iter().any(|d| d.digest == item.digest) {
                distinct.push(item);
            }
        }
        self.check_ever_fits(&distinct).map_err(Refusal::Never)?;
        let new: Vec<&AllocItem> = distinct.iter().copied().filter(|i| self.find(&i.digest).is_none()).collect();
        let needed_items = new.len() as u64;
        let needed_slots: u64 = new.iter().map(|i| u64::from(i.token_num)).sum();

        let Some((victims, placed)) = self.place(&distinct, &new) else {
            // With every evictable record gone it still does not fit: unless records held
            // by others are in the way, waiting cannot help (fragmentation of the data
            // pages by this request's own items, for instance).
            let in_request: Vec<u64> = distinct.iter().filter_map(|i| self.find(&i.digest)).collect();
            let blocked = self.records.iter().any(|(id, r)| r.refs > 0 && !in_request.contains(id));
            return Err(match blocked {
                true => Refusal::NotNow { needed_slots, needed_items },
                false => Refusal::Never(CacheError::TooLarge {
                    what: "contiguous cache space".into(),
                    needed: needed_slots,
                    limit: self.slots.largest_free_block(),
                    flag: "--embed-cache-size / --embed-cache-data-size".into(),
                }),
            });
        };
        for id in victims {
            self.remove_record(id);
            self.evictions += 1;
        }
        let now = Instant::now();
        let mut created = Vec::with_capacity(new.len());
        for (item, (start_index, data_page)) in new.iter().zip(placed) {
            let id = self.next_id;
            self.next_id += 1;
            let token_id = self.next_token_id;
            self.next_token_id += u64::from(item.token_num);
            self.records.insert(
                id,
                Record {
                    digest: item.digest,
                    modality: item.modality,
                    token_id,
                    token_num: item.token_num,
                    start_index,
                    data_page,
                    data_len: item.data_len,
                    data_ready: false,
                    embed_ready: false,
                    writer: owner,
                    abandoned: false,
                    refs: 0,
                    last_use: 0,
                    last_use_at: now,
                    created: now,
                },
            );
            self.by_key.entry(item.digest.key).or_default().push(id);
            self.unwritten.insert((now, id));
            created.push(id);
        }

        // One reference per requested item; the creator of a record writes its data.
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            let id = self.find(&item.digest).expect("every item has a record now");
            let write_data = if let Some(pos) = created.iter().position(|&c| c == id) {
                created.swap_remove(pos);
                self.misses += 1;
                true
            } else {
                self.hits += 1;
                false
            };
            self.take_ref(owner, id);
            let r = &self.records[&id];
            out.push(ItemRecord {
                id,
                key: r.digest.key,
                token_id: r.token_id,
                token_num: r.token_num,
                start_index: r.start_index,
                data_ready: r.data_ready,
                embed_ready: r.embed_ready,
                data_offset: r.data_page * DATA_PAGE,
                data_len: r.data_len,
                write_data,
            });
        }
        Ok(out)
    }

    /// Finds blocks for every new item: `(records to evict, (slot, page) per new item)`.
    /// On success the allocators already hold the new blocks and no longer hold the
    /// victims' (remove those with [`Self::remove_record`]); on `None` nothing changed.
    fn place(&mut self, distinct: &[&AllocItem], new: &[&AllocItem]) -> Option<(Vec<u64>, Vec<Block>)> {
        if new.is_empty() {
            return Some((Vec::new(), Vec::new()));
        }
        let needed_items = new.len() as u64;
        // Fast path: everything fits without evicting.
        if self.records.len() as u64 + needed_items <= self.limits.items
            && let Some(placed) = place_all(&mut self.slots, &mut self.pages, new)
        {
            return Some((Vec::new(), placed));
        }
        // Evict the oldest unreferenced records (never one this request is about to use)
        // on the allocators themselves until every new item has its blocks; if that never
        // happens, take the victims' exact blocks back (free lists are canonical, so the
        // state is as before). No copy of the allocators on this path.
        let in_request: Vec<u64> = distinct.iter().filter_map(|i| self.find(&i.digest)).collect();
        let mut victims: Vec<u64> = Vec::new();
        let mut after = 0u64;
        loop {
            let next = self.lru.range(after..).find(|(_, id)| !in_request.contains(id)).map(|(&t, &id)| (t, id));
            let Some((tick, id)) = next else {
                for v in &victims {
                    let r = &self.records[v];
                    let restored = self.slots.take(r.start_index, u64::from(r.token_num))
                        && self.pages.take(r.data_page, r.pages());
                    debug_assert!(restored, "a victim's blocks were free again");
                }
                return None;
            };
            after = tick + 1;
            let r = &self.records[&id];
            self.slots.release(r.start_index, u64::from(r.token_num));
            self.pages.release(r.data_page, r.pages());
            victims.push(id);
            if self.records.len() as u64 - victims.len() as u64 + needed_items <= self.limits.items
                && let Some(placed) = place_all(&mut self.slots, &mut self.pages, new)
            {
                return Some((victims, placed));
            }
        }
    }

    /// One more reference of `owner` to the record.
    fn take_ref(&mut self, owner: Holder, id: u64) {
        self.touch(id);
        *self.held.entry(owner).or_default().entry(id).or_default() += 1;
    }

    /// Adds a reference and marks the record used now.
    fn touch(&mut self, id: u64) {
        self.tick += 1;
        let r = self.records.get_mut(&id).expect("touched record exists");
        if r.refs == 0 {
            self.lru.remove(&r.last_use);
        }
        r.refs += 1;
        r.last_use = self.tick;
        r.last_use_at = Instant::now();
    }

    /// Drops one reference per id held by `owner`; refuses all if any is not held. Ids of
    /// records that are gone (an operator dropped them, with their references) are
    /// skipped: there is nothing left to release.
    pub fn release(&mut self, owner: impl Into<Holder>, ids: &[u64]) -> Result<(), CacheError> {
        let owner = owner.into();
        let mut counts: HashMap<u64, u32> = HashMap::new();
        for &id in ids.iter().filter(|id| self.records.contains_key(id)) {
            *counts.entry(id).or_default() += 1;
        }
        let held = self.held.get(&owner);
        for (&id, &n) in &counts {
            if held.and_then(|h| h.get(&id)).copied().unwrap_or(0) < n {
                return Err(CacheError::NotReferenced(id));
            }
        }
        for (id, n) in counts {
            self.unref(owner, id, n);
        }
        Ok(())
    }

    /// Releases everything the connection `conn` holds, under any lease (it closed);
    /// returns how many references.
    pub fn release_owner(&mut self, conn: Owner) -> u64 {
        let holders: Vec<Holder> = self.held.keys().filter(|h| h.conn == conn).copied().collect();
        holders.into_iter().map(|h| self.release_lease(h)).sum()
    }

    /// Releases everything one holder holds (its request ended, however); returns how
    /// many references (0 if it holds nothing).
    pub fn release_lease(&mut self, holder: Holder) -> u64 {
        let held: Vec<(u64, u32)> =
            self.held.get(&holder).map(|h| h.iter().map(|(&id, &n)| (id, n)).collect()).unwrap_or_default();
        held.iter().for_each(|&(id, n)| self.unref(holder, id, n));
        held.iter().map(|&(_, n)| u64::from(n)).sum()
    }

    /// Whether this holder holds any reference.
    pub fn holds(&self, holder: Holder) -> bool {
        self.held.contains_key(&holder)
    }

    fn unref(&mut self, owner: Holder, id: u64, n: u32) {
        if let Some(h) = self.held.get_mut(&owner) {
            let c = h.get_mut(&id).expect("validated");
            *c -= n;
            if *c == 0 {
                h.remove(&id);
            }
            if h.is_empty() {
                self.held.remove(&owner);
            }
        }
        self.tick += 1;
        let tick = self.tick;
        let still_held = self.held.get(&owner).is_some_and(|h| h.contains_key(&id));
        let r = self.records.get_mut(&id).expect("validated");
        r.refs -= n;
        r.last_use = tick;
        r.last_use_at = Instant::now();
        let writer_left = !r.data_ready && r.writer == owner && !still_held;
        if r.refs == 0 {
            if r.data_ready {
                self.lru.insert(tick, id);
            } else {
                // Its writer gave up before writing: nobody else can, so drop it now and
                // let the next request for these bytes start afresh.
                self.remove(id);
            }
        } else if writer_left {
            // Others still hold it, but its bytes will never come: hide it from lookups
            // (the next request starts afresh) and let waiters fail now.
            self.abandon(id);
        }
    }

    /// Removes a record and frees its blocks.
    fn remove(&mut self, id: u64) {
        if let Some(r) = self.remove_record(id) {
            self.slots.release(r.start_index, u64::from(r.token_num));
            self.pages.release(r.data_page, r.pages());
        }
    }

    /// Removes a record whose blocks the allocators no longer hold.
    fn remove_record(&mut self, id: u64) -> Option<Record> {
        let r = self.records.remove(&id)?;
        if r.refs == 0 {
            self.lru.remove(&r.last_use);
        }
        self.unwritten.remove(&(r.created, id));
        if let Some(ids) = self.by_key.get_mut(&r.digest.key) {
            ids.retain(|&x| x != id);
            if ids.is_empty() {
                self.by_key.remove(&r.digest.key);
            }
        }
        Some(r)
    }

    pub fn set_data_ready(&mut self, ids: &[u64]) -> Result<(), CacheError> {
        for &id in ids {
            match self.records.get(&id) {
                None => return Err(CacheError::UnknownItem(id)),
                // Too late: the record was given up on, and may be dropped any moment.
                Some(r) if r.abandoned => return Err(CacheError::Abandoned(id)),
                Some(_) => {}
            }
        }
        for &id in ids {
            let r = self.records.get_mut(&id).expect("checked");
            r.data_ready = true;
            let created = r.created;
            self.unwritten.remove(&(created, id));
        }
        Ok(())
    }

    /// Marks items' embeddings written; ids of items that are gone (evicted after an
    /// operator's drop, say) are skipped: nobody can read their rows any more.
    pub fn set_embed_ready(&mut self, ids: &[u64]) {
        for id in ids {
            if let Some(r) = self.records.get_mut(id) {
                r.embed_ready = true;
            }
        }
    }

    pub fn data_ready(&self, ids: &[u64]) -> Result<Vec<bool>, CacheError> {
        ids.iter()
            .map(|id| match self.records.get(id) {
                None => Err(CacheError::UnknownItem(*id)),
                Some(r) if r.abandoned => Err(CacheError::Abandoned(*id)),
                Some(r) => Ok(r.data_ready),
            })
            .collect()
    }

    /// Each item's state for the encoder, pinning for `owner` those that still need
    /// their embedding.
    pub fn pin_unready(&mut self, owner: impl Into<Holder>, ids: &[u64]) -> Vec<PinState> {
        let owner = owner.into();
        ids.iter()
            .map(|&id| match self.records.get(&id) {
                Some(r) if r.abandoned => PinState::Gone,
                Some(r) if r.embed_ready => PinState::Ready,
                Some(_) => {
                    self.take_ref(owner, id);
                    PinState::Pinned
                }
                None => PinState::Gone,
            })
            .collect()
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            items: self.records.len() as u64,
            max_items: self.limits.items,
            slots_total: self.slots.total(),
            slots_used: self.slots.used(),
            largest_free_block: self.slots.largest_free_block(),
            references: self.records.values().map(|r| u64::from(r.refs)).sum(),
            hits: self.hits,
            misses: self.misses,
            evictions: self.evictions,
            data_bytes: self.records.values().map(|r| r.data_len).sum(),
            data_bytes_total: self.pages.total() * DATA_PAGE,
            waiting: 0,
            cancelled_leases: 0,
        }
    }

    /// Items, most recently used first.
    pub fn list(&self) -> Vec<ItemInfo> {
        let now = Instant::now();
        let mut v: Vec<(&u64, &Record)> = self.records.iter().collect();
        v.sort_by_key(|(_, r)| std::cmp::Reverse(r.last_use));
        v.into_iter()
            .map(|(_, r)| ItemInfo {
                digest: r.digest.key,
                modality: r.modality,
                start_slot: r.start_index,
                slots: r.token_num,
                references: r.refs,
                data_bytes: r.data_len,
                embed_ready: r.embed_ready,
                data_ready: r.data_ready,
                stuck: self.is_stuck(r, now),
                idle_ms: now.duration_since(r.last_use_at).as_millis() as u64,
                age_ms: now.duration_since(r.created).as_millis() as u64,
            })
            .collect()
    }

    /// Referenced, but its bytes never came (abandoned, or past the data timeout): what
    /// holds it is stuck or leaked.
    fn is_stuck(&self, r: &Record, now: Instant) -> bool {
        r.refs > 0 && !r.data_ready && (r.abandoned || now.duration_since(r.created) >= self.data_timeout)
    }

    /// Drops the record(s) with this md5 together with every reference to them: for
    /// stuck items (see [`ItemInfo::stuck`]), or any item with `force`. A holder that
    /// still uses a dropped item's slots would see them reused: this is an operator's
    /// repair, not a routine eviction.
    pub fn drop_item(&mut self, key: ItemKey, force: bool, now: Instant) -> Result<u64, AdminError> {
        let ids: Vec<u64> = self.records.iter().filter(|(_, r)| r.digest.key == key).map(|(&id, _)| id).collect();
        if ids.is_empty() {
            return Err(AdminError::NotFound(key));
        }
        if !force && let Some(r) = ids.iter().map(|id| &self.records[id]).find(|r| !self.is_stuck(r, now)) {
            return Err(AdminError::NotStuck { digest: key, references: r.refs });
        }
        for &id in &ids {
            self.held.retain(|_, h| {
                h.remove(&id);
                !h.is_empty()
            });
            let r = self.records.get_mut(&id).expect("listed");
            if r.refs > 0 {
                r.refs = 0;
                self.tick += 1;
                r.last_use = self.tick;
                self.lru.insert(self.tick, id);
            }
            self.remove(id);
        }
        self.evictions += ids.len() as u64;
        Ok(ids.len() as u64)
    }

    /// Evicts the item(s) with this md5; refused if any is referenced.
    pub fn evict(&mut self, key: ItemKey) -> Result<u64, AdminError> {
        let ids = self.by_key.get(&key).cloned().ok_or(AdminError::NotFound(key))?;
        if let Some(r) = ids.iter().map(|id| &self.records[id]).find(|r| r.refs > 0) {
            return Err(AdminError::Referenced { digest: key, references: r.refs });
        }
        ids.iter().for_each(|&id| self.remove(id));
        self.evictions += ids.len() as u64;
        Ok(ids.len() as u64)
    }

    /// Evicts every unreferenced item.
    pub fn clear_unreferenced(&mut self) -> u64 {
        let ids: Vec<u64> = self.lru.values().copied().collect();
        ids.iter().for_each(|&id| self.remove(id));
        self.evictions += ids.len() as u64;
        ids.len() as u64
    }

    /// Checks the accounting (tests): allocators consistent, free + used = total, every
    /// record's blocks disjoint, references equal what owners hold, LRU = unreferenced.
    pub fn check(&self) -> Result<(), String> {
        self.slots.check()?;
        self.pages.check()?;
        let used_slots: u64 = self.records.values().map(|r| u64::from(r.token_num)).sum();
        let used_pages: u64 = self.records.values().map(Record::pages).sum();
        if used_slots != self.slots.used() || used_pages != self.pages.used() {
            return Err(format!(
                "records use {used_slots} slots / {used_pages} pages, allocators say {} / {}",
                self.slots.used(),
                self.pages.used()
            ));
        }
        let mut blocks: Vec<(u64, u64)> = self
            .records
            .values()
            .filter(|r| r.token_num > 0)
            .map(|r| (r.start_index, u64::from(r.token_num)))
            .collect();
        blocks.sort();
        if blocks.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
            return Err("slot blocks overlap".into());
        }
        for (id, r) in &self.records {
            let owned: u32 = self.held.values().filter_map(|h| h.get(id)).sum();
            if owned != r.refs {
                return Err(format!("record {id} has {} refs but owners hold {owned}", r.refs));
            }
            if (r.refs == 0) != (self.lru.get(&r.last_use) == Some(id)) {
                return Err(format!("record {id}: LRU membership disagrees with refs {}", r.refs));
            }
        }
        if self.lru.len() != self.records.values().filter(|r| r.refs == 0).count() {
            return Err("LRU holds records that are gone".into());
        }
        let unwritten = self.records.iter().filter(|(_, r)| !r.data_ready && !r.abandoned);
        if unwritten.clone().count() != self.unwritten.len()
            || unwritten.into_iter().any(|(&id, r)| !self.unwritten.contains(&(r.created, id)))
        {
            return Err("the data deadlines disagree with the records".into());
        }
        if self.by_key.values().flatten().any(|id| self.records.get(id).is_none_or(|r| r.abandoned)) {
            return Err("the index finds an abandoned or missing record".into());
        }
        if self.records.len() as u64 > self.limits.items {
            return Err("more records than the item limit".into());
        }
        Ok(())
    }
}
