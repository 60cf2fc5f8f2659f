//! The far tier through the engine: messages past the horizon leave the
//! wheel and the WAL, come back in (due, id) order as the horizon reaches
//! them, survive a restart, and obey cancels by id, by uid and by key.

use std::collections::HashSet;
use std::time::Duration;

use super::tests::{config, keyed, start, Running};
use super::*;

const HOUR: u64 = 3_600_000;
const T0: u64 = 1_000 * HOUR;

fn far_config(dir: &std::path::Path) -> EngineConfig {
    EngineConfig {
        far: Some(FarSettings {
            horizon: Duration::from_millis(HOUR),
            near_only: HashSet::from(["kept-near".to_owned()]),
            spill: true,
            load_chunk_bytes: LOAD_CHUNK_BYTES,
        }),
        // Each test drives its rounds: a background one would race them.
        background_rounds: false,
        ..config(dir)
    }
}

/// Move the clock to `t`, run a far round (a load, if the horizon reached
/// a bucket) and wake the dispatcher.
async fn at(r: &Running, clock: &ManualClock, t: u64) {
    clock.set(t);
    r.engine.far_round().await.unwrap();
    r.engine.wake();
}

/// The identity (`x-delayd-id`) a pending message goes out with.
fn uid_of(r: &Running, id: u64) -> MessageId {
    match r.engine.read(id).unwrap() {
        Some((_, Record::Schedule { uid, .. })) => MessageId::or_legacy(uid, id),
        other => panic!("{id} is not pending: {other:?}"),
    }
}

fn body(f: &Fired) -> String {
    String::from_utf8(f.message.clone()).unwrap()
}

async fn schedule(r: &Running, route: &str, due: u64, body: &str) -> u64 {
    r.engine
        .schedule(route, due, body.as_bytes().to_vec())
        .await
        .unwrap()
}

/// Take what fires until `expected` is empty or nothing comes within
/// `within`: each once, none early.
async fn take_fired(
    r: &mut Running,
    expected: &mut std::collections::BTreeMap<MessageId, u64>,
    within: Duration,
) {
    while !expected.is_empty() {
        let Some(f) = r.recv_within(within).await else {
            return;
        };
        let due = expected.remove(&f.uid).expect("fired once, and stored");
        assert!(f.fired_ms >= due, "{} ms early", due - f.fired_ms);
    }
}

fn buckets(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir.join("far"))
        .map(|d| {
            d.filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("bucket-"))
            })
            .count()
        })
        .unwrap_or(0)
}

#[tokio::test]
async fn far_messages_leave_the_wheel_and_the_wal_and_fire_in_order_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let r = start(far_config(dir.path()), clock.clone());
    let near = schedule(&r, "orders", T0 + 10 * 60_000, "near").await;
    let mut far = Vec::new();
    for (i, due) in [
        T0 + 5 * HOUR,
        T0 + 5 * HOUR,
        T0 + 26 * HOUR,
        T0 + 5 * HOUR + 1,
        T0 + 30 * 24 * HOUR,
    ]
    .into_iter()
    .enumerate()
    {
        let body = format!("far-{i}");
        far.push((due, schedule(&r, "orders", due, &body).await, body));
    }
    let kept = schedule(&r, "kept-near", T0 + 5 * HOUR, "kept").await;
    r.engine.far_round().await.unwrap();
    let uids: std::collections::HashMap<String, MessageId> = far
        .iter()
        .map(|(_, id, body)| (body.clone(), uid_of(&r, *id)))
        .collect();

    assert_eq!(r.engine.far_pending(), 5);
    assert_eq!(r.engine.pending(), 7);
    assert_eq!(buckets(dir.path()), 3, "one file per hour of due time");
    assert_eq!(
        r.engine.state().wheel_len(),
        2,
        "only the near message and the near-only route's wait in the wheel"
    );
    // Their WAL records are retired: only the two in the wheel are live.
    assert_eq!(r.engine.space().live_records, 2);
    r.stop().await;

    // Reopened: counted from the checkpoint, no bucket read; still far.
    let mut r = start(far_config(dir.path()), clock.clone());
    assert_eq!((r.engine.far_pending(), r.engine.pending()), (5, 7));
    at(&r, &clock, T0 + 10 * 60_000).await;
    assert_eq!(r.recv().await.id, near);

    // The horizon reaches the first bucket an hour before it is due.
    at(&r, &clock, T0 + 4 * HOUR).await;
    assert_eq!(r.engine.far_pending(), 2);
    assert_eq!(buckets(dir.path()), 2);
    at(&r, &clock, T0 + 5 * HOUR + 1).await;
    let mut fired = Vec::new();
    for _ in 0..4 {
        let f = r.recv().await;
        if let Some(uid) = uids.get(&body(&f)) {
            assert_eq!(f.uid, *uid, "a loaded message keeps its x-delayd-id");
        }
        fired.push((f.due_ms, body(&f)));
    }
    // Per route: (due, arrival) order, byte-equal. The near-only route's
    // message, due with two of them, was armed before they were loaded.
    let mut want: Vec<_> = far[..2].iter().chain(&far[3..4]).cloned().collect();
    want.sort();
    let want: Vec<_> = want.into_iter().map(|(due, _, body)| (due, body)).collect();
    let (kept_fired, orders): (Vec<_>, Vec<_>) = fired.into_iter().partition(|f| f.1 == "kept");
    assert_eq!(orders, want);
    assert_eq!(kept_fired, [(T0 + 5 * HOUR, "kept".to_owned())]);
    let _ = kept;

    at(&r, &clock, T0 + 30 * 24 * HOUR).await;
    let mut rest = vec![body(&r.recv().await), body(&r.recv().await)];
    rest.sort();
    assert_eq!(rest, [far[2].2.clone(), far[4].2.clone()]);
    assert_eq!((r.engine.pending(), buckets(dir.path())), (0, 0));
    r.stop().await;
}

