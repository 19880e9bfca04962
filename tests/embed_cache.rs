//! The embed-cache service as a real process: pressure, fairness, owners, identity,
//! the admin RPC and CLI, restart and stale-segment cleanup.

mod common;

use std::process::Command;
use std::time::Duration;

use common::cache::{CacheProc, temp_dir};
use mmserve_protocol::{AllocItem, CacheError, EmbedCacheClient, ItemDigest, Modality, deadline};

fn digest(n: u32) -> ItemDigest {
    ItemDigest::compute(Modality::Image, "test", &n.to_le_bytes())
}

fn item(n: u32, tokens: u32) -> AllocItem {
    AllocItem { digest: digest(n), modality: Modality::Image, token_num: tokens, data_len: 64 }
}

const T: Duration = Duration::from_secs(20);

async fn alloc(c: &EmbedCacheClient, items: Vec<AllocItem>, wait_ms: u64) -> Result<Vec<u64>, CacheError> {
    let a = c.alloc(deadline(T), 0, items, wait_ms).await.unwrap()?;
    let writers: Vec<u64> = a.records.iter().filter(|r| r.write_data).map(|r| r.id).collect();
    c.set_items_data(deadline(T), writers).await.unwrap().unwrap();
    Ok(a.records.iter().map(|r| r.id).collect())
}

async fn release(c: &EmbedCacheClient, ids: Vec<u64>) {
    c.release(deadline(T), ids).await.unwrap().unwrap();
}

/// Returns once an alloc waits in the cache's line (fails after 10 s).
async fn until_someone_waits(c: &EmbedCacheClient) {
    let t0 = std::time::Instant::now();
    while c.stats(deadline(T)).await.unwrap().waiting == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "nobody came to wait in line");
        tokio::task::yield_now().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_multi_item_requests_at_full_capacity_never_deadlock() {
    let dir = temp_dir("stress");
    let cache =
        CacheProc::start(&dir.join("c.sock"), &format!("mmserve-test-stress-{}", std::process::id()), 60, 16, None);
    // 8 connections (as 8 api processes), 400 requests of 1–4 items from a pool of 40,
    // each item 5–15 slots: the cache is full most of the time.
    let clients: Vec<EmbedCacheClient> = futures::future::join_all((0..8).map(|_| cache.client())).await;
    let mut tasks = Vec::new();
    for r in 0u32..400 {
        let c = clients[r as usize % 8].clone();
        tasks.push(tokio::spawn(async move {
            let k = 1 + r % 4;
            let items: Vec<AllocItem> = (0..k)
                .map(|j| {
                    let n = (r * 7 + j * 13) % 40;
                    item(n, 5 + n % 11)
                })
                .collect();
            match alloc(&c, items, 5_000).await {
                Ok(ids) => {
                    tokio::task::yield_now().await;
                    release(&c, ids).await;
                    true
                }
                Err(CacheError::Full { .. }) => false,
                Err(e) => panic!("unexpected {e}"),
            }
        }));
    }
    let done = tokio::time::timeout(Duration::from_secs(60), futures::future::join_all(tasks))
        .await
        .expect("deadlock: requests did not finish");
    let ok = done.into_iter().filter(|r| *r.as_ref().unwrap()).count();
    assert!(ok >= 390, "only {ok} of 400 requests got their items");
    let stats = clients[0].stats(deadline(T)).await.unwrap();
    assert_eq!((stats.references, stats.waiting), (0, 0), "{stats:?}");
    assert!(stats.slots_used <= stats.slots_total && stats.items <= 16);
    assert!(stats.evictions > 0, "the test did not reach capacity");
    drop(clients);
    cache.stop();
}

