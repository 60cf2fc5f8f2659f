//! A child process schedules, cancels and fires through the engine while
//! garbage collection and compaction run as often as they can, and is killed
//! with SIGKILL at a point drawn from a printed seed (`DELAYD_TEST_SEED=N`
//! replays one). After every kill, a restart must hold exactly what was
//! acknowledged: every scheduled message neither cancelled nor delivered,
//! with its due time and bytes, and no cancelled one; a delivered one may
//! stay (at-least-once) but unchanged. Compaction copies and segment
//! deletions in flight at the kill must neither lose nor bring back anything.
//! The child reports the compactions it finished (the engine's
//! `delayd_wal_compactions_total`), and every other round is killed just as
//! a compaction starts: the test requires that compactions ran and that at
//! least one kill landed inside one.

use std::collections::{BTreeMap, HashSet};

use std::sync::atomic::{AtomicU64, Ordering};
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

/// Counts the engine's `delayd_wal_compactions_total` (incremented once a
/// compacted segment is removed) for the child to report; every other
/// metric goes nowhere.
struct CompactionCounter(Arc<AtomicU64>);

impl metrics::Recorder for CompactionCounter {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        if key.name() == "delayd_wal_compactions_total" {
            metrics::Counter::from_arc(self.0.clone())
        } else {
            metrics::Counter::noop()
        }
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// Child mode: schedule and cancel forever, compacting all the while,
/// printing what was acknowledged and, around each round of GC and
/// compaction that has a segment to compact, `compacting` and
/// `compacted <compactions finished so far>`.
fn child(dir: &str) {
    // libtest has printed "test <name> ... " with no newline: end that line,
    // or the first line printed here would be read as garbage.
    println!();
    let compactions = Arc::new(AtomicU64::new(0));
    metrics::set_global_recorder(CompactionCounter(compactions.clone()))
        .expect("the child's only recorder");
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
                    let candidate = engine.wal().compaction_candidate(engine.now_ms()).is_some();
                    if candidate {
                        child_process::say("compacting");
                    }
                    let _ = engine.compact_now().await;
                    if candidate {
                        let done = compactions.load(Ordering::Relaxed);
                        child_process::say(&format!("compacted {done}"));
                    }
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
    // Compactions the children finished, and rounds killed between a
    // `compacting` and its `compacted` (inside a round of GC and compaction
    // with a segment to compact).
    let (mut compactions, mut killed_compacting) = (0u64, 0u32);
    for round in 0..6 {
        let target = rng.draw(1000..7000);
        // Odd rounds: killed at the first compaction that starts after the
        // target, rather than at the target.
        let at_compaction = round % 2 == 1;
        let (mut child, mut lines) = child_process::spawn(
            "sigkill_during_compaction_keeps_exactly_what_was_acknowledged",
            CHILD_ENV,
            dir.path(),
        );
        let started = Instant::now();
        let (mut new_acks, mut killed) = (0u64, false);
        let (mut compacting, mut round_compactions) = (false, 0u64);
        while let Some(Ok(line)) = lines.next() {
            let mut parts = line.split_whitespace();
            match (parts.next(), parts.next(), parts.next(), parts.next()) {
                (Some("compacting"), None, None, None) => compacting = true,
                (Some("compacted"), Some(done), None, None) => {
                    compacting = false;
                    round_compactions = done.parse().unwrap();
                }
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
            let due = new_acks >= target && (!at_compaction || line == "compacting");
            if !killed && (due || started.elapsed() > Duration::from_secs(60)) {
                child.kill().unwrap(); // SIGKILL
                killed = true;
            }
        }
        child.wait().unwrap();
        assert!(
            killed,
            "seed {seed}: child exited on its own in round {round}"
        );
        // Everything the child printed has been read: a `compacting` with no
        // `compacted` after it was cut short by the kill.
        compactions += round_compactions;
        if compacting {
            killed_compacting += 1;
        }
        println!(
            "round {round}: {round_compactions} compactions, killed {}",
            if compacting {
                "while compacting"
            } else {
                "between compactions"
            }
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
        "engine_crash: {} acknowledged, {} cancelled, {} delivered, {removed} of {} segments removed, \
         {compactions} compactions, {killed_compacting} rounds killed while compacting",
        acked.len(),
        cancelled.len(),
        delivered.len(),
        seen_segments.len()
    );
    assert!(
        removed > 0,
        "seed {seed}: no segment was ever collected or compacted"
    );
    // GC alone removes segments too: compaction must have run as well.
    assert!(
        compactions > 0,
        "seed {seed}: no segment was ever compacted"
    );
    assert!(
        killed_compacting > 0,
        "seed {seed}: no kill landed while a compaction was under way"
    );
    assert!(!delivered.is_empty(), "seed {seed}: nothing fired");
}
