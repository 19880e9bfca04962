//! The cache's rules, on the state itself: sharing, LRU, capacity, owners, identity.

use std::time::{Duration, Instant};

use mmserve_embed_cache::state::{CacheState, DATA_PAGE, Holder, Limits, Owner, Refusal};
use mmserve_protocol::{AdminError, AllocItem, CacheError, ItemDigest, ItemKey, ItemRecord, Modality, PinState};
use proptest::prelude::*;

fn digest(b: u8) -> ItemDigest {
    ItemDigest { key: ItemKey([b; 16]), confirm: [b; 32] }
}

fn item(b: u8, tokens: u32) -> AllocItem {
    AllocItem { digest: digest(b), modality: Modality::Image, token_num: tokens, data_len: 100 }
}

fn limits(slots: u64, items: u64) -> Limits {
    Limits { slots, items, data_bytes: 1 << 20, request_slots: slots }
}

const A: Owner = 1;
const B: Owner = 2;

fn alloc(s: &mut CacheState, owner: impl Into<Holder>, items: &[AllocItem]) -> Vec<ItemRecord> {
    let recs = s.try_alloc(owner, items).unwrap_or_else(|e| panic!("{e:?}"));
    let ids: Vec<u64> = recs.iter().filter(|r| r.write_data).map(|r| r.id).collect();
    s.set_data_ready(&ids).unwrap();
    s.check().unwrap();
    recs
}

fn ids(recs: &[ItemRecord]) -> Vec<u64> {
    recs.iter().map(|r| r.id).collect()
}

#[test]
fn hits_share_a_record_and_token_ranges_are_never_reused() {
    let mut s = CacheState::new(limits(100, 10));
    let a = alloc(&mut s, A, &[item(1, 10), item(1, 10)]);
    assert_eq!(a[0].id, a[1].id);
    assert!(a[0].write_data && !a[1].write_data, "one writer per new record");
    s.release(A, &ids(&a)).unwrap();
    let b = alloc(&mut s, B, &[item(1, 10)]);
    assert_eq!(b[0].token_id, a[0].token_id, "a hit keeps its range");
    assert!(!b[0].write_data && b[0].data_ready);
    s.release(B, &ids(&b)).unwrap();
    // Evict it by filling the cache, then bring it back: a fresh range.
    let c = alloc(&mut s, A, &[item(2, 100)]);
    s.release(A, &ids(&c)).unwrap();
    let d = alloc(&mut s, A, &[item(1, 10)]);
    assert!(d[0].token_id >= c[0].token_id + 100);
    assert_eq!(s.stats().evictions, 2);
    assert_eq!((s.stats().hits, s.stats().misses), (2, 3));
}

#[test]
fn referenced_items_are_never_evicted_and_refusals_hold_nothing() {
    let mut s = CacheState::new(limits(100, 10));
    let a = alloc(&mut s, A, &[item(1, 60)]);
    let before = s.stats();
    assert!(matches!(s.try_alloc(B, &[item(2, 30), item(3, 30)]), Err(Refusal::NotNow { .. })));
    let after = s.stats();
    assert_eq!((before.items, before.references, before.slots_used), (after.items, after.references, after.slots_used));
    s.release(A, &ids(&a)).unwrap();
    assert_eq!(alloc(&mut s, B, &[item(2, 30), item(3, 30)]).len(), 2);
    assert_eq!(s.stats().evictions, 1);
}

#[test]
fn eviction_is_lru_and_only_as_much_as_needed() {
    let mut s = CacheState::new(limits(30, 10));
    for b in 1..=3 {
        let r = alloc(&mut s, A, &[item(b, 10)]);
        s.release(A, &ids(&r)).unwrap();
    }
    let r = alloc(&mut s, A, &[item(1, 10)]); // item 2 is now the oldest
    s.release(A, &ids(&r)).unwrap();
    alloc(&mut s, A, &[item(4, 10)]);
    assert_eq!(s.stats().evictions, 1);
    let left: Vec<ItemKey> = s.list().iter().map(|i| i.digest).collect();
    assert!(left.contains(&ItemKey([1; 16])) && left.contains(&ItemKey([3; 16])));
    assert!(!left.contains(&ItemKey([2; 16])));
}

#[test]
fn what_can_never_fit_is_refused_naming_the_limit() {
    let mut s = CacheState::new(Limits { slots: 100, items: 2, data_bytes: 4 * DATA_PAGE, request_slots: 50 });
    let never = |r: Result<Vec<ItemRecord>, Refusal>| match r {
        Err(Refusal::Never(CacheError::TooLarge { flag, .. })) => flag,
        other => panic!("{other:?}"),
    };
    assert!(never(s.try_alloc(A, &[item(1, 51)])).contains("request-share"));
    assert!(never(s.try_alloc(A, &[item(1, 1), item(2, 1), item(3, 1)])).contains("--embed-cache-items"));
    let big = AllocItem { data_len: 5 * DATA_PAGE, ..item(1, 1) };
    assert!(never(s.try_alloc(A, &[big])).contains("data-size"));
    s.check().unwrap();
}