#[tokio::test]
async fn equal_due_times_keep_arrival_order_across_spills_and_a_load() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let mut r = start(far_config(dir.path()), clock.clone());
    let due = T0 + 3 * HOUR;
    let mut bodies = Vec::new();
    for i in 0..3 {
        bodies.push(format!("a{i}"));
        schedule(&r, "r", due, &format!("a{i}")).await;
    }
    r.engine.far_round().await.unwrap();
    for i in 0..3 {
        bodies.push(format!("b{i}"));
        schedule(&r, "r", due, &format!("b{i}")).await;
    }
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.far_pending(), 6);
    // Loaded, then more at the same instant: now in the wheel directly.
    at(&r, &clock, due - HOUR).await;
    assert_eq!(r.engine.far_pending(), 0);
    bodies.push("c".into());
    schedule(&r, "r", due, "c").await;
    at(&r, &clock, due).await;
    let mut got = Vec::new();
    for _ in 0..7 {
        got.push(body(&r.recv().await));
    }
    assert_eq!(got, bodies);
    r.stop().await;
}

#[tokio::test]
async fn a_far_message_cancelled_by_uid_never_fires_even_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let r = start(far_config(dir.path()), clock.clone());
    let due = T0 + 48 * HOUR;
    let doomed = schedule(&r, "reviews", due, "doomed").await;
    let kept = schedule(&r, "reviews", due, "kept").await;
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.far_pending(), 2);

    // As the admin API does: read, resolve the x-delayd-id, cancel.
    let (info, record) = r.engine.read(doomed).unwrap().unwrap();
    assert_eq!((info.due_ms, info.phase), (due, Phase::Waiting));
    let Record::Schedule { uid, message, .. } = record else {
        panic!("not a schedule")
    };
    assert_eq!(message, b"doomed");
    let uid = MessageId::or_legacy(uid, doomed);
    assert_eq!(r.engine.find_by_uid(uid).unwrap(), Some(doomed));
    assert!(r.engine.cancel(doomed).await.unwrap());
    assert!(!r.engine.cancel(doomed).await.unwrap(), "cancelled once");
    assert_eq!(r.engine.far_pending(), 1);
    assert_eq!(r.engine.find_by_uid(uid).unwrap(), None);
    r.stop().await;

    let mut r = start(far_config(dir.path()), clock.clone());
    assert_eq!(r.engine.far_pending(), 1);
    at(&r, &clock, due).await;
    assert_eq!(body(&r.recv().await), "kept");
    let _ = kept;
    let extra = r.recv_within(Duration::from_millis(300)).await;
    assert!(extra.is_none(), "the cancelled message fired: {extra:?}");
    r.stop().await;
}

#[tokio::test]
async fn a_cancel_by_key_reaches_far_messages_stored_before_it_only() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let mut r = start(far_config(dir.path()), clock.clone());
    let due = T0 + 10 * HOUR;
    let engine = &r.engine;
    let before = engine
        .schedule("k", due, keyed(Some("order-1"), None, "before"))
        .await
        .unwrap();
    let other = engine
        .schedule("k", due, keyed(Some("order-2"), None, "other"))
        .await
        .unwrap();
    let near = engine
        .schedule("k", T0 + 60_000, keyed(Some("order-1"), None, "near"))
        .await
        .unwrap();
    engine.far_round().await.unwrap();
    assert_eq!(engine.far_pending(), 2);
    assert_eq!(
        engine.find_by_key("k", b"order-1").unwrap(),
        [near],
        "in memory"
    );
    assert_eq!(
        engine.lookup_key("k", b"order-1").await.unwrap(),
        [before, near],
        "a lookup reads the far tier too"
    );
    let cancelled = engine.cancel_by_key("k", b"order-1").await.unwrap();
    assert_eq!(
        cancelled,
        [before, near],
        "the wheel's match is cancelled at once, the far one by the key tombstone"
    );
    assert!(engine.lookup_key("k", b"order-1").await.unwrap().is_empty());
    let after = engine
        .schedule("k", due, keyed(Some("order-1"), None, "after"))
        .await
        .unwrap();
    engine.far_round().await.unwrap();
    r = {
        r.stop().await;
        start(far_config(dir.path()), clock.clone())
    };
    at(&r, &clock, due).await;
    let got: HashSet<Vec<u8>> = [r.recv().await.message, r.recv().await.message].into();
    assert_eq!(
        got,
        HashSet::from([
            keyed(Some("order-2"), None, "other"),
            keyed(Some("order-1"), None, "after")
        ])
    );
    let _ = (before, other, after);
    assert_eq!(r.engine.pending(), 0);
    r.stop().await;
}

/// A far message cancelled by key whose ack was still in doubt: the
/// broker may redeliver it. That redelivery repeats a cancelled record and
/// must not be stored again, nor fire. (A guard, not a fix's first test:
/// it passed before this session's changes; it fails with the key
/// tombstone planted out.)
#[tokio::test]
async fn a_redelivery_of_a_far_message_cancelled_by_key_stays_cancelled() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let mut r = start(far_config(dir.path()), clock.clone());
    let due = T0 + 10 * HOUR;
    let message = keyed(Some("order-1"), None, "far and in doubt");
    let on = |session| Arrival {
        redelivered: session > 1,
        session,
    };
    let stored = r
        .engine
        .store("k", due, MessageId::mint(), message.clone(), on(1))
        .await
        .unwrap();
    r.engine.ack_sending(stored.id().unwrap());
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.far_pending(), 1, "spilled");
    assert_eq!(
        r.engine.cancel_by_key("k", b"order-1").await.unwrap(),
        [stored.id().unwrap()]
    );
    assert_eq!(
        r.engine
            .store("k", due, MessageId::mint(), message.clone(), on(2))
            .await
            .unwrap(),
        Stored::Duplicate,
        "the redelivery goes with the cancel"
    );
    at(&r, &clock, due).await;
    let fired = r.recv_within(Duration::from_millis(300)).await;
    assert!(fired.is_none(), "the cancelled message fired: {fired:?}");
    assert_eq!(r.engine.pending(), 0);
    r.stop().await;
}

/// Segments of 500 bytes, so that a 600-byte message ([`big`]) seals its
/// segment; garbage collection only, no compaction.
fn small_segments(dir: &std::path::Path) -> EngineConfig {
    let mut cfg = far_config(dir);
    cfg.wal.segment_bytes = 500;
    cfg.wal.compact_below = 0.0;
    cfg
}

