//! A child process schedules, cancels and fires through the engine while
//! garbage collection and compaction run as often as they can, and is killed
//! with SIGKILL at a point drawn from a printed seed (`DELAYD_TEST_SEED=N`
//! replays one). After every kill, a restart must hold exactly what was
//! acknowledged: every scheduled message neither cancelled nor delivered,
//! with its due time and bytes, and no cancelled one; a delivered one may
//! stay (at-least-once) but unchanged. Compaction copies and segment
//! deletions in flight at the kill must neither lose nor bring back anything.

use std::collections::{BTreeMap, HashSet};

use std::sync::Arc;
use std::time::{Duration, Instant};

use delayd::engine::{Dispatch, Engine, EngineConfig, Fired, Outcome, SystemClock};
use delayd::wal::{Record, WalConfig};

#[path = "it/common/child.rs"]
mod child_process;
#[path = "it/common/seed.rs"]
mod seed;
use seed::Seed;

const CHILD_ENV: &str = "DELAYD_ENGINE_CRASH_CHILD";
const FAR: u64 = 4_000_000_000_000; // year 2096: nothing fires

fn config(dir: &std::path::Path) -> EngineConfig {
    let mut wal = WalConfig::new(dir);
    wal.segment_bytes = 16 * 1024; // many segments
    wal.compact_below = 0.9; // compact nearly every sealed segment
    EngineConfig {
        gc_interval: Duration::from_millis(5),
        ..EngineConfig::new(wal)
    }
}

/// `n` first, so a message found after a restart names itself.
fn payload(n: u64) -> Vec<u8> {
    let len = (n * 7919 % 700) as usize + 1;
    let mut bytes = n.to_be_bytes().to_vec();
    bytes.extend((0..len).map(|i| (n as usize + i) as u8));
    bytes
}

fn number_of(message: &[u8]) -> u64 {
    u64::from_be_bytes(message[..8].try_into().unwrap())
}

/// Every fourth kept message is due within a few hundred ms and fires.
fn due_soon(n: u64) -> bool {
    n % 8 == 4
}

/// Delivers by printing the id straight into the pipe before confirming,
/// so the parent knows of every delivery whose Done may be durable.
struct Printer;

impl Dispatch for Printer {
    fn deliver(&self, fired: Fired) -> delayd_adapters::BoxFuture<'static, Outcome> {
        child_process::say(&format!("delivered {}", fired.id));
        Box::pin(async { Outcome::Done })
    }
}

/// Child mode: schedule and cancel forever, compacting all the while,
/// printing what was acknowledged.
fn child(dir: &str) {
    // libtest has printed "test <name> ... " with no newline: end that line,
    // or the first line printed here would be read as garbage.
    println!();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (engine, _) = Engine::open(config(dir.as_ref()), Arc::new(SystemClock)).unwrap();
        {
            let engine = engine.clone();
            tokio::spawn(async move {
                let never = tokio_util::sync::CancellationToken::new();
                engine
                    .run(Arc::new(Printer), never, Duration::from_secs(1))
                    .await;
            });
        }
        {
            let engine = engine.clone();
            tokio::spawn(async move {
                loop {
                    let _ = engine.compact_now().await;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            });
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        for worker in 0..16u64 {
            let engine = engine.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut mine = Vec::new();
                for i in 0.. {
                    let n = worker * 1_000_000_000 + i;
                    let due = if due_soon(n) {
                        engine.now_ms() + n % 300
                    } else {
                        FAR + n
                    };
                    let id = engine.schedule("crash", due, payload(n)).await.unwrap();
                    let _ = tx.send(format!("acked {id} {n} {due}"));
                    if !due_soon(n) {
                        mine.push(id);
                    }
                    // Cancel most of them, some long after: sparse segments
                    // that compaction copies and deletes.
                    if i % 4 != 0 && !mine.is_empty() {
                        let victim = mine.swap_remove((n as usize * 31) % mine.len());
                        // Announced first, and straight into the pipe (not
                        // through the printer task, which may lag behind): the
                        // Done may be durable before anything later is printed.
                        child_process::say(&format!("cancelling {victim}"));
                        if engine.cancel(victim).await.unwrap() {
                            let _ = tx.send(format!("cancelled {victim}"));
                        }
                    }
                }
            });
        }
        // The lock is taken per line: workers print to stdout directly too.
        while let Some(line) = rx.recv().await {
            child_process::say(&line);
        }
    });
}