#[tokio::test]
async fn waiting_is_first_come_first_served_and_holds_nothing() {
    let dir = temp_dir("fifo");
    let cache =
        CacheProc::start(&dir.join("c.sock"), &format!("mmserve-test-fifo-{}", std::process::id()), 100, 100, None);
    let (a, b, c) = (cache.client().await, cache.client().await, cache.client().await);
    let held = alloc(&a, vec![item(1, 90)], 0).await.unwrap();
    // Without waiting, a request that does not fit now is refused at once.
    assert!(matches!(alloc(&b, vec![item(2, 80)], 0).await, Err(CacheError::Full { waited_ms: 0, .. })));
    // B waits for 80; C's 5 would fit in the 10 free slots, but must not jump the line.
    let big = tokio::spawn({
        let b = b.clone();
        async move { alloc(&b, vec![item(2, 80)], 10_000).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let small = tokio::spawn({
        let c = c.clone();
        async move { alloc(&c, vec![item(3, 5)], 10_000).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!small.is_finished(), "a small request jumped ahead of a waiting large one");
    let stats = a.stats(deadline(T)).await.unwrap();
    assert_eq!((stats.waiting, stats.references), (2, 1), "waiters hold nothing");
    release(&a, held).await;
    let big_ids = big.await.unwrap().unwrap();
    let small_ids = small.await.unwrap().unwrap();
    // A waiter that runs out of time holds nothing and leaves the line.
    assert!(matches!(alloc(&a, vec![item(4, 60)], 200).await, Err(CacheError::Full { waited_ms: 200, .. })));
    let stats = a.stats(deadline(T)).await.unwrap();
    assert_eq!((stats.waiting, stats.references), (0, 2));
    release(&b, big_ids).await;
    release(&c, small_ids).await;
    // A waiting call that is cancelled (its deadline passes) leaves the line and holds
    // nothing afterwards, even once the room it waited for frees up.
    let held = alloc(&a, vec![item(6, 90)], 0).await.unwrap();
    let short = deadline(Duration::from_millis(200));
    assert!(b.alloc(short, 0, vec![item(7, 80)], 10_000).await.is_err(), "the call's deadline passes");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(a.stats(deadline(T)).await.unwrap().waiting, 0, "the cancelled waiter left the line");
    release(&a, held).await;
    let stats = a.stats(deadline(T)).await.unwrap();
    assert_eq!((stats.references, stats.waiting), (0, 0), "nothing was granted to the cancelled call");
    // Too large for the cache at all: refused at once, naming the limit.
    match alloc(&a, vec![item(5, 101)], 10_000).await {
        Err(CacheError::TooLarge { flag, .. }) => assert!(flag.contains("embed-cache-size")),
        other => panic!("{other:?}"),
    }
    drop((a, b, c));
    cache.stop();
}

#[tokio::test]
async fn a_closed_connection_gives_back_its_references() {
    let dir = temp_dir("owner");
    let cache =
        CacheProc::start(&dir.join("c.sock"), &format!("mmserve-test-owner-{}", std::process::id()), 100, 100, None);
    let watcher = cache.client().await;
    {
        let doomed = cache.client().await;
        alloc(&doomed, vec![item(1, 10), item(2, 10)], 0).await.unwrap();
        assert_eq!(watcher.stats(deadline(T)).await.unwrap().references, 2);
    } // the connection closes, as when an api process is killed
    let deadline_at = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let refs = watcher.stats(deadline(T)).await.unwrap().references;
        if refs == 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline_at, "references of a closed connection stayed held");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(watcher);
    cache.stop();
}

#[tokio::test]
async fn colliding_md5_inputs_get_their_own_embeddings() {
    let hex = |s: &str| -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    };
    let pair = [
        hex(
            "d131dd02c5e6eec4693d9a0698aff95c2fcab58712467eab4004583eb8fb7f8955ad340609f4b30283e488832571415a085125e8f7cdc99fd91dbdf280373c5bd8823e3156348f5bae6dacd436c919c6dd53e2b487da03fd02396306d248cda0e99f33420f577ee8ce54b67080a80d1ec69821bcb6a8839396f9652b6ff72a70",
        ),
        hex(
            "d131dd02c5e6eec4693d9a0698aff95c2fcab50712467eab4004583eb8fb7f8955ad340609f4b30283e4888325f1415a085125e8f7cdc99fd91dbd7280373c5bd8823e3156348f5bae6dacd436c919c6dd53e23487da03fd02396306d248cda0e99f33420f577ee8ce54b67080280d1ec69821bcb6a8839396f965ab6ff72a70",
        ),
    ];
    let dir = temp_dir("collide");
    let cache =
        CacheProc::start(&dir.join("c.sock"), &format!("mmserve-test-collide-{}", std::process::id()), 100, 100, None);
    let c = cache.client().await;
    let info = c.arena(deadline(T)).await.unwrap();
    let view = mmserve_arena::ArenaView::open(&info).unwrap();
    let rows = embedding_rows(&view);
    let mut records = Vec::new();
    for (n, bytes) in pair.iter().enumerate() {
        let d = ItemDigest::compute(Modality::Image, "model;clip", bytes);
        let a = c
            .alloc(
                deadline(T),
                0,
                vec![AllocItem { digest: d, modality: Modality::Image, token_num: 2, data_len: 128 }],
                0,
            )
            .await
            .unwrap()
            .unwrap();
        let r = a.records[0].clone();
        assert!(r.write_data, "item {n} must be a miss");
        view.write_data(r.data_offset, bytes).unwrap();
        // The item's two slots of 4 values (the helper's --embed-dim).
        let row = candle_core::Tensor::new(&[[n as f32; 4]; 2], &candle_core::Device::Cpu).unwrap();
        rows.write(r.start_index as usize, &row).unwrap();
        records.push(r);
    }
    assert_eq!(records[0].key, records[1].key, "equal md5");
    assert_ne!(records[0].id, records[1].id);
    for (n, r) in records.iter().enumerate() {
        assert_eq!(view.read_data(r.data_offset, 128).unwrap(), pair[n]);
        let table = candle_core::Tensor::zeros((1, 4), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        let slots = [r.start_index, r.start_index + 1].map(mmserve_ops::slot_source);
        let row = rows.gather(&table, &slots).unwrap();
        assert_eq!(row.to_vec2::<f32>().unwrap(), vec![vec![n as f32; 4]; 2], "each input keeps its own embedding");
    }
    drop((c, rows, view));
    cache.stop();
}

fn cli(admin: &str, token: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mmserve"))
        .args(["cache", "--admin-addr", admin])
        .args(args)
        .env("MMSERVE_ADMIN_TOKEN", token)
        .env("MMSERVE_LOG", "warn")
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[tokio::test]
async fn the_admin_rpc_and_cli_need_the_token() {
    let dir = temp_dir("admin");
    let cache = CacheProc::start(
        &dir.join("c.sock"),
        &format!("mmserve-test-admin-{}", std::process::id()),
        100,
        100,
        Some("s3cret"),
    );
    let admin = cache.admin.clone();
    assert!(admin.starts_with("127.0.0.1:"), "{admin}");
    let c = cache.client().await;
    let ids = alloc(&c, vec![item(1, 10), item(2, 20)], 0).await.unwrap();
    c.release(deadline(T), vec![ids[1]]).await.unwrap().unwrap();

    let (ok, out, err) = cli(&admin, "s3cret", &["stats", "--json"]);
    assert!(ok, "{err}");
    let stats: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (stats["items"].as_u64(), stats["slots_used"].as_u64(), stats["references"].as_u64()),
        (Some(2), Some(30), Some(1))
    );
    let (ok, out, _) = cli(&admin, "s3cret", &["stats"]);
    assert!(ok && out.contains("largest free block"), "{out}");

    let (ok, out, err) = cli(&admin, "s3cret", &["ls", "--json"]);
    assert!(ok, "{err}");
    let items: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(items.len(), 2);
    let busy = digest(1).key.to_string();
    let idle = digest(2).key.to_string();
    assert!(items.iter().any(|i| i["digest"] == busy.as_str() && i["references"] == 1));
    let (ok, table, _) = cli(&admin, "s3cret", &["ls"]);
    assert!(ok && table.contains(&busy) && table.contains("REFS"), "{table}");

    let (ok, _, err) = cli(&admin, "s3cret", &["evict", &busy]);
    assert!(!ok && err.contains("in use"), "evicting a referenced item must be refused: {err}");
    let (ok, out, err) = cli(&admin, "s3cret", &["evict", &idle]);
    assert!(ok && out.contains("evicted 1"), "{out}{err}");
    let (ok, _, err) = cli(&admin, "s3cret", &["evict", &idle]);
    assert!(!ok && err.contains("no item"), "{err}");
    let (ok, _, err) = cli(&admin, "s3cret", &["evict", "not-a-digest"]);
    assert!(!ok && err.contains("digest"), "{err}");

    let (ok, _, err) = cli(&admin, "wrong", &["stats"]);
    assert!(!ok && err.contains("token was refused"), "{err}");
    // The token may come from a file instead.
    let token_file = dir.join("token");
    std::fs::write(&token_file, "s3cret\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_mmserve"))
        .args(["cache", "--admin-addr", &admin, "--admin-token-file"])
        .arg(&token_file)
        .args(["stats", "--json"])
        .env_remove("MMSERVE_ADMIN_TOKEN")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // The RPC itself refuses too, whatever the client.
    let t = tarpc::serde_transport::tcp::connect(&admin, tarpc::tokio_serde::formats::Bincode::default).await.unwrap();
    let raw = mmserve_protocol::CacheAdminClient::new(Default::default(), t).spawn();
    assert!(matches!(
        raw.clear(deadline(T), "".into()).await.unwrap(),
        Err(mmserve_protocol::AdminError::Unauthorized)
    ));
    assert_eq!(raw.clear(deadline(T), "s3cret".into()).await.unwrap().unwrap(), 0, "item 1 is still referenced");

    release(&c, vec![ids[0]]).await;
    let (ok, out, _) = cli(&admin, "s3cret", &["clear"]);
    assert!(ok && out.contains("evicted 1"), "{out}");
    drop((c, raw));
    cache.stop();
    let (ok, _, err) = cli(&admin, "s3cret", &["stats"]);
    assert!(!ok && err.contains("cannot reach"), "service down must be said plainly: {err}");
}

#[tokio::test]
async fn a_restarted_cache_is_reconnected_and_a_dead_ones_segments_are_swept() {
    let dir = temp_dir("restart");
    let socket = dir.join("c.sock");
    let first = format!("mmserve-test-restart-a-{}", std::process::id());
    let second = format!("mmserve-test-restart-b-{}", std::process::id());
    let mut cache = CacheProc::start(&socket, &first, 100, 100, None);
    let conn = mmserve_protocol::reconnect::CacheConnection::connect(&socket, Duration::from_secs(5)).await.unwrap();
    let a1 = conn.call(|c| async move { c.arena(deadline(T)).await }).await.unwrap();
    let map = mmserve_arena::ArenaMap::connect(&conn, T).await.unwrap();
    assert_eq!(map.current().info.instance, a1.instance);
    let held =
        conn.call(|c| async move { c.alloc(deadline(T), 0, vec![item(1, 10)], 0).await }).await.unwrap().unwrap();
    assert_eq!(held.instance, a1.instance);

    cache.kill(); // SIGKILL: nothing is cleaned up
    assert_eq!(mmserve_shm::list_with_prefix(&format!("{first}.")).len(), 3, "arena, data and owner file left behind");
    let err = conn.call(|c| async move { c.stats(deadline(Duration::from_secs(2))).await }).await;
    assert!(err.is_err(), "a call to a dead cache fails rather than hangs");
    let ids: Vec<u64> = held.records.iter().map(|r| r.id).collect();
    assert!(conn.set_items_data(ids).await.is_err(), "a coalesced call to a dead cache fails too");

    let cache = CacheProc::start(&socket, &second, 100, 100, None);
    assert!(mmserve_shm::list_with_prefix(&format!("{first}.")).is_empty(), "the dead instance's segments were swept");
    assert_eq!(mmserve_shm::list_with_prefix(&format!("{second}.")).len(), 3);
    let a2 = conn.call(|c| async move { c.arena(deadline(T)).await }).await.expect("the client reconnects");
    assert_ne!(a1.instance, a2.instance);
    // Requests naming the new instance map its arenas once, however many ask at once;
    // one naming the dead instance outlived its cache.
    let views = futures::future::join_all((0..8).map(|_| map.view(a2.instance, &conn, T))).await;
    let new = views.iter().filter(|v| matches!(v, Ok(mmserve_arena::Mapped::New(_)))).count();
    assert_eq!(new, 1, "mapped once");
    assert!(views.iter().all(|v| v.as_ref().is_ok_and(|v| v.view().info.instance == a2.instance)));
    assert!(matches!(map.view(a1.instance, &conn, T).await, Err(mmserve_arena::ArenaError::Restarted)));
    let stats = conn.call(|c| async move { c.stats(deadline(T)).await }).await.unwrap();
    assert_eq!((stats.items, stats.references), (0, 0), "a new instance starts empty");
    let mut lease = conn.lease();
    let again =
        conn.alloc(&mut lease, vec![item(1, 10)], Duration::ZERO, T).await.expect("coalesced calls reconnect too");
    assert_eq!(again.unwrap().instance, a2.instance);
    drop(conn);
    cache.stop();
}

#[tokio::test]
async fn coalesced_calls_keep_the_line_and_all_or_nothing() {
    use mmserve_protocol::cache::{CacheOp, CacheOpResult};
    let dir = temp_dir("batch");
    let socket = dir.join("c.sock");
    let cache = CacheProc::start(&socket, &format!("mmserve-test-batch-{}", std::process::id()), 100, 100, None);
    let (a, b) = (cache.client().await, cache.client().await);
    let run = |ops: Vec<CacheOp>| {
        let a = a.clone();
        async move { a.batch(deadline(T), ops).await.unwrap() }
    };
    // Decided in order: two fit, the third would wait, and the fourth (which would fit)
    // must not overtake it.
    let r = run(vec![
        CacheOp::Alloc { lease: 1, items: vec![item(1, 30)] },
        CacheOp::Alloc { lease: 2, items: vec![item(2, 30)] },
        CacheOp::Alloc { lease: 0, items: vec![item(3, 30), item(4, 30)] },
        CacheOp::Alloc { lease: 0, items: vec![item(5, 5)] },
    ])
    .await;
    let ids: Vec<u64> = r[..2]
        .iter()
        .map(|r| match r {
            CacheOpResult::Allocated(a) => a.records[0].id,
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(matches!(r[2], CacheOpResult::MustWait), "{:?}", r[2]);
    assert!(matches!(r[3], CacheOpResult::MustWait), "{:?}", r[3]);
    assert_eq!(a.stats(deadline(T)).await.unwrap().references, 2, "nothing held for the ones told to wait");
    // Someone waits in line: a coalesced alloc that would fit still waits behind it.
    let waiter = tokio::spawn({
        let b = b.clone();
        async move { alloc(&b, vec![item(6, 60)], 10_000).await }
    });
    until_someone_waits(&a).await;
    assert!(matches!(
        run(vec![CacheOp::Alloc { lease: 0, items: vec![item(7, 5)] }]).await[0],
        CacheOpResult::MustWait
    ));
    // Errors are per operation; a release hands the room to the line first.
    let r = run(vec![
        CacheOp::SetData(vec![u64::MAX]),
        CacheOp::SetData(ids),
        CacheOp::ReleaseLease { lease: 1, linger_ms: 0 },
        CacheOp::ReleaseLease { lease: 2, linger_ms: 0 },
        CacheOp::Alloc { lease: 0, items: vec![item(8, 101)] },
    ])
    .await;
    assert!(matches!(r[0], CacheOpResult::Failed(CacheError::UnknownItem(_))), "{:?}", r[0]);
    assert!(matches!(r[1], CacheOpResult::Done), "{:?}", r[1]);
    assert!(matches!((&r[2], &r[3]), (CacheOpResult::Released(1), CacheOpResult::Released(1))), "{r:?}");
    assert!(matches!(r[4], CacheOpResult::Failed(CacheError::TooLarge { .. })), "{:?}", r[4]);
    let held = tokio::time::timeout(T, waiter).await.unwrap().unwrap().unwrap();
    release(&b, held).await;

    // Through the api's client: many concurrent requests on one connection, all
    // granted, every reference given back.
    let conn = std::sync::Arc::new(mmserve_protocol::reconnect::CacheConnection::connect(&socket, T).await.unwrap());
    let tasks = (0..64u32).map(|i| {
        let conn = conn.clone();
        async move {
            for round in 0..20u32 {
                let items = vec![item(100 + (i * 7 + round) % 40, 1), item(1000 + i * 100 + round, 1)];
                let mut lease = conn.lease();
                let a = conn.alloc(&mut lease, items, Duration::from_secs(10), T).await.unwrap().unwrap();
                let writers: Vec<u64> = a.records.iter().filter(|r| r.write_data).map(|r| r.id).collect();
                conn.set_items_data(writers).await.unwrap().unwrap();
                drop(lease);
            }
        }
    });
    futures::future::join_all(tasks).await;
    // Lease releases are queued, in order, before this call.
    conn.set_items_data(Vec::new()).await.unwrap().unwrap();
    let stats = a.stats(deadline(T)).await.unwrap();
    assert_eq!((stats.references, stats.waiting), (0, 0));
    drop((a, b, conn));
    cache.stop();
}

/// The embedding rows of `view` as the encoder and the engine see them (on the CPU).
fn embedding_rows(view: &mmserve_arena::ArenaView) -> mmserve_ops::ArenaRows {
    let r = view.embed_rows();
    let dtype = mmserve_models::parse_dtype(r.dtype.name()).unwrap();
    // SAFETY: the caller drops the rows before the view.
    unsafe { mmserve_ops::ArenaRows::new(r.ptr, r.slots, r.row_len, dtype, &candle_core::Device::Cpu).unwrap() }
}

/// The defect an adversarial run found: a request whose client vanished while its alloc
/// waited in line, just as the cache granted it, left its references held for good
/// (the grant's reply found nobody). Under a lease, the grant is given back whoever
/// sees it.
#[tokio::test]
async fn a_grant_whose_request_vanished_is_given_back() {
    let dir = temp_dir("vanish");
    let socket = dir.join("c.sock");
    let cache = CacheProc::start(&socket, &format!("mmserve-test-vanish-{}", std::process::id()), 10, 100, None);
    let blocker = cache.client().await;
    let conn = std::sync::Arc::new(mmserve_protocol::reconnect::CacheConnection::connect(&socket, T).await.unwrap());
    for round in 0..100u32 {
        // The cache is full: the request's alloc must wait in line.
        let held = alloc(&blocker, vec![item(1_000_000 + round, 10)], 0).await.unwrap();
        let request = tokio::spawn({
            let conn = conn.clone();
            async move {
                let mut lease = conn.lease();
                conn.alloc(&mut lease, vec![item(round, 10)], Duration::from_secs(10), T).await
            }
        });
        until_someone_waits(&blocker).await;
        // Room comes: the cache grants the waiting alloc as this release returns ...
        release(&blocker, held).await;
        // ... and the client is gone before the grant reaches it (or, some rounds, not).
        request.abort();
        let _ = request.await;
        conn.set_items_data(Vec::new()).await.unwrap().unwrap(); // the lease's release came first
    }
    let stats = blocker.stats(deadline(T)).await.unwrap();
    assert_eq!((stats.references, stats.waiting), (0, 0), "every grant was given back");
    drop((blocker, conn));
    cache.stop();
}

/// A lease released before its alloc is decided (the release overtook the alloc, or the
/// alloc still waits to be read): the alloc is refused when it comes, and forgotten.
#[tokio::test]
async fn an_alloc_overtaken_by_its_leases_release_is_refused() {
    let dir = temp_dir("overtaken");
    let socket = dir.join("c.sock");
    let cache = CacheProc::start(&socket, &format!("mmserve-test-overtaken-{}", std::process::id()), 100, 100, None);
    let c = cache.client().await;
    assert_eq!(c.release_lease(deadline(T), 7, 60_000).await.unwrap(), 0);
    assert_eq!(c.stats(deadline(T)).await.unwrap().cancelled_leases, 1);
    let r = c.alloc(deadline(T), 7, vec![item(1, 10)], 0).await.unwrap();
    assert!(matches!(r, Err(CacheError::Cancelled)), "{r:?}");
    let stats = c.stats(deadline(T)).await.unwrap();
    assert_eq!((stats.references, stats.cancelled_leases), (0, 0));
    // Another lease of the same connection is unaffected, and is released whole.
    let a = c.alloc(deadline(T), 8, vec![item(1, 10), item(2, 10)], 0).await.unwrap().unwrap();
    assert_eq!(a.records.len(), 2);
    assert_eq!(c.release_lease(deadline(T), 8, 60_000).await.unwrap(), 2);
    assert_eq!(c.stats(deadline(T)).await.unwrap().cancelled_leases, 0, "a lease that held something leaves no mark");
    drop(c);
    cache.stop();
}

/// A flood of connections to the admin port from someone without the token: each new
/// one beyond the cap takes the place of the oldest that has not authenticated, and
/// those that never authenticate are closed at the auth timeout; an operator gets in
/// during the flood, and the data path never notices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_connection_flood_neither_wedges_the_admin_nor_the_data_path() {
    use std::io::Read;
    let dir = temp_dir("flood");
    let cache = CacheProc::start_with(
        &dir.join("c.sock"),
        &format!("mmserve-test-flood-{}", std::process::id()),
        100,
        100,
        Some("s3cret"),
        &["--admin-max-connections", "16", "--admin-auth-timeout-s", "2"],
    );
    let admin = cache.admin.clone();
    let flood: Vec<std::net::TcpStream> = (0..500).filter_map(|_| std::net::TcpStream::connect(&admin).ok()).collect();
    assert!(flood.len() > 100, "the flood connects ({} of 500)", flood.len());
    // An operator gets in while every flood connection is still open.
    let (ok, out, err) = cli(&admin, "s3cret", &["stats", "--json"]);
    assert!(ok, "the admin answers during the flood: {err}");
    assert!(out.contains("\"items\""), "{out}");
    // The data path serves on.
    let c = cache.client().await;
    let t0 = std::time::Instant::now();
    let ids = alloc(&c, vec![item(1, 10)], 0).await.unwrap();
    release(&c, ids).await;
    assert!(t0.elapsed() < Duration::from_secs(2), "the data path waited {:?}", t0.elapsed());
    // Every flood connection is closed by the server: evicted, or at its auth timeout.
    for mut s in flood {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 1];
        match s.read(&mut b) {
            Ok(0) => {}
            Err(e) if !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            other => panic!("an unauthenticated connection stays open: {other:?}"),
        }
    }
    let (ok, _, err) = cli(&admin, "s3cret", &["stats"]);
    assert!(ok, "the admin answers after the flood: {err}");
    drop(c);
    cache.stop();
}

/// An item whose uploader never writes its bytes: waiting for it fails at the data
/// deadline instead of the waiter's own timeout, it shows as stuck, and `drop` removes
/// it with the reference that pinned it.
#[tokio::test]
async fn a_stuck_item_fails_its_waiters_at_the_deadline_and_can_be_dropped() {
    let dir = temp_dir("stuck");
    let cache = CacheProc::start_with(
        &dir.join("c.sock"),
        &format!("mmserve-test-stuck-{}", std::process::id()),
        100,
        100,
        Some("s3cret"),
        &["--embed-cache-data-timeout-s", "0.5"],
    );
    let (uploader, other) = (cache.client().await, cache.client().await);
    let a = uploader.alloc(deadline(T), 1, vec![item(1, 10)], 0).await.unwrap().unwrap();
    assert!(a.records[0].write_data); // ... and never writes
    let b = other.alloc(deadline(T), 0, vec![item(1, 10)], 0).await.unwrap().unwrap();
    assert!(!b.records[0].write_data && b.records[0].id == a.records[0].id);
    let t0 = std::time::Instant::now();
    let r = other.wait_items_data(deadline(T), vec![b.records[0].id], 10_000).await.unwrap();
    assert!(matches!(r, Err(CacheError::Abandoned(_))), "{r:?}");
    assert!(t0.elapsed() < Duration::from_secs(5), "failed at the data deadline, not after 10 s");
    release(&other, vec![b.records[0].id]).await;

    let (ok, out, err) = cli(&cache.admin, "s3cret", &["ls", "--stuck", "--json"]);
    assert!(ok, "{err}");
    let stuck: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(stuck.len(), 1, "{out}");
    assert_eq!(stuck[0]["references"], 1);
    let digest = stuck[0]["digest"].as_str().unwrap().to_string();
    let (ok, out, err) = cli(&cache.admin, "s3cret", &["drop", &digest]);
    assert!(ok && out.contains("dropped 1"), "{out}{err}");
    let stats = other.stats(deadline(T)).await.unwrap();
    assert_eq!((stats.items, stats.references, stats.slots_used), (0, 0, 0));
    // The next request for the same bytes starts afresh.
    let again = other.alloc(deadline(T), 0, vec![item(1, 10)], 0).await.unwrap().unwrap();
    assert!(again.records[0].write_data);
    drop((uploader, other));
    cache.stop();
}