/// A message of more than 600 bytes: it seals a [`small_segments`] segment.
fn big(body: &str) -> Vec<u8> {
    keyed(None, None, &format!("{body} {}", "x".repeat(600)))
}

/// A [`big`] message on the near-only route, due long after the tests'
/// far messages: it keeps its segment.
async fn stay_near(r: &Running, body: &str) -> Result<Stored, EngineError> {
    r.engine
        .store(
            "kept-near",
            T0 + 20 * HOUR,
            MessageId::mint(),
            big(body),
            on(1, false),
        )
        .await
}

/// `message` stored on route "k" (it spills) on session 1: its id and
/// identity.
async fn store_far(r: &Running, due: u64, message: &[u8]) -> (u64, MessageId) {
    let stored = r
        .engine
        .store("k", due, MessageId::mint(), message.to_vec(), on(1, false))
        .await
        .unwrap();
    let id = stored.id().unwrap();
    (id, uid_of(r, id))
}

/// Delivered on source session `session`.
fn on(session: u64, redelivered: bool) -> Arrival {
    Arrival {
        redelivered,
        session,
    }
}

/// A far message's cancel (by id: no Done follows, only its mark) must
/// outlast garbage collection while its WAL Schedule stays on disk: a
/// restart reads that Schedule back in doubt (its ack was), and without the
/// mark a redelivery of it is stored again and fires after the cancel.
#[tokio::test]
async fn a_far_cancel_survives_the_collection_of_its_marks_segment() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let cfg = || small_segments(dir.path());
    let mut r = start(cfg(), clock.clone());
    let due = T0 + 10 * HOUR;
    // Its Schedule's segment stays: a near message waits there too.
    let message = keyed(None, None, "far, its ack in doubt");
    let stored = r
        .engine
        .store("k", due, MessageId::mint(), message.clone(), on(1, false))
        .await
        .unwrap();
    let id = stored.id().unwrap();
    r.engine.ack_sending(id);
    r.engine
        .store(
            "k",
            T0 + 60_000,
            MessageId::mint(),
            big("stays"),
            on(1, false),
        )
        .await
        .unwrap();
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.far_pending(), 1, "spilled");
    // The spill's Done is sealed in a segment of its own before the cancel.
    r.engine
        .store(
            "k",
            T0 + 60_000,
            MessageId::mint(),
            big("filler"),
            on(1, false),
        )
        .await
        .unwrap();
    assert!(r.engine.cancel(id).await.unwrap());
    // The mark's segment: sealed behind a big message that then leaves.
    let gone = r
        .engine
        .store(
            "k",
            T0 + 120_000,
            MessageId::mint(),
            big("goes"),
            on(1, false),
        )
        .await
        .unwrap();
    assert!(r.engine.cancel(gone.id().unwrap()).await.unwrap());
    r.engine
        .store(
            "k",
            T0 + 60_000,
            MessageId::mint(),
            big("seals"),
            on(1, false),
        )
        .await
        .unwrap();
    // Without the mark kept by a Done naming the Schedule's segment, this
    // collected the segment holding it.
    r.engine.compact_now().await.unwrap();
    r = {
        r.stop().await;
        start(cfg(), clock.clone())
    };
    assert_eq!(
        r.engine
            .store("k", due, MessageId::mint(), message, on(1, true))
            .await
            .unwrap(),
        Stored::Duplicate,
        "the redelivery of a cancelled message goes with its cancel"
    );
    r.stop().await;
}

#[tokio::test]
async fn a_listing_pages_through_the_wheel_and_the_far_tier_in_due_order() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let r = start(far_config(dir.path()), clock.clone());
    let mut all = Vec::new();
    for i in 0..12u64 {
        let due = T0 + 60_000 + (i % 4) * 9 * HOUR + i;
        all.push((
            due,
            schedule(&r, if i % 2 == 0 { "a" } else { "b" }, due, "m").await,
        ));
    }
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.far_pending(), 9);
    all.sort();
    let mut listed = Vec::new();
    let mut after = None;
    loop {
        let page = r.engine.list(&ListQuery {
            after,
            limit: 5,
            ..ListQuery::default()
        });
        let Some(last) = page.last() else { break };
        after = Some((last.due_ms, last.id));
        listed.extend(page.iter().map(|p| (p.due_ms, p.id)));
    }
    assert_eq!(listed, all);
    let b_only = r.engine.list(&ListQuery {
        route: Some("b".into()),
        due_from: Some(T0 + 9 * HOUR),
        limit: 100,
        ..ListQuery::default()
    });
    let want: Vec<_> = all
        .iter()
        .filter(|(due, _)| *due >= T0 + 9 * HOUR && due % 2 == 1)
        .copied()
        .collect();
    let got: Vec<_> = b_only.iter().map(|p| (p.due_ms, p.id)).collect();
    assert_eq!(got, want);
    assert_eq!(r.engine.waiting().len(), 12);
    // The status page's summary counts the far tier too: 3 near, then 9 h
    // and 18 h (within a day), 27 h (later), three of each.
    let (_, summaries) = r.engine.due_summary();
    let pending: u64 = summaries.values().map(|s| s.pending).sum();
    let within_day: u64 = summaries.values().map(|s| s.within_day).sum();
    let within_hour: u64 = summaries.values().map(|s| s.within_hour).sum();
    assert_eq!((pending, within_hour, within_day), (12, 3, 9));
    // Route b has only far messages: its next due time is its first
    // bucket's start, at most a bucket early.
    assert_eq!(summaries["b"].next_due_ms, Some(T0 + 9 * HOUR));
    r.stop().await;
}