#[test]
fn references_belong_to_their_owner() {
    let mut s = CacheState::new(limits(100, 10));
    let a = alloc(&mut s, A, &[item(1, 5), item(2, 5)]);
    let b = alloc(&mut s, B, &[item(1, 5)]);
    assert!(matches!(s.release(B, &ids(&a)), Err(CacheError::NotReferenced(_))), "B does not hold item 2");
    assert!(matches!(s.release(A, &[a[0].id, a[0].id]), Err(CacheError::NotReferenced(_))));
    assert_eq!(s.stats().references, 3, "refused releases release nothing");
    // A's connection closes: everything A held goes, B's reference stays.
    assert_eq!(s.release_owner(A), 2);
    assert_eq!(s.stats().references, 1);
    s.release(B, &ids(&b)).unwrap();
    assert_eq!(s.stats().references, 0);
    s.check().unwrap();
}

#[test]
fn a_record_whose_writer_left_is_dropped() {
    let mut s = CacheState::new(limits(10, 2));
    let a = s.try_alloc(A, &[item(1, 5)]).unwrap();
    assert!(a[0].write_data);
    s.release_owner(A);
    assert_eq!(s.stats().items, 0);
    s.check().unwrap();
}

#[test]
fn md5_collisions_never_share_a_record() {
    let hex = |s: &str| -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    };
    // A published pair of 128-byte blocks with equal md5 (Wang et al.; Selinger's demo).
    let a = hex(
        "d131dd02c5e6eec4693d9a0698aff95c2fcab58712467eab4004583eb8fb7f8955ad340609f4b30283e488832571415a085125e8f7cdc99fd91dbdf280373c5bd8823e3156348f5bae6dacd436c919c6dd53e2b487da03fd02396306d248cda0e99f33420f577ee8ce54b67080a80d1ec69821bcb6a8839396f9652b6ff72a70",
    );
    let b = hex(
        "d131dd02c5e6eec4693d9a0698aff95c2fcab50712467eab4004583eb8fb7f8955ad340609f4b30283e4888325f1415a085125e8f7cdc99fd91dbd7280373c5bd8823e3156348f5bae6dacd436c919c6dd53e23487da03fd02396306d248cda0e99f33420f577ee8ce54b67080280d1ec69821bcb6a8839396f965ab6ff72a70",
    );
    let (da, db) =
        (ItemDigest::compute(Modality::Image, "model", &a), ItemDigest::compute(Modality::Image, "model", &b));
    assert_eq!(da.key, db.key, "the pair collides under our key");
    let mut s = CacheState::new(limits(100, 10));
    let ra = alloc(&mut s, A, &[AllocItem { digest: da, modality: Modality::Image, token_num: 4, data_len: 128 }]);
    let rb = alloc(&mut s, A, &[AllocItem { digest: db, modality: Modality::Image, token_num: 4, data_len: 128 }]);
    assert_ne!(ra[0].id, rb[0].id, "equal md5, different bytes: different records");
    assert_ne!(ra[0].start_index, rb[0].start_index);
    assert!(rb[0].write_data && !rb[0].embed_ready, "the second is a miss, encoded for itself");
    assert_eq!((s.stats().hits, s.stats().misses), (0, 2));
    // And each still hits itself.
    let again = alloc(&mut s, B, &[AllocItem { digest: da, modality: Modality::Image, token_num: 4, data_len: 128 }]);
    assert_eq!(again[0].id, ra[0].id);
    // Evicting by digest takes both (they share it), once unreferenced.
    assert!(s.evict(da.key).is_err());
    s.release_owner(A);
    s.release_owner(B);
    assert_eq!(s.evict(da.key).unwrap(), 2);
    s.check().unwrap();
}

#[derive(Debug, Clone)]
enum Op {
    Alloc { owner: Owner, items: Vec<(u8, u32, u64)> },
    Release { owner: Owner, pick: prop::sample::Index },
    Drop(Owner),
    Evict(u8),
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    let item = (0u8..24, 1u32..30, 1u64..20_000);
    prop_oneof![
        4 => (0u64..4, prop::collection::vec(item, 1..5)).prop_map(|(owner, items)| Op::Alloc { owner, items }),
        3 => (0u64..4, any::<prop::sample::Index>()).prop_map(|(owner, pick)| Op::Release { owner, pick }),
        1 => (0u64..4).prop_map(Op::Drop),
        1 => (0u8..24).prop_map(Op::Evict),
        1 => Just(Op::Clear),
    ]
}

