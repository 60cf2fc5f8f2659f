//! Core durability benchmarks (criterion):
//! - WAL schedules/s with 1 KiB messages and group-commit fdatasync,
//! - recovery time (WAL replay + wheel rebuild) for 1M pending.
//!
//! And, printed once, recovery time and RSS per pending message for
//! `DELAYD_BENCH_BIG` pending (default 10M; set 0 to skip). With
//! `DELAYD_BENCH_KEYED=1` those messages are encoded messages that each carry
//! a distinct AMQP `message_id`, so every one is also in the key index
//! (cancel by message_id); otherwise they have no key.

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion, Throughput};
use delayd::engine::{Engine, EngineConfig, SystemClock};
use delayd::wal::{Wal, WalConfig};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Append `n` records of `size` bytes from `writers` concurrent appenders.
async fn append(wal: &Wal, n: u64, size: usize, writers: u64) {
    append_with(wal, n, writers, move |_| vec![7u8; size]).await
}

/// A 100-byte-body encoded message with `message_id` `order-<i>`.
fn keyed_message(i: u64) -> Vec<u8> {
    let mut m = delayd_adapters::Message::with_body(vec![7u8; 100]);
    m.properties.message_id = Some(format!("order-{i}"));
    delayd_adapters::encode(&m)
}