/// A crash after a spill's checkpoint and before its WAL Done: the message
/// is both in its bucket and live in the WAL. The next start spills it
/// again; it fires once.
#[tokio::test]
async fn a_message_both_in_a_bucket_and_live_in_the_wal_fires_once() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let due = T0 + 7 * HOUR;
    // Stored with no far tier: live in the WAL only.
    let r = start(config(dir.path()), clock.clone());
    let id = schedule(&r, "orders", due, "twice").await;
    let (_, record) = r.engine.read(id).unwrap().unwrap();
    r.stop().await;
    let Record::Schedule {
        uid,
        route,
        message,
        ..
    } = record
    else {
        panic!("not a schedule")
    };
    // ... and written to its bucket, checkpointed, as a spill does.
    {
        let cfg = far_config(dir.path());
        let tier = tier::Tier::open(cfg.far.as_ref().unwrap(), &cfg.wal, T0)
            .unwrap()
            .unwrap();
        let mut store = tier.store();
        store
            .append(&[FarRecord {
                id,
                due_ms: due,
                uid,
                route,
                message,
            }])
            .unwrap();
    }
    let mut r = start(far_config(dir.path()), clock.clone());
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.space().live_records, 0, "retired in the WAL now");
    at(&r, &clock, due - HOUR).await;
    assert_eq!(
        (r.engine.space().live_records, r.engine.far_pending()),
        (1, 0),
        "loaded back as one record"
    );
    at(&r, &clock, due).await;
    let f = r.recv().await;
    assert_eq!(f.message.as_slice(), &b"twice"[..]);
    assert_eq!(f.uid, MessageId::or_legacy(uid, id), "its identity kept");
    let extra = r.recv_within(Duration::from_millis(300)).await;
    assert!(extra.is_none(), "fired twice: {extra:?}");
    assert_eq!(r.engine.pending(), 0);
    r.stop().await;
}

/// `engine.horizon = "0"` or the broker store after a far tier was used:
/// nothing new is spilled, and what the tier holds still fires.
#[tokio::test]
async fn with_spilling_off_the_tier_still_loads_what_it_holds() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let due = T0 + 5 * HOUR;
    let r = start(far_config(dir.path()), clock.clone());
    let spilled = schedule(&r, "orders", due, "spilled").await;
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.far_pending(), 1);
    r.stop().await;

    let mut off = far_config(dir.path());
    off.far.as_mut().unwrap().spill = false;
    let mut r = start(off, clock.clone());
    let kept = schedule(&r, "orders", due + 1, "kept").await;
    r.engine.far_round().await.unwrap();
    assert_eq!((r.engine.far_pending(), r.engine.pending()), (1, 2));
    // Loaded an horizon ahead, as always, before either is due.
    at(&r, &clock, due - HOUR).await;
    assert_eq!(r.engine.far_pending(), 0);
    at(&r, &clock, due + 1).await;
    assert_eq!(
        [body(&r.recv().await), body(&r.recv().await)],
        ["spilled", "kept"]
    );
    let _ = (spilled, kept);
    r.stop().await;
}

/// A spill retires a message's WAL record with a Done naming its segment.
/// Compaction can copy that Done to the head after the message was loaded
/// back: the loaded record must not share the retired id, or the next
/// replay drops it (found by the 100M benchmark: 9,729 of 100M gone).
#[tokio::test]
async fn a_loaded_message_survives_its_spill_done_copied_by_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let big = |n: usize, tag: &str| format!("{tag}{}", "x".repeat(n));
    let later = T0 + 6 * HOUR;
    // Segments are 8 KiB; the fillers are on a route that never spills.
    let r = start(far_config(dir.path()), clock.clone());
    // Segment 1: the far message between two that stay (2 of 3 live once
    // it is spilled: never compacted).
    schedule(&r, "kept-near", later, &big(5000, "n0")).await;
    schedule(&r, "orders", T0 + 5 * HOUR, "far").await;
    schedule(&r, "kept-near", later, &big(3000, "f1")).await;
    // Segment 2: the spill's Done, one record that stays, two that go.
    r.engine.far_round().await.unwrap();
    schedule(&r, "kept-near", later, &big(3000, "f2")).await;
    let f3 = schedule(&r, "kept-near", later, &big(3000, "f3")).await;
    let f4 = schedule(&r, "kept-near", later, &big(3000, "f4")).await;
    // Loaded back into segment 3 ...
    at(&r, &clock, T0 + 4 * HOUR).await;
    assert_eq!(r.engine.far_pending(), 0);
    // ... then segment 2 is compacted: its Done (whose segment is still
    // there) is copied to the head, after the loaded record.
    assert!(r.engine.cancel(f3).await.unwrap() && r.engine.cancel(f4).await.unwrap());
    r.engine.compact_now().await.unwrap();
    r.stop().await;

    let mut r = start(far_config(dir.path()), clock.clone());
    assert_eq!(r.engine.pending(), 4, "the loaded message is still pending");
    at(&r, &clock, T0 + 5 * HOUR).await;
    assert_eq!(body(&r.recv().await), "far");
    r.stop().await;
}

/// A crash after a load's copies are durable in the WAL and before its
/// bucket is removed leaves each message twice: in the bucket, and live in
/// the WAL under a new id (a spill candidate again, so the next spill may
/// write it back into the bucket). Each must still fire once; it fired
/// twice, with the same x-delayd-id.
#[tokio::test]
async fn a_load_cut_short_after_its_copies_fires_each_message_once() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let due = T0 + 5 * HOUR;
    let r = start(far_config(dir.path()), clock.clone());
    let mut uids = Vec::new();
    for i in 0..5 {
        let id = schedule(&r, "orders", due + i, &format!("m{i}")).await;
        uids.push(uid_of(&r, id));
    }
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.far_pending(), 5);
    let tier = r.engine.inner.far.as_ref().unwrap();
    tier.crash_after_copies.store(true, Ordering::Release);
    clock.set(due - HOUR);
    assert!(r.engine.far_round().await.is_err(), "the load went through");
    assert_eq!(
        r.engine.space().live_records,
        5,
        "the copies are in the WAL"
    );
    r.stop().await;

    let mut r = start(far_config(dir.path()), clock.clone());
    r.engine.far_round().await.unwrap();
    at(&r, &clock, due + 10).await;
    for (i, uid) in uids.iter().enumerate() {
        let f = r.recv().await;
        assert_eq!(body(&f), format!("m{i}"));
        assert_eq!(f.uid, *uid, "its identity kept");
    }
    let extra = r.recv_within(Duration::from_millis(300)).await;
    assert!(extra.is_none(), "fired twice: {extra:?}");
    assert_eq!((r.engine.pending(), buckets(dir.path())), (0, 0));
    r.stop().await;
}