proptest! {
    /// Random alloc / release / owner-drop / evict / clear sequences keep the accounting
    /// exact, never evict a referenced item, and refuse only what does not fit.
    #[test]
    fn accounting_stays_exact(ops in prop::collection::vec(op(), 1..120)) {
        let mut s = CacheState::new(Limits { slots: 120, items: 12, data_bytes: 40 * DATA_PAGE, request_slots: 100 });
        let mut held: Vec<(Owner, u64)> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc { owner, items } => {
                    // Sizes follow the byte, so the same digest always has the same size.
                    let items: Vec<AllocItem> = items.iter().map(|&(b, _, _)| AllocItem {
                        digest: digest(b), modality: Modality::Image,
                        token_num: 1 + u32::from(b) % 29, data_len: 1 + u64::from(b) * 997,
                    }).collect();
                    let referenced_before: Vec<ItemKey> = s.list().iter().filter(|i| i.references > 0).map(|i| i.digest).collect();
                    match s.try_alloc(owner, &items) {
                        Ok(recs) => {
                            let writers: Vec<u64> = recs.iter().filter(|r| r.write_data).map(|r| r.id).collect();
                            s.set_data_ready(&writers).unwrap();
                            held.extend(recs.iter().map(|r| (owner, r.id)));
                            let now: Vec<ItemKey> = s.list().iter().map(|i| i.digest).collect();
                            for k in referenced_before {
                                prop_assert!(now.contains(&k), "a referenced item was evicted");
                            }
                        }
                        Err(Refusal::NotNow { .. }) => {
                            // Only when referenced items block it.
                            prop_assert!(s.stats().references > 0);
                        }
                        Err(Refusal::Never(_)) => {}
                    }
                }
                Op::Release { owner, pick } => {
                    let mine: Vec<usize> = held.iter().enumerate().filter(|(_, h)| h.0 == owner).map(|(i, _)| i).collect();
                    if !mine.is_empty() {
                        let (_, id) = held.swap_remove(mine[pick.index(mine.len())]);
                        s.release(owner, &[id]).unwrap();
                    }
                }
                Op::Drop(owner) => {
                    let n = held.iter().filter(|h| h.0 == owner).count() as u64;
                    prop_assert_eq!(s.release_owner(owner), n);
                    held.retain(|h| h.0 != owner);
                }
                Op::Evict(b) => { let _ = s.evict(ItemKey([b; 16])); }
                Op::Clear => { s.clear_unreferenced(); }
            }
            prop_assert!(s.check().is_ok(), "{:?}", s.check());
            prop_assert_eq!(s.stats().references, held.len() as u64);
        }
    }
}

#[test]
fn an_upload_abandoned_while_others_wait_fails_them_at_once() {
    let mut s = CacheState::new(limits(100, 10));
    let a = s.try_alloc(A, &[item(1, 5)]).unwrap(); // A creates it and must write it
    let b = s.try_alloc(B, &[item(1, 5)]).unwrap(); // B shares it, waiting for A's bytes
    assert!(a[0].write_data && !b[0].write_data);
    s.release_owner(A); // A leaves without writing
    assert!(matches!(s.data_ready(&[b[0].id]), Err(CacheError::Abandoned(_))), "B's wait fails now");
    // A new request for the same bytes starts afresh, with its own record and writer.
    let c = s.try_alloc(A, &[item(1, 5)]).unwrap();
    assert!(c[0].write_data && c[0].id != b[0].id);
    s.check().unwrap();
    s.release(B, &[b[0].id]).unwrap();
    assert_eq!(s.stats().items, 1, "the abandoned record went with its last reference");
    s.check().unwrap();
}

#[test]
fn pins_keep_items_from_eviction_and_skip_missing_ones() {
    const ENCODER: Owner = 9;
    let mut s = CacheState::new(limits(10, 10));
    let a = alloc(&mut s, A, &[item(1, 10)]);
    assert_eq!(s.pin_unready(ENCODER, &[a[0].id, 12345]), vec![PinState::Pinned, PinState::Gone]);
    s.release(A, &ids(&a)).unwrap();
    // Pinned by the encoder: a request that needs the room must wait.
    assert!(matches!(s.try_alloc(B, &[item(2, 10)]), Err(Refusal::NotNow { .. })));
    s.release(ENCODER, &ids(&a)).unwrap();
    alloc(&mut s, B, &[item(2, 10)]);
    s.check().unwrap();
}

#[test]
fn ids_start_where_the_instance_says() {
    let mut s = CacheState::with_first_id(limits(10, 10), 7 << 31);
    let a = alloc(&mut s, A, &[item(1, 1)]);
    assert_eq!(a[0].id, 7 << 31);
}

fn lease(conn: Owner, lease: u64) -> Holder {
    Holder { conn, lease }
}