async fn append_with<F>(wal: &Wal, n: u64, writers: u64, message: F)
where
    F: Fn(u64) -> Vec<u8> + Copy + Send + 'static,
{
    let mut tasks = Vec::new();
    for w in 0..writers {
        let wal = wal.clone();
        tasks.push(tokio::spawn(async move {
            let mut pending = Vec::with_capacity(64);
            let mut i = w;
            while i < n {
                pending.push(
                    wal.append_schedule(
                        4_000_000_000_000 + i,
                        u128::from(i) + 1,
                        "bench",
                        message(i),
                    )
                    .unwrap(),
                );
                i += writers;
                if pending.len() == 64 {
                    for rx in pending.drain(..) {
                        rx.await.unwrap().unwrap();
                    }
                }
            }
            for rx in pending {
                rx.await.unwrap().unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

fn wal_append(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("wal_append_1KiB");
    group.throughput(Throughput::Elements(1));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(15));
    let dir = tempfile::tempdir_in(".").unwrap();
    let (wal, _) = Wal::open(WalConfig::new(dir.path()), |_, _| {}).unwrap();
    let mut total = (0u64, 0u64, Duration::ZERO);
    group.bench_function("group_commit", |b| {
        b.iter_custom(|iters| {
            let fsyncs = wal.fsyncs();
            let started = Instant::now();
            rt.block_on(append(&wal, iters, 1024, 16));
            let took = started.elapsed();
            total.0 += iters;
            total.1 += wal.fsyncs() - fsyncs;
            total.2 += took;
            took
        })
    });
    group.finish();
    let secs = total.2.as_secs_f64();
    eprintln!(
        "wal_append_1KiB: {:.0} schedules/s, {:.0} fdatasync/s, {:.0} records per group commit",
        total.0 as f64 / secs,
        total.1 as f64 / secs,
        total.0 as f64 / total.1.max(1) as f64
    );
    wal.close().unwrap();
}

/// A WAL directory holding `n` pending 100-byte messages (with a
/// `message_id` each when `keyed`).
fn prepared_wal(n: u64, keyed: bool) -> tempfile::TempDir {
    let rt = runtime();
    let dir = tempfile::tempdir_in(".").unwrap();
    let (wal, _) = Wal::open(WalConfig::new(dir.path()), |_, _| {}).unwrap();
    if keyed {
        rt.block_on(append_with(&wal, n, 64, keyed_message));
    } else {
        rt.block_on(append(&wal, n, 100, 64));
    }
    wal.close().unwrap();
    dir
}

fn open_engine(dir: &std::path::Path) -> Engine {
    let config = EngineConfig::new(WalConfig::new(dir));
    let (engine, _) = Engine::open(config, Arc::new(SystemClock)).unwrap();
    engine
}

fn recovery(c: &mut Criterion) {
    let dir = prepared_wal(1_000_000, false);
    let mut group = c.benchmark_group("recovery");
    group.sample_size(10);
    group.bench_function("1M_pending", |b| {
        b.iter(|| {
            let engine = open_engine(dir.path());
            assert_eq!(engine.pending(), 1_000_000);
            engine.wal().close().unwrap();
        })
    });
    group.finish();
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn big(_: &mut Criterion) {
    let n: u64 = std::env::var("DELAYD_BENCH_BIG")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000_000);
    if n == 0 {
        return;
    }
    let keyed = std::env::var("DELAYD_BENCH_KEYED").is_ok_and(|v| v == "1");
    let started = Instant::now();
    let dir = prepared_wal(n, keyed);
    eprintln!(
        "prepared {n} pending (keyed: {keyed}) in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // In a fresh process, as after a restart: in this one, preparing the
    // WAL has already grown the heap, and recovery would reuse it unseen.
    let status = std::process::Command::new(std::env::current_exe().unwrap())
        .env(RECOVER_IN, dir.path())
        .status()
        .unwrap();
    assert!(status.success(), "the recovering child failed: {status}");
}

/// Set for the child of [`big`]: recover the WAL there and report.
const RECOVER_IN: &str = "BENCH_RECOVER_IN";

fn recover_and_report(dir: &std::path::Path) {
    let before = rss_bytes();
    let started = Instant::now();
    // Off the main thread, as delayd recovers (on a tokio worker): glibc
    // gives other threads arenas of their own, which keep freed memory in
    // other ways than the main heap.
    let dir = dir.to_path_buf();
    let engine = std::thread::spawn(move || open_engine(&dir))
        .join()
        .unwrap();
    let took = started.elapsed();
    let after = rss_bytes();
    let n = engine.pending();
    eprintln!(
        "recovery of {n} pending: {:.2} s; RSS {:.1} MiB -> {:.1} MiB = {:.1} bytes per pending message",
        took.as_secs_f64(),
        before as f64 / (1 << 20) as f64,
        after as f64 / (1 << 20) as f64,
        (after - before) as f64 / n.max(1) as f64
    );
    engine.wal().close().unwrap();
}

/// Paging through the admin listing while the engine holds `n` pending
/// (`DELAYD_BENCH_LIST`, default 2M; 0 skips): how long another thread waits
/// for the engine lock meanwhile (what the dispatcher, and so lateness,
/// would feel), printed once.
fn listing(_: &mut Criterion) {
    let n: u64 = std::env::var("DELAYD_BENCH_LIST")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000_000);
    if n == 0 {
        return;
    }
    let dir = prepared_wal(n, false);
    let engine = open_engine(dir.path());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let probe = {
        let (engine, stop) = (engine.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut waits = hdrhistogram::Histogram::<u64>::new(3).unwrap();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let started = Instant::now();
                std::hint::black_box(engine.pending());
                waits.record(started.elapsed().as_micros() as u64).unwrap();
                std::thread::sleep(Duration::from_micros(200));
            }
            waits
        })
    };
    let started = Instant::now();
    let mut pages = 0u64;
    let mut query = delayd::engine::ListQuery {
        route: None,
        due_from: None,
        due_to: None,
        after: None,
        limit: 1000,
    };
    while started.elapsed() < Duration::from_secs(5) {
        let page = engine.list(&query);
        query.after = page.last().map(|p| (p.due_ms, p.id));
        pages += 1;
    }
    let took = started.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let waits = probe.join().unwrap();
    eprintln!(
        "listing with {n} pending: {:.1} pages/s of 1000; lock wait of another thread p50 {} us, p99 {} us, max {} us",
        pages as f64 / took,
        waits.value_at_quantile(0.5),
        waits.value_at_quantile(0.99),
        waits.max()
    );
    engine.wal().close().unwrap();
}

criterion_group!(benches, wal_append, recovery, big, listing);

fn main() {
    if let Some(dir) = std::env::var_os(RECOVER_IN) {
        recover_and_report(std::path::Path::new(&dir));
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