/// A bucket much bigger than a load's chunk loads a chunk at a time: the
/// most message bytes held at once stay under the chunk and one message,
/// and every message still fires once, in due order, with its identity.
/// (A load read a whole bucket into memory: 3.4 GiB of RSS for 400,000
/// messages of 4 KiB.)
#[tokio::test]
async fn a_bucket_loads_a_chunk_at_a_time() {
    const CHUNK: usize = 4 * 1024;
    const BODY: usize = 1024;
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let mut config = far_config(dir.path());
    if let Some(far) = config.far.as_mut() {
        far.load_chunk_bytes = CHUNK;
    }
    let due = T0 + 5 * HOUR;
    let r = start(config.clone(), clock.clone());
    let mut uids = Vec::new();
    for i in 0..40u64 {
        let body = format!("{i:04}{}", "x".repeat(BODY - 4));
        let id = schedule(&r, "orders", due + (i % 7), &body).await;
        uids.push((due + (i % 7), id, uid_of(&r, id), body));
    }
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.far_pending(), 40);
    r.stop().await;

    let mut r = start(config, clock.clone());
    at(&r, &clock, due + 10).await;
    uids.sort_by_key(|(due, id, _, _)| (*due, *id));
    for (due, _, uid, body) in &uids {
        let f = r.recv().await;
        assert_eq!(
            (f.due_ms, f.uid, &*f.message),
            (*due, *uid, body.as_bytes())
        );
    }
    let peak = r.engine.far_load_peak();
    assert!(
        peak > 0 && peak < CHUNK + BODY,
        "a load held {peak} bytes of messages at once"
    );
    assert_eq!(r.engine.pending(), 0);
    r.stop().await;
}

/// A load cut short leaves each message twice (its copy armed, its original
/// in the bucket) until the bucket loads again. A cancel of either copy,
/// by the id a lookup gives or by the id a listing gives, holds for both:
/// it answered "cancelled" and the other copy fired.
#[tokio::test]
async fn a_cancel_after_a_load_cut_short_takes_both_copies() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let due = T0 + 5 * HOUR;
    let r = start(far_config(dir.path()), clock.clone());
    let mut uids = Vec::new();
    for i in 0..3 {
        let id = schedule(&r, "orders", due + i, &format!("m{i}")).await;
        uids.push(uid_of(&r, id));
    }
    r.engine.far_round().await.unwrap();
    let tier = r.engine.inner.far.as_ref().unwrap();
    tier.crash_after_copies.store(true, Ordering::Release);
    clock.set(due - HOUR);
    assert!(r.engine.far_round().await.is_err(), "the load went through");
    // As after a crash: the copies durable in the WAL come back armed.
    r.stop().await;
    let mut r = start(far_config(dir.path()), clock.clone());
    // m0 by its lookup (the armed copy), m1 by its bucket original's id.
    let near = r.engine.find_by_uid(uids[0]).unwrap().expect("m0 pending");
    assert!(r.engine.cancel(near).await.unwrap());
    let listed = r.engine.list(&ListQuery {
        limit: 100,
        ..ListQuery::default()
    });
    let far = listed
        .iter()
        .filter(|p| matches!(p.at, Location::Far(_)))
        .find(|p| match r.engine.record_of(p).unwrap() {
            Some(Record::Schedule { uid, .. }) => MessageId::or_legacy(uid, p.id) == uids[1],
            _ => false,
        })
        .expect("m1's original is listed")
        .id;
    assert!(r.engine.cancel(far).await.unwrap());

    at(&r, &clock, due + 10).await;
    let f = r.recv().await;
    assert_eq!((body(&f), f.uid), ("m2".to_owned(), uids[2]));
    let extra = r.recv_within(Duration::from_millis(300)).await;
    assert!(extra.is_none(), "a cancelled message fired: {extra:?}");
    assert_eq!(r.engine.pending(), 0);
    r.stop().await;
}

/// A purge lists far messages, then their bucket loads (a background
/// round) before the cancels: they are armed under new ids, and a cancel
/// by the listed id misses them. The purge walks again and takes them.
#[tokio::test]
async fn a_purge_catches_messages_whose_bucket_loads_during_it() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let mut r = start(far_config(dir.path()), clock.clone());
    let due = T0 + 5 * HOUR;
    for i in 0..5 {
        schedule(&r, "orders", due + i, &format!("m{i}")).await;
    }
    schedule(&r, "other", due, "kept").await;
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.far_pending(), 6);
    // The horizon now reaches the bucket: the purge's load takes it.
    clock.set(due - HOUR);
    let tier = r.engine.inner.far.as_ref().unwrap();
    tier.load_during_purge.store(true, Ordering::Release);
    let count = r.engine.purge("orders", None, None, false).await.unwrap();
    assert!(
        !tier.load_during_purge.load(Ordering::Acquire),
        "the load ran"
    );
    assert_eq!(
        (count.matched, count.purged, count.in_flight),
        (5, 5, 0),
        "{count:?}"
    );
    assert_eq!((r.engine.far_pending(), r.engine.pending()), (0, 1));
    at(&r, &clock, due + 10).await;
    assert_eq!(body(&r.recv().await), "kept");
    let extra = r.recv_within(Duration::from_millis(300)).await;
    assert!(extra.is_none(), "a purged message fired: {extra:?}");
    r.stop().await;
}

/// A purge of far messages reads each bucket once and writes its Dones in
/// one append, and they stay cancelled across a restart.
#[tokio::test]
async fn a_purge_of_far_messages_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let r = start(far_config(dir.path()), clock.clone());
    let due = T0 + 5 * HOUR;
    for i in 0..300 {
        schedule(&r, "orders", due + i * 60_000, &format!("m{i}")).await;
    }
    r.engine.far_round().await.unwrap();
    let count = r
        .engine
        .purge("orders", Some(due), Some(due + 100 * 60_000), false)
        .await
        .unwrap();
    assert_eq!((count.matched, count.purged), (101, 101), "{count:?}");
    r.stop().await;
    let r = start(far_config(dir.path()), clock.clone());
    let left = r.engine.list(&ListQuery {
        route: Some("orders".into()),
        due_from: None,
        due_to: None,
        after: None,
        limit: 1000,
    });
    assert_eq!(left.len(), 199);
    assert!(left.iter().all(|p| p.due_ms > due + 100 * 60_000));
    r.stop().await;
}