#[test]
fn sigkill_during_compaction_keeps_exactly_what_was_acknowledged() {
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        child(&dir);
        return;
    }
    let mut rng = Seed::from_env("engine_crash");
    let seed = rng.seed;
    let dir = tempfile::tempdir().unwrap();
    let mut acked: BTreeMap<u64, (u64, u64)> = BTreeMap::new(); // id -> (n, due)
    let mut cancelled = HashSet::new();
    let mut cancelling = HashSet::new();
    let mut delivered = HashSet::new();
    // Every segment file seen after a round: some must later be gone, or
    // neither GC nor compaction ran and the test proved nothing about them.
    let mut seen_segments = HashSet::new();
    for round in 0..6 {
        let target = rng.draw(1000..7000);
        let (mut child, mut lines) = child_process::spawn(
            "sigkill_during_compaction_keeps_exactly_what_was_acknowledged",
            CHILD_ENV,
            dir.path(),
        );
        let started = Instant::now();
        let (mut new_acks, mut killed) = (0u64, false);
        while let Some(Ok(line)) = lines.next() {
            let mut parts = line.split_whitespace();
            match (parts.next(), parts.next(), parts.next(), parts.next()) {
                (Some("acked"), Some(id), Some(n), Some(due)) => {
                    let (n, due) = (n.parse().unwrap(), due.parse().unwrap());
                    acked.insert(id.parse().unwrap(), (n, due));
                    new_acks += 1;
                }
                (Some("delivered"), Some(id), None, None) => {
                    delivered.insert(id.parse::<u64>().unwrap());
                }
                (Some("cancelling"), Some(id), None, None) => {
                    cancelling.insert(id.parse::<u64>().unwrap());
                }
                (Some("cancelled"), Some(id), None, None) => {
                    cancelled.insert(id.parse::<u64>().unwrap());
                }
                _ => {}
            }
            if !killed && (new_acks >= target || started.elapsed() > Duration::from_secs(60)) {
                child.kill().unwrap(); // SIGKILL
                killed = true;
            }
        }
        child.wait().unwrap();
        assert!(
            killed,
            "seed {seed}: child exited on its own in round {round}"
        );

        let (engine, report) = Engine::open(config(dir.path()), Arc::new(SystemClock)).unwrap();
        assert!(
            report.corruptions.is_empty(),
            "seed {seed} round {round}: {:?}",
            report.corruptions
        );
        let (mut expected, mut redelivering) = (0u64, 0u64);
        for (id, (n, due)) in &acked {
            let found = engine.read(*id).unwrap();
            if delivered.contains(id) {
                // At-least-once: its Done may not have been durable yet.
                match found {
                    None => continue,
                    Some((info, Record::Schedule { message, .. })) => {
                        assert_eq!(info.due_ms, *due, "seed {seed}: message {id} due time");
                        assert_eq!(message, payload(*n), "seed {seed}: message {id} changed");
                        redelivering += 1;
                        continue;
                    }
                    other => panic!("seed {seed}: delivered {id} unreadable: {other:?}"),
                }
            }
            if cancelled.contains(id) {
                assert!(
                    found.is_none(),
                    "seed {seed} round {round}: cancelled message {id} came back"
                );
                continue;
            }
            if cancelling.contains(id) && found.is_none() {
                cancelled.insert(*id); // its Done became durable just before the kill
                continue;
            }
            expected += 1;
            match found {
                Some((info, Record::Schedule { message, .. })) => {
                    assert_eq!(info.due_ms, *due, "seed {seed}: message {id} due time");
                    assert_eq!(message, payload(*n), "seed {seed}: message {id} changed");
                }
                other => panic!(
                    "seed {seed} round {round}: message {id} (n {n}, due {due}, soon {}) lost ({other:?})",
                    due_soon(*n)
                ),
            }
        }
        // Anything else pending was durable but not yet acknowledged at the
        // kill: it must still be a real schedule (bytes matching its due
        // time), never a cancelled one.
        let mut unacknowledged = 0u64;
        for info in engine.waiting() {
            if acked.contains_key(&info.id) {
                continue;
            }
            unacknowledged += 1;
            let n = match engine.read(info.id).unwrap() {
                Some((_, Record::Schedule { message, .. })) => {
                    let n = number_of(&message);
                    assert_eq!(
                        message,
                        payload(n),
                        "seed {seed} round {round}: unacknowledged {} holds other bytes",
                        info.id
                    );
                    if !due_soon(n) {
                        assert_eq!(info.due_ms, FAR + n, "seed {seed}: {} due time", info.id);
                    }
                    n
                }
                other => panic!("seed {seed}: {} listed but unreadable: {other:?}", info.id),
            };
            acked.insert(info.id, (n, info.due_ms)); // from now on it must stay
        }
        assert_eq!(
            engine.pending(),
            expected + redelivering + unacknowledged,
            "seed {seed} round {round}: pending count"
        );
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(engine.close())
            .unwrap();
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            if name.starts_with("wal-") {
                seen_segments.insert(name);
            }
        }
    }
    let removed = seen_segments
        .iter()
        .filter(|name| !dir.path().join(name).exists())
        .count();
    println!(
        "engine_crash: {} acknowledged, {} cancelled, {} delivered, {removed} of {} segments removed",
        acked.len(),
        cancelled.len(),
        delivered.len(),
        seen_segments.len()
    );
    assert!(
        removed > 0,
        "seed {seed}: no segment was ever collected or compacted"
    );
    assert!(!delivered.is_empty(), "seed {seed}: nothing fired");
}
