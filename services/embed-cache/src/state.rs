//! The cache's records and the rules that govern them.
//!
//! Invariants:
//! - an item with references is never evicted;
//! - `alloc` is all-or-nothing: on error nothing is held and nothing was evicted;
//! - virtual token-id ranges come from a counter and are never reused;
//! - every record owns its raw-data segment and its slot block; both go when it goes.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use mmserve_protocol::{AllocItem, CacheError, CacheStats, ItemKey, ItemRecord, Modality, VIRTUAL_TOKEN_BASE};
use mmserve_shm::Segment;

use crate::slots::SlotAllocator;

struct Record {
    key: ItemKey,
    #[allow(dead_code)] // listed by the admin RPC (issue "complete embed-cache")
    modality: Modality,
    token_id: u64,
    token_num: u32,
    start_index: u64,
    data_ready: bool,
    embed_ready: bool,
    refs: u32,
    /// Tick of the last use; the key of this record in `lru` while unreferenced.
    last_use: u64,
    #[allow(dead_code)]
    created: Instant,
    data: Segment,
}

pub struct CacheState {
    shm_prefix: String,
    records: HashMap<u64, Record>,
    by_key: HashMap<ItemKey, u64>,
    /// Unreferenced records by last use, oldest first: the eviction order.
    lru: BTreeMap<u64, u64>,
    slots: SlotAllocator,
    max_items: u64,
    next_id: u64,
    next_token_id: u64,
    tick: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
}

impl CacheState {
    pub fn new(shm_prefix: String, slots: u64, max_items: u64) -> Self {
        CacheState {
            shm_prefix,
            records: HashMap::new(),
            by_key: HashMap::new(),
            lru: BTreeMap::new(),
            slots: SlotAllocator::new(slots),
            max_items,
            next_id: 1,
            next_token_id: VIRTUAL_TOKEN_BASE,
            tick: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
        }
    }

    pub fn alloc(&mut self, items: &[AllocItem]) -> Result<Vec<ItemRecord>, CacheError> {
        // The distinct items this request adds.
        let mut new: Vec<&AllocItem> = Vec::new();
        for item in items {
            if !self.by_key.contains_key(&item.key) && !new.iter().any(|n| n.key == item.key) {
                new.push(item);
            }
        }
        let needed_items = new.len() as u64;
        let needed_slots: u64 = new.iter().map(|i| u64::from(i.token_num)).sum();
        if needed_items > self.max_items {
            return Err(CacheError::TooLarge { what: "items".into(), needed: needed_items, limit: self.max_items });
        }
        if needed_slots > self.slots.total() {
            return Err(CacheError::TooLarge {
                what: "embedding slots".into(),
                needed: needed_slots,
                limit: self.slots.total(),
            });
        }

        // Plan on a copy of the allocator: evict the least recently used unreferenced
        // records (not ones this request is about to use) until every new item has a block.
        let in_request: Vec<u64> = items.iter().filter_map(|i| self.by_key.get(&i.key).copied()).collect();
        let mut plan = self.slots.clone();
        let mut victims = Vec::new();
        let mut candidates = self.lru.values().copied().filter(|id| !in_request.contains(id));
        let starts = loop {
            let items_fit = self.records.len() as u64 - victims.len() as u64 + needed_items <= self.max_items;
            if items_fit {
                let mut trial = plan.clone();
                let placed: Option<Vec<u64>> = new.iter().map(|i| trial.alloc(u64::from(i.token_num))).collect();
                if let Some(starts) = placed {
                    plan = trial;
                    break starts;
                }
            }
            match candidates.next() {
                Some(id) => {
                    let r = &self.records[&id];
                    plan.release(r.start_index, u64::from(r.token_num));
                    victims.push(id);
                }
                None => return Err(CacheError::Full { needed_slots, needed_items }),
            }
        };

        // Create the data segments before changing anything, so a failure holds nothing.
        let first_id = self.next_id;
        let mut segments = Vec::with_capacity(new.len());
        for (n, item) in new.iter().enumerate() {
            let name = format!("{}-d{}", self.shm_prefix, first_id + n as u64);
            let size = usize::try_from(item.data_len).map_err(|_| CacheError::SharedMemory("item too large".into()))?;
            segments.push(Segment::create(&name, size).map_err(|e| CacheError::SharedMemory(e.to_string()))?);
        }

        for id in victims {
            self.remove(id);
            self.evictions += 1;
        }
        self.slots = plan;
        let now = Instant::now();
        for ((item, start), data) in new.iter().zip(starts).zip(segments) {
            let id = self.next_id;
            self.next_id += 1;
            let token_id = self.next_token_id;
            self.next_token_id += u64::from(item.token_num);
            self.records.insert(
                id,
                Record {
                    key: item.key,
                    modality: item.modality,
                    token_id,
                    token_num: item.token_num,
                    start_index: start,
                    data_ready: false,
                    embed_ready: false,
                    refs: 0,
                    last_use: 0,
                    created: now,
                    data,
                },
            );
            self.by_key.insert(item.key, id);
        }

        // One reference per requested item; the creator of a record writes its data.
        let mut out = Vec::with_capacity(items.len());
        let mut writers_assigned: Vec<u64> = Vec::new();
        for item in items {
            let id = self.by_key[&item.key];
            let is_new = new.iter().any(|n| n.key == item.key);
            let write_data = is_new && !writers_assigned.contains(&id);
            if write_data {
                writers_assigned.push(id);
                self.misses += 1;
            } else {
                self.hits += 1;
            }
            self.touch(id, 1);
            let r = &self.records[&id];
            out.push(ItemRecord {
                id,
                key: r.key,
                token_id: r.token_id,
                token_num: r.token_num,
                start_index: r.start_index,
                data_ready: r.data_ready,
                embed_ready: r.embed_ready,
                data_segment: r.data.name().to_string(),
                data_len: r.data.len() as u64,
                write_data,
            });
        }
        Ok(out)
    }