/// Issue #36, tried from outside: a small disk that the intake fills while
/// every message spills. Without the disk reserve, the writes that would
/// free space found no room (a load's copies, the far checkpoint, a new
/// head so that the dead one could go) and every round failed from then
/// on; with the reserve, but a head sealed only when full, the dead head
/// never went and the intake never resumed. Scaled down from the outside
/// run (96 MiB, 64 MiB segments, 4 KiB messages) by 1,024, but for the
/// segments: larger than the disk, so a head never fills.
#[tokio::test]
async fn a_disk_full_of_its_own_spilled_messages_still_empties() {
    use crate::wal::sim::SimFs;
    let dir = std::path::Path::new("/vol/wal");
    let fs = SimFs::with_dir(dir);
    fs.set_capacity(Some(96 << 10));
    let mut cfg = far_config(dir);
    cfg.wal.fs = Arc::new(fs.clone());
    cfg.wal.segment_bytes = 128 << 10;
    cfg.wal.reserve_bytes = 16 << 10;
    // Scaled down too: 32 KiB would be a third of this disk.
    cfg.wal.owed_frames = 8;
    cfg.gc_interval = Duration::from_secs(3600);
    if let Some(far) = cfg.far.as_mut() {
        far.horizon = Duration::from_secs(2);
    }
    let clock = Arc::new(ManualClock::new(T0));
    let mut r = start(cfg, clock.clone());
    // Taken in until the disk is full, a spill after every ten.
    let mut stored = std::collections::BTreeMap::new();
    for i in 0u64.. {
        let due = T0 + 40_000 + (i * 7_919) % 30_000;
        match r.engine.schedule("orders", due, vec![i as u8; 1024]).await {
            Ok(id) => assert!(stored.insert(uid_of(&r, id), due).is_none()),
            Err(e) if e.is_disk_full() => break,
            Err(e) => panic!("{e}"),
        }
        if i % 10 == 9 {
            let _ = r.engine.far_round().await;
        }
    }
    assert!(stored.len() >= 30, "only {} taken in", stored.len());
    // The space never comes back from outside: what is stored must leave
    // on its own, with rounds failing only while the reserve is handed out.
    let mut failed_in_a_row = 0;
    let mut t = T0;
    while t <= T0 + 75_000 {
        clock.set(t);
        let round = r.engine.far_round().await;
        let compaction = r.engine.compact_now().await;
        if round.is_err() || compaction.is_err() {
            failed_in_a_row += 1;
            assert!(
                failed_in_a_row <= 3,
                "rounds still fail at +{} s: {round:?} {compaction:?}",
                (t - T0) / 1_000
            );
        } else {
            failed_in_a_row = 0;
        }
        r.engine.wake();
        take_fired(&mut r, &mut stored, Duration::from_millis(20)).await;
        t += 500;
    }
    // What was handed over last, within a deadline.
    take_fired(&mut r, &mut stored, Duration::from_secs(10)).await;
    assert!(
        stored.is_empty(),
        "{} of the stored messages never fired on the full disk",
        stored.len()
    );
    assert_eq!(r.engine.pending(), 0);
    // And the disk emptied: new messages are taken in again.
    r.engine.compact_now().await.unwrap();
    let again = r.engine.schedule("orders", t + 60_000, vec![1; 1024]).await;
    assert!(again.is_ok(), "not taken in again: {again:?}");
    r.stop().await;
}

/// `wal.max_message_bytes` lowered between restarts: a larger message that
/// was stored before, and spilled to the far tier, still loads and fires
/// byte-equal. Before, the bucket's frame was "implausible" under the new
/// limit.
#[tokio::test]
async fn a_lower_max_message_bytes_keeps_a_larger_far_message() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let r = start(far_config(dir.path()), clock.clone());
    let big: Vec<u8> = (0..200 << 10).map(|i: u32| (i % 251) as u8).collect();
    let id = r
        .engine
        .schedule("orders", T0 + 5 * HOUR, big.clone())
        .await
        .unwrap();
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.far_pending(), 1);
    r.stop().await;

    let mut lower = far_config(dir.path());
    lower.wal.max_message_bytes = 64 << 10;
    let mut r = start(lower, clock.clone());
    assert_eq!(r.engine.pending(), 1);
    at(&r, &clock, T0 + 5 * HOUR).await;
    let fired = r.recv().await;
    assert_eq!(fired.message, big);
    assert_ne!(fired.id, id, "loaded under a new id");
}

/// A message in doubt, spilled, loaded back under a new id and cancelled
/// through that copy: the cancel's mark for the original must last as long
/// as the original's Schedule does, not as long as the copy's. Once the
/// copy's segments were collected, a restart read the original back in
/// doubt and not cancelled, and a redelivery of it was stored again under
/// its identity (and fired after the cancel).
#[tokio::test]
async fn a_cancel_through_a_loaded_copy_holds_for_the_original_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let cfg = || small_segments(dir.path());
    let mut r = start(cfg(), clock.clone());
    let due = T0 + 10 * HOUR;
    // Segment 1: the message, its ack in doubt, beside one that stays.
    let message = keyed(None, None, "far, its ack in doubt");
    let (original, uid) = store_far(&r, due, &message).await;
    r.engine.ack_sending(original);
    stay_near(&r, "stays").await.unwrap();
    // Segment 2: the spill's Done, beside another that stays.
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.far_pending(), 1, "spilled");
    stay_near(&r, "seals").await.unwrap();
    // Segment 3: loaded back under a new id, and cancelled through that
    // copy; then sealed behind a message that fires.
    at(&r, &clock, due - HOUR).await;
    assert_eq!(r.engine.far_pending(), 0, "loaded");
    let copy = r.engine.find_by_uid(uid).unwrap().expect("the loaded copy");
    assert_ne!(copy, original);
    assert!(r.engine.cancel(copy).await.unwrap());
    r.engine
        .store(
            "k",
            due - HOUR,
            MessageId::mint(),
            big("fires"),
            on(1, false),
        )
        .await
        .unwrap();
    r.engine.wake();
    r.recv().await;
    // Its Done (lazy) rides the next write, in segment 4.
    stay_near(&r, "next").await.unwrap();
    // Segment 3 holds nothing live now: collected.
    r.engine.compact_now().await.unwrap();
    r = {
        r.stop().await;
        start(cfg(), clock.clone())
    };
    assert_eq!(
        r.engine
            .store("k", due, MessageId::mint(), message.clone(), on(2, true))
            .await
            .unwrap(),
        Stored::Duplicate,
        "the redelivery goes with the cancel"
    );
    r.stop().await;
}

