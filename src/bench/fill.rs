//! `delayd bench --fill N`: fill a WAL with pending messages through the
//! engine's own API, as a broker intake would store them, without a broker.
//! For benchmarks that need a full store (a restart, or a load run beside
//! millions pending): run it with delayd stopped, on delayd's own config.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use delayd_adapters::{FieldTable, Message, Value};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use tokio::task::JoinSet;

use crate::config::Config;
use crate::engine::{Clock, Engine, SystemClock};
use crate::id::MessageId;

use super::BenchArgs;

#[derive(Debug, Serialize)]
pub struct FillReport {
    pub stored: u64,
    pub elapsed_s: f64,
    pub store_rate: f64,
    /// Pending once the fill is over, and how many of them in the far tier.
    pub pending: u64,
    pub far_pending: u64,
    /// Bytes on disk: the WAL's segments and the far tier's buckets.
    pub wal_bytes: u64,
    pub far_bytes: u64,
    /// The filling process's own peak resident memory.
    pub peak_rss_bytes: u64,
}

/// Most messages stored and not yet spilled at once (a fill waits).
const MAX_BACKLOG: u64 = 1_000_000;

/// A deterministic spread of delays (splitmix64): no dependency, and the
/// same fill for the same arguments.
fn mix(seq: u64) -> u64 {
    delayd_adapters::split_mix::SplitMix64(seq).next()
}

/// The message an AMQP intake would store for the bench's publish `seq`.
fn message(args: &BenchArgs, seq: u64, delay: u64) -> Vec<u8> {
    let mut headers = FieldTable::default();
    headers.insert("x-delay", Value::I64(delay as i64));
    headers.insert(super::SEQ, Value::I64(seq as i64));
    let mut m = Message::with_body(vec![b'x'; args.body_bytes]);
    m.headers = headers;
    m.properties.message_id = Some(format!("bench-{seq}"));
    m.properties.delivery_mode = Some(2);
    m.source = args.exchange.clone().unwrap_or_else(|| "bench".into());
    m.routing_key = args.routing_key.clone();
    delayd_adapters::encode(&m)
}

pub async fn run(args: &BenchArgs, count: u64) -> anyhow::Result<FillReport> {
    let config = Config::load(args.config.as_deref())?;
    let engine_config = crate::runtime::engine_config(&config);
    let (engine, _) =
        tokio::task::spawn_blocking(move || Engine::open(engine_config, Arc::new(SystemClock)))
            .await??;
    // What `delayd run` does in the background: spill to the far tier,
    // collect and compact WAL segments; here as fast as they go, since a
    // fill outruns the once-a-second rounds of `delayd run`.
    let stop = Arc::new(AtomicBool::new(false));
    let spiller = repeat(&stop, Duration::from_millis(200), "far tier round", {
        let engine = engine.clone();
        move || {
            let engine = engine.clone();
            async move { engine.far_round().await }
        }
    });
    let compactor = repeat(&stop, Duration::from_millis(50), "WAL compaction", {
        let engine = engine.clone();
        move || {
            let engine = engine.clone();
            async move { engine.compact_now().await }
        }
    });
    let total = count + args.overdue;
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total)
    };
    bar.set_style(
        ProgressStyle::with_template("fill   {bar:40} {pos}/{len} {per_sec} eta {eta}")
            .expect("template"),
    );
    let started = Instant::now();
    let span = args.delay_max - args.delay_min + 1;
    let mut tasks = JoinSet::new();
    let limit = args.in_flight.max(1);
    for seq in 0..total {
        // Faster than the spill can write buckets, the wheel (and the WAL
        // the spill has not retired yet) would grow with the backlog.
        while engine.pending() - engine.far_pending() > MAX_BACKLOG {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        while tasks.len() >= limit {
            tasks.join_next().await.expect("a task")??;
            bar.inc(1);
        }
        let now = SystemClock.now_ms();
        // The overdue ones come last: the store is full when they are due.
        let (due, delay) = if seq >= count {
            (now.saturating_sub(1), 0)
        } else {
            let delay = args.delay_min + mix(seq) % span;
            (now + delay, delay)
        };
        let stored = engine.store(
            &args.route,
            due,
            MessageId::mint(),
            message(args, seq, delay),
            false,
        );
        let engine = engine.clone();
        tasks.spawn(async move {
            if let crate::engine::Stored::New(id) = stored.await? {
                engine.confirm_ack(id);
            }
            anyhow::Ok(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
        bar.inc(1);
    }
    bar.finish_and_clear();
    let elapsed = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    spiller.await?;
    compactor.await?;
    // Spill what the last round left, then compact the WAL down to what
    // is due within the horizon, as `delayd run` would over the next
    // minutes (a segment a round): a fill outruns that.
    engine.far_round().await?;
    let mut stalled = 0;
    while stalled < 3 {
        let before = engine.space().segments;
        engine.compact_now().await?;
        stalled = if engine.space().segments < before {
            0
        } else {
            stalled + 1
        };
    }
    let report = FillReport {
        stored: total,
        elapsed_s: elapsed.as_secs_f64(),
        store_rate: total as f64 / elapsed.as_secs_f64().max(1e-9),
        pending: engine.pending(),
        far_pending: engine.far_pending(),
        wal_bytes: engine.space().bytes,
        far_bytes: engine.far_bytes(),
        peak_rss_bytes: peak_rss(),
    };
    engine.close().await?;
    Ok(report)
}

/// Run `round` every `pause` until `stop`, logging its failures.
fn repeat<F, Fut>(
    stop: &Arc<AtomicBool>,
    pause: Duration,
    what: &'static str,
    round: F,
) -> tokio::task::JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<(), crate::engine::EngineError>> + Send,
{
    let stop = stop.clone();
    tokio::spawn(async move {
        while !stop.load(Ordering::Relaxed) {
            if let Err(e) = round().await {
                tracing::warn!(error = %e, "{what} failed");
            }
            tokio::time::sleep(pause).await;
        }
    })
}

/// `VmHWM` of this process, from /proc (0 where there is none).
fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}