#[test]
fn a_lease_gives_back_exactly_what_it_holds() {
    let mut s = CacheState::new(limits(100, 10));
    let one = alloc(&mut s, lease(A, 1), &[item(1, 5), item(2, 5)]);
    let two = alloc(&mut s, lease(A, 2), &[item(2, 5)]);
    alloc(&mut s, A, &[item(3, 5)]);
    assert_eq!(s.release_lease(lease(A, 1)), 2);
    assert_eq!(s.release_lease(lease(A, 1)), 0, "a lease is given back once");
    assert!(!s.holds(lease(A, 1)) && s.holds(lease(A, 2)));
    assert!(matches!(s.release(A, &ids(&two)), Err(CacheError::NotReferenced(_))), "lease 2's, not the connection's");
    assert_eq!(s.stats().references, 2);
    s.check().unwrap();
    assert_eq!(s.release_owner(A), 2, "the connection's close takes every lease with it");
    assert_eq!(s.stats().references, 0);
    assert_eq!(one[1].id, two[0].id, "leases of one connection share records");
    s.check().unwrap();
}

#[test]
fn an_unwritten_item_is_abandoned_at_its_data_deadline() {
    let mut s = CacheState::new(limits(100, 10)).with_data_timeout(Duration::from_secs(30));
    let t0 = Instant::now();
    let a = s.try_alloc(lease(A, 1), &[item(1, 5)]).unwrap(); // its writer never writes
    let b = s.try_alloc(B, &[item(1, 5)]).unwrap();
    assert!(a[0].write_data && !b[0].write_data);
    assert!(s.data_deadline(&[b[0].id]).is_some_and(|d| d >= t0 + Duration::from_secs(30)));
    assert_eq!(s.expire_unwritten(t0 + Duration::from_secs(29)), 0, "not yet");
    assert_eq!(s.expire_unwritten(Instant::now() + Duration::from_secs(31)), 1);
    assert!(matches!(s.data_ready(&[b[0].id]), Err(CacheError::Abandoned(_))), "waiters fail at once");
    assert!(matches!(s.set_data_ready(&[a[0].id]), Err(CacheError::Abandoned(_))), "a late write is refused");
    assert_eq!(s.data_deadline(&[b[0].id]), None);
    let c = s.try_alloc(lease(A, 2), &[item(1, 5)]).unwrap();
    assert!(c[0].write_data && c[0].id != a[0].id, "the next request starts afresh");
    s.check().unwrap();
    s.release_lease(lease(A, 1));
    s.release(B, &ids(&b)).unwrap();
    assert_eq!(s.stats().items, 1, "the abandoned record went with its last reference");
    s.check().unwrap();
    // An unreferenced unwritten record cannot exist, and a written one never expires.
    s.set_data_ready(&ids(&c)).unwrap();
    assert_eq!(s.expire_unwritten(Instant::now() + Duration::from_secs(3600)), 0);
    s.check().unwrap();
}

#[test]
fn stuck_items_are_listed_and_dropped_with_their_references() {
    let mut s = CacheState::new(limits(100, 10)).with_data_timeout(Duration::ZERO);
    let leaked = s.try_alloc(lease(A, 1), &[item(1, 5)]).unwrap(); // never written, never released
    let busy = alloc(&mut s, B, &[item(2, 5)]); // written, in use
    let listed = s.list();
    let info = |b: u8| listed.iter().find(|i| i.digest == ItemKey([b; 16])).unwrap().clone();
    assert!(info(1).stuck && !info(1).data_ready);
    assert!(!info(2).stuck && info(2).data_ready);
    assert!(matches!(s.drop_item(ItemKey([2; 16]), false, Instant::now()), Err(AdminError::NotStuck { .. })));
    assert_eq!(s.drop_item(ItemKey([1; 16]), false, Instant::now()).unwrap(), 1);
    assert_eq!(s.stats().references, 1);
    assert_eq!(s.release_lease(lease(A, 1)), 0, "its references went with it");
    assert!(matches!(s.data_ready(&ids(&leaked)), Err(CacheError::UnknownItem(_))));
    s.check().unwrap();
    const ENCODER: Owner = 9;
    assert_eq!(s.pin_unready(ENCODER, &[busy[0].id]), vec![PinState::Pinned]);
    assert_eq!(s.drop_item(ItemKey([2; 16]), true, Instant::now()).unwrap(), 1, "force drops a referenced item");
    s.release(ENCODER, &[busy[0].id]).unwrap(); // a pin of a dropped item: nothing left to release
    assert_eq!((s.stats().items, s.stats().references, s.stats().slots_used), (0, 0, 0));
    assert!(matches!(s.drop_item(ItemKey([9; 16]), true, Instant::now()), Err(AdminError::NotFound(_))));
    s.check().unwrap();
}