/// A spill whose WAL Done failed on a full disk is retired by the next
/// round (`tier::retire_spilled`). A message the engine no longer
/// remembered (its ack confirmed, and its mark left behind by a
/// compaction) must get its ack's mark again in that Done's batch, as a
/// spill's own Done gives it (sim seed 9117519). Without it, a restart
/// read the record back in doubt; a cancel through its load's copy had
/// not covered it (it was not remembered), and a byte-equal twin's
/// redelivery was stored under the cancelled identity.
#[tokio::test]
async fn a_spill_retired_after_a_full_disk_keeps_its_acks_mark() {
    use crate::wal::sim::SimFs;
    let dir = std::path::Path::new("/vol/wal");
    let fs = SimFs::with_dir(dir);
    let cfg = || {
        let mut cfg = small_segments(dir);
        cfg.wal.fs = Arc::new(fs.clone());
        cfg.wal.compact_below = 0.9;
        cfg
    };
    let clock = Arc::new(ManualClock::new(T0));
    let mut r = start(cfg(), clock.clone());
    let due = T0 + 10 * HOUR;
    // Segment 1: the message, its ack confirmed (the mark rides the next
    // batch), and one that is cancelled below.
    let message = keyed(None, None, "far, its ack confirmed");
    let (original, uid) = store_far(&r, due, &message).await;
    r.engine.ack_sending(original);
    r.engine.confirm_ack(original);
    let goes = stay_near(&r, "goes").await.unwrap().id().unwrap();
    // A restart forgets it: its ack is marked.
    r = {
        r.stop().await;
        start(cfg(), clock.clone())
    };
    // Segment 1 half dead: compaction copies the message, and its mark
    // goes with the segment.
    assert!(r.engine.cancel(goes).await.unwrap());
    r.engine.compact_now().await.unwrap();
    stay_near(&r, "keeps the copy's segment").await.unwrap();
    // The spill's Done fails on a full WAL disk; the next round writes it.
    fs.set_full(vec![dir.join("wal-")]);
    assert!(
        r.engine.far_round().await.is_err(),
        "the spill's Done failed"
    );
    assert_eq!(r.engine.far_pending(), 1, "spilled");
    fs.set_full(Vec::new());
    r.engine.far_round().await.unwrap();
    // Loaded back under a new id and cancelled through that copy.
    at(&r, &clock, due - HOUR).await;
    let copy = r.engine.find_by_uid(uid).unwrap().expect("the loaded copy");
    assert_ne!(copy, original);
    assert!(r.engine.cancel(copy).await.unwrap());
    r = {
        r.stop().await;
        start(cfg(), clock.clone())
    };
    // A twin (the same bytes published again) redelivered: its own
    // message, not the cancelled one.
    let twin = r
        .engine
        .store("k", due, MessageId::mint(), message.clone(), on(2, true))
        .await
        .unwrap();
    assert!(
        !matches!(twin, Stored::Copy { uid: kept, .. } if kept == uid),
        "the twin was stored under the cancelled identity: {twin:?}"
    );
    r.stop().await;
}

/// A record in doubt and a byte-equal redelivery stored as its copy (under
/// its identity: it may be a twin), one of them in the far tier and the
/// other near. A purge whose window holds the copy alone cancels the copy
/// alone: the record stays pending, across a restart too. With the copy
/// far, the far cancel's marks wrote the record's with a Done that kept
/// its mark, and so retired the pending record at the next restart (sim
/// seed 223,542: the record was acknowledged and never fired).
async fn a_purge_of_a_copy_leaves_its_pending_original_after_a_restart(copy_far: bool) {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(ManualClock::new(T0));
    let restart = |r: Running| async {
        r.stop().await;
        start(far_config(dir.path()), clock.clone())
    };
    let (near_due, far_due) = (T0 + HOUR / 2, T0 + 5 * HOUR);
    let (original_due, copy_due) = match copy_far {
        true => (near_due, far_due),
        false => (far_due, near_due),
    };
    let mut r = start(far_config(dir.path()), clock.clone());
    let message = keyed(None, None, "twice, on purpose");
    let original = r
        .engine
        .store(
            "k",
            original_due,
            MessageId::mint(),
            message.clone(),
            on(1, false),
        )
        .await
        .unwrap()
        .id()
        .unwrap();
    let uid = uid_of(&r, original);
    r.engine.ack_sending(original);
    r.engine.far_round().await.unwrap();
    r = restart(r).await;
    let copy = r
        .engine
        .store(
            "k",
            copy_due,
            MessageId::mint(),
            message.clone(),
            on(2, true),
        )
        .await
        .unwrap();
    assert!(
        matches!(copy, Stored::Copy { uid: u, .. } if u == uid),
        "stored as the record's copy: {copy:?}"
    );
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.far_pending(), 1, "one of the two spilled");
    let count = r
        .engine
        .purge("k", Some(copy_due - 60_000), Some(copy_due + 60_000), false)
        .await
        .unwrap();
    assert_eq!(count.purged, 1, "{count:?}");
    let pending = |r: &Running| -> Vec<u64> {
        let all = ListQuery {
            route: Some("k".into()),
            due_from: None,
            due_to: None,
            after: None,
            limit: 10,
        };
        r.engine.list(&all).iter().map(|p| p.due_ms).collect()
    };
    assert_eq!(pending(&r), vec![original_due], "before the restart");
    r = restart(r).await;
    assert_eq!(pending(&r), vec![original_due], "after the restart");
    at(&r, &clock, original_due).await;
    let fired = r.recv().await;
    assert_eq!((fired.uid, fired.message), (uid, message));
    r.stop().await;
}

#[tokio::test]
async fn a_purge_of_a_far_copy_leaves_its_pending_original_after_a_restart() {
    a_purge_of_a_copy_leaves_its_pending_original_after_a_restart(true).await;
}