    /// Adds `delta` references and marks the record used now.
    fn touch(&mut self, id: u64, delta: u32) {
        self.tick += 1;
        let tick = self.tick;
        let r = self.records.get_mut(&id).expect("touched record exists");
        if r.refs == 0 {
            self.lru.remove(&r.last_use);
        }
        r.refs += delta;
        r.last_use = tick;
    }

    pub fn release(&mut self, ids: &[u64]) -> Result<(), CacheError> {
        // Validate everything first so that a bad id releases nothing.
        let mut counts: HashMap<u64, u32> = HashMap::new();
        for &id in ids {
            *counts.entry(id).or_default() += 1;
        }
        for (&id, &n) in &counts {
            let r = self.records.get(&id).ok_or(CacheError::UnknownItem(id))?;
            if r.refs < n {
                return Err(CacheError::NotReferenced(id));
            }
        }
        for (id, n) in counts {
            self.tick += 1;
            let tick = self.tick;
            let r = self.records.get_mut(&id).expect("validated");
            r.refs -= n;
            r.last_use = tick;
            if r.refs == 0 {
                if r.data_ready {
                    self.lru.insert(tick, id);
                } else {
                    // Its writer gave up before writing: nobody else can, so drop it now
                    // and let the next request for these bytes start afresh.
                    self.remove(id);
                }
            }
        }
        Ok(())
    }

    fn remove(&mut self, id: u64) {
        if let Some(r) = self.records.remove(&id) {
            if r.refs == 0 {
                self.lru.remove(&r.last_use);
            }
            self.by_key.remove(&r.key);
            self.slots.release(r.start_index, u64::from(r.token_num));
            // Dropping `r.data` unlinks the raw-data segment.
        }
    }

    fn get_mut(&mut self, id: u64) -> Result<&mut Record, CacheError> {
        self.records.get_mut(&id).ok_or(CacheError::UnknownItem(id))
    }

    pub fn set_data_ready(&mut self, ids: &[u64]) -> Result<(), CacheError> {
        ids.iter().try_for_each(|&id| self.get_mut(id).map(|_| ()))?;
        for &id in ids {
            self.get_mut(id)?.data_ready = true;
        }
        Ok(())
    }

    pub fn set_embed_ready(&mut self, ids: &[u64]) -> Result<(), CacheError> {
        ids.iter().try_for_each(|&id| self.get_mut(id).map(|_| ()))?;
        for &id in ids {
            self.get_mut(id)?.embed_ready = true;
        }
        Ok(())
    }

    pub fn data_ready(&self, ids: &[u64]) -> Result<Vec<bool>, CacheError> {
        ids.iter().map(|id| self.records.get(id).map(|r| r.data_ready).ok_or(CacheError::UnknownItem(*id))).collect()
    }

