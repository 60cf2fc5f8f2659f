//! A child process appends to the WAL as fast as it can and is killed with
//! SIGKILL mid-stream. Every record whose append was acknowledged must
//! survive, byte for byte, and every acknowledged Done must stay done.

use std::collections::BTreeMap;

use std::time::{Duration, Instant};

use delayd::wal::{RecordRef, Wal, WalConfig};

#[path = "it/common/child.rs"]
mod child_process;
#[path = "it/common/seed.rs"]
mod seed;

const CHILD_ENV: &str = "DELAYD_WAL_CRASH_CHILD";

fn config(dir: &std::path::Path) -> WalConfig {
    WalConfig {
        segment_bytes: 256 * 1024, // many segment rotations within one run
        ..WalConfig::new(dir)
    }
}

fn payload(n: u64) -> Vec<u8> {
    let len = (n * 7919 % 3000) as usize + 1;
    (0..len).map(|i| (n as usize + i) as u8).collect()
}

/// Child mode: append forever, printing each acknowledged record.
fn child(dir: &str) {
    // libtest has printed "test <name> ... " with no newline: end that line,
    // or the first line printed here would be read as garbage.
    println!();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (wal, _) = Wal::open(config(dir.as_ref()), |_, _| {}).unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        for worker in 0..32u64 {
            let wal = wal.clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                for i in 0.. {
                    let n = worker * 1_000_000_000 + i;
                    let appended = wal
                        .append_schedule(n, u128::from(n), "crash", payload(n))
                        .unwrap()
                        .await
                        .unwrap()
                        .unwrap();
                    let _ = tx.send(format!("acked {} {n}", appended.id));
                    if i % 5 == 0 {
                        // Announced first, straight into the pipe (the printer
                        // task may lag): the Done may be durable before its
                        // ack is printed.
                        child_process::say(&format!("retiring {}", appended.id));
                        wal.append_done(appended.id, appended.pos)
                            .unwrap()
                            .await
                            .unwrap()
                            .unwrap();
                        let _ = tx.send(format!("done {}", appended.id));
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
fn sigkill_mid_stream_loses_no_acknowledged_record() {
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        child(&dir);
        return;
    }
    let mut rng = seed::Seed::from_env("wal_crash");
    let dir = tempfile::tempdir().unwrap();
    let mut acked: BTreeMap<u64, u64> = BTreeMap::new(); // id -> n
    let mut done = std::collections::HashSet::new();
    let mut retiring = std::collections::HashSet::new();
    for round in 0..3 {
        let (mut child, mut lines) = child_process::spawn(
            "sigkill_mid_stream_loses_no_acknowledged_record",
            CHILD_ENV,
            dir.path(),
        );
        let started = Instant::now();
        let target = rng.draw(500..9000);
        let mut new_acks = 0;
        let mut killed = false;
        // Read until enough acks, kill, then drain what the child printed before dying.
        while let Some(Ok(line)) = lines.next() {
            let mut parts = line.split_whitespace();
            match (parts.next(), parts.next(), parts.next()) {
                (Some("acked"), Some(id), Some(n)) => {
                    acked.insert(id.parse().unwrap(), n.parse().unwrap());
                    new_acks += 1;
                }
                (Some("done"), Some(id), None) => {
                    done.insert(id.parse::<u64>().unwrap());
                }
                (Some("retiring"), Some(id), None) => {
                    retiring.insert(id.parse::<u64>().unwrap());
                }
                _ => {}
            }
            if !killed && (new_acks >= target || started.elapsed() > Duration::from_secs(60)) {
                child.kill().unwrap(); // SIGKILL
                killed = true;
            }
        }
        child.wait().unwrap();
        assert!(killed, "child exited on its own in round {round}");
        assert!(new_acks > 0, "child acknowledged nothing in round {round}");

        let mut live = BTreeMap::new();
        let (wal, report) = Wal::open(config(dir.path()), |rec, _| match rec {
            RecordRef::Schedule {
                id,
                due_ms,
                message,
                ..
            } => {
                live.insert(id, (due_ms, message.to_vec()));
            }
            RecordRef::Done { id, .. } => {
                live.remove(&id);
            }
            RecordRef::Acked { .. } | RecordRef::Remembered { .. } => {}
        })
        .unwrap();
        assert!(
            report.corruptions.is_empty(),
            "seed {} round {round}: {:?}",
            rng.seed,
            report.corruptions
        );
        for (id, n) in &acked {
            if done.contains(id) {
                assert!(
                    !live.contains_key(id),
                    "seed {} round {round}: Done record {id} lost",
                    rng.seed
                );
                continue;
            }
            if retiring.contains(id) && !live.contains_key(id) {
                continue; // its Done became durable just before the kill
            }
            let (due, message) = live.get(id).unwrap_or_else(|| {
                panic!(
                    "seed {} round {round}: acknowledged record {id} lost",
                    rng.seed
                )
            });
            assert_eq!(*due, *n);
            assert_eq!(
                message,
                &payload(*n),
                "seed {} round {round}: record {id} changed",
                rng.seed
            );
        }
        wal.close().unwrap();
    }
}