#[tokio::test]
async fn a_purge_of_a_near_copy_leaves_its_far_original_after_a_restart() {
    a_purge_of_a_copy_leaves_its_pending_original_after_a_restart(false).await;
}

/// `wal.reserve_bytes` lowered between restarts below the size of the far
/// checkpoint that spills under the old reserve wrote (sim seed 335474
/// met it as a volume that shrank). Every load rewrites that checkpoint,
/// on a full disk in the reserve's room: a reserve made at the new size
/// could never hold it, no bucket loaded again, and the disk never
/// emptied. The reserve is now made at least the checkpoint's size.
#[tokio::test]
async fn a_lowered_disk_reserve_still_lets_a_full_disk_load_its_buckets() {
    use crate::wal::sim::SimFs;
    let dir = std::path::Path::new("/vol/wal");
    let fs = SimFs::with_dir(dir);
    fs.set_capacity(Some(64 << 10));
    let config = |reserve_bytes: u64| {
        let mut cfg = far_config(dir);
        cfg.wal.fs = Arc::new(fs.clone());
        cfg.wal.reserve_bytes = reserve_bytes;
        // The ledger of owed frames scaled down with the disk.
        cfg.wal.owed_frames = 8;
        cfg.gc_interval = Duration::from_secs(3600);
        if let Some(far) = cfg.far.as_mut() {
            far.horizon = Duration::from_secs(1);
        }
        cfg
    };
    let clock = Arc::new(ManualClock::new(T0));
    let r = start(config(8 << 10), clock.clone());
    // One message in each of 40 buckets: a checkpoint of a few KiB.
    let first = T0 + 60_000;
    let mut far = std::collections::BTreeMap::new();
    for i in 0..40u64 {
        let due = first + i * 1_000;
        let id = schedule(&r, &format!("route-{}", i % 4), due, &format!("far {i}")).await;
        far.insert(uid_of(&r, id), due);
    }
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.far_pending(), 40);
    let checkpoint = fs.read(&dir.join("far/checkpoint")).len() as u64;
    assert!(checkpoint > 1 << 10, "a checkpoint of {checkpoint} B");
    r.stop().await;

    let mut r = start(config(1 << 10), clock.clone());
    // The intake fills the disk with messages due after all of them.
    let mut near = 0;
    loop {
        match r.engine.schedule("fill", first + HOUR, vec![7; 1024]).await {
            Ok(_) => near += 1,
            Err(e) if e.is_disk_full() => break,
            Err(e) => panic!("{e}"),
        }
    }
    assert!(near >= 20, "only {near} taken in");
    // Each bucket loads and fires in the room the reserve gives.
    let mut t = first;
    while t < first + 40_000 && !far.is_empty() {
        clock.set(t);
        let _ = r.engine.far_round().await;
        r.engine.wake();
        take_fired(&mut r, &mut far, Duration::from_millis(20)).await;
        t += 1_000;
    }
    // What was handed over last, within a deadline.
    take_fired(&mut r, &mut far, Duration::from_secs(10)).await;
    assert!(
        far.is_empty(),
        "{} spilled messages never loaded on the full disk",
        far.len()
    );
    r.stop().await;
}

/// A cancel by key fails on a full WAL disk after its far tombstone is
/// written (another message of the route waits in the far tier), and puts
/// its message back; a far round spills that message, and the spill's WAL
/// Done fails too. The far tier drops it (the tombstone is older than its
/// id), the WAL still holds it live. An answer read from the far tier
/// alone (a purge of its due time, the same cancel again) said nothing was
/// left, and a crash brought the WAL's copy back to fire (sim seed
/// 476,040). Such a Done is made durable first.
async fn an_answer_from_the_far_tier_retires_a_spill_the_wal_still_holds(purge: bool) {
    use crate::wal::sim::{PowerLoss, SimFs};
    let dir = std::path::Path::new("/vol/wal");
    let fs = SimFs::with_dir(dir);
    let cfg = |fs: &SimFs| {
        let mut cfg = far_config(dir);
        cfg.wal.fs = Arc::new(fs.clone());
        cfg
    };
    let clock = Arc::new(ManualClock::new(T0));
    let r = start(cfg(&fs), clock.clone());
    let due = T0 + 10 * HOUR;
    store_far(
        &r,
        due + HOUR,
        &keyed(Some("order-2"), None, "another, far"),
    )
    .await;
    r.engine.far_round().await.unwrap();
    assert_eq!(r.engine.far_pending(), 1, "the other one spilled");
    let message = keyed(Some("order-1"), None, "cancelled, spilled");
    store_far(&r, due, &message).await;
    fs.set_full(vec![dir.join("wal-")]);
    assert!(
        r.engine.cancel_by_key("k", b"order-1").await.is_err(),
        "the cancel's Done failed"
    );
    assert!(
        r.engine.far_round().await.is_err(),
        "the spill's Done failed"
    );
    assert_eq!(r.engine.far_pending(), 2, "spilled");
    fs.set_full(Vec::new());
    if purge {
        r.engine
            .purge("k", Some(due - 1_000), Some(due + 1_000), false)
            .await
            .unwrap();
    } else {
        r.engine.cancel_by_key("k", b"order-1").await.unwrap();
    }
    // Answered: it never fires, whatever a crash does.
    let fs = fs.power_loss(PowerLoss::ProcessCrash);
    r.crash();
    // Due before its bucket loads (the restart came late): the WAL's copy
    // would fire first, before the load's tombstone could cancel it.
    let mut r = start(cfg(&fs), clock.clone());
    clock.set(due + 1);
    r.engine.wake();
    // The other one and the far copy: a WAL copy would leave first.
    r.until_pending(2).await;
    r.engine.far_round().await.unwrap();
    r.until_pending(1).await;
    let fired = r.handed_over();
    assert!(
        fired.is_none(),
        "it fired after the answer that it was cancelled: {fired:?}"
    );
    r.stop().await;
}

#[tokio::test]
async fn a_purge_retires_a_spill_the_wal_still_holds() {
    an_answer_from_the_far_tier_retires_a_spill_the_wal_still_holds(true).await;
}

#[tokio::test]
async fn a_cancel_by_key_retires_a_spill_the_wal_still_holds() {
    an_answer_from_the_far_tier_retires_a_spill_the_wal_still_holds(false).await;
}