    pub fn embed_ready(&self, ids: &[u64]) -> Result<Vec<bool>, CacheError> {
        ids.iter().map(|id| self.records.get(id).map(|r| r.embed_ready).ok_or(CacheError::UnknownItem(*id))).collect()
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            items: self.records.len() as u64,
            max_items: self.max_items,
            slots_total: self.slots.total(),
            slots_used: self.slots.used(),
            references: self.records.values().map(|r| u64::from(r.refs)).sum(),
            hits: self.hits,
            misses: self.misses,
            evictions: self.evictions,
            data_bytes: self.records.values().map(|r| r.data.len() as u64).sum(),
        }
    }

    /// Drops every record (unlinking their segments); used at shutdown.
    pub fn clear_all(&mut self) {
        self.records.clear();
        self.by_key.clear();
        self.lru.clear();
        self.slots = SlotAllocator::new(self.slots.total());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(b: u8, tokens: u32) -> AllocItem {
        AllocItem { key: ItemKey([b; 16]), modality: Modality::Image, token_num: tokens, data_len: 4 }
    }

    fn state(slots: u64, items: u64) -> CacheState {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        CacheState::new(format!("mmserve-test-{}-{n}", std::process::id()), slots, items)
    }

    fn ready(s: &mut CacheState, recs: &[ItemRecord]) {
        let ids: Vec<u64> = recs.iter().map(|r| r.id).collect();
        s.set_data_ready(&ids).unwrap();
    }

    #[test]
    fn hits_share_a_record_and_token_ranges_are_never_reused() {
        let mut s = state(100, 10);
        let a = s.alloc(&[item(1, 10), item(1, 10)]).unwrap();
        assert_eq!(a[0].id, a[1].id);
        assert!(a[0].write_data && !a[1].write_data, "one writer per new record");
        ready(&mut s, &a);
        s.release(&[a[0].id, a[1].id]).unwrap();
        let b = s.alloc(&[item(1, 10)]).unwrap();
        assert_eq!(b[0].token_id, a[0].token_id, "a hit keeps its range");
        assert!(!b[0].write_data && b[0].data_ready);
        ready(&mut s, &b);
        s.release(&[b[0].id]).unwrap();
        // Evict it by filling the cache, then bring it back: a fresh range.
        let c = s.alloc(&[item(2, 100)]).unwrap();
        ready(&mut s, &c);
        s.release(&[c[0].id]).unwrap();
        let d = s.alloc(&[item(1, 10)]).unwrap();
        assert!(d[0].token_id >= c[0].token_id + 100);
        assert_eq!(s.stats().evictions, 2);
    }

    #[test]
    fn referenced_items_are_never_evicted_and_full_holds_nothing() {
        let mut s = state(100, 10);
        let a = s.alloc(&[item(1, 60)]).unwrap();
        ready(&mut s, &a);
        let before = s.stats();
        assert!(matches!(s.alloc(&[item(2, 30), item(3, 30)]), Err(CacheError::Full { .. })));
        let after = s.stats();
        assert_eq!(
            (before.items, before.references, before.slots_used),
            (after.items, after.references, after.slots_used)
        );
        s.release(&[a[0].id]).unwrap();
        let b = s.alloc(&[item(2, 30), item(3, 30)]).unwrap();
        assert_eq!(b.len(), 2);
        assert_eq!(s.stats().evictions, 1);
    }

    #[test]
    fn eviction_is_lru_and_only_as_much_as_needed() {
        let mut s = state(30, 10);
        for b in 1..=3 {
            let r = s.alloc(&[item(b, 10)]).unwrap();
            ready(&mut s, &r);
            s.release(&[r[0].id]).unwrap();
        }
        // Use item 1 again so item 2 is now the oldest.
        let r = s.alloc(&[item(1, 10)]).unwrap();
        s.release(&[r[0].id]).unwrap();
        s.alloc(&[item(4, 10)]).unwrap();
        assert_eq!(s.stats().evictions, 1);
        assert!(s.by_key.contains_key(&ItemKey([1; 16])));
        assert!(!s.by_key.contains_key(&ItemKey([2; 16])));
        assert!(s.by_key.contains_key(&ItemKey([3; 16])));
    }

    #[test]
    fn too_large_and_bad_release() {
        let mut s = state(10, 2);
        assert!(matches!(s.alloc(&[item(1, 11)]), Err(CacheError::TooLarge { .. })));
        assert!(matches!(s.alloc(&[item(1, 1), item(2, 1), item(3, 1)]), Err(CacheError::TooLarge { .. })));
        let a = s.alloc(&[item(1, 1)]).unwrap();
        assert!(matches!(s.release(&[a[0].id, a[0].id]), Err(CacheError::NotReferenced(_))));
        assert_eq!(s.stats().references, 1, "a refused release releases nothing");
        assert!(matches!(s.release(&[999]), Err(CacheError::UnknownItem(999))));
    }

    #[test]
    fn a_record_whose_writer_left_is_dropped() {
        let mut s = state(10, 2);
        let a = s.alloc(&[item(1, 5)]).unwrap();
        let seg = a[0].data_segment.clone();
        assert_eq!(mmserve_shm::list_with_prefix(&seg), vec![seg.clone()]);
        s.release(&[a[0].id]).unwrap();
        assert_eq!(s.stats().items, 0);
        assert!(mmserve_shm::list_with_prefix(&seg).is_empty(), "its segment is unlinked");
    }
}
