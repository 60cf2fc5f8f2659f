//! `delayd wal inspect DIR`: what is in a WAL, without changing it.
//!
//! It takes no lock, so it also works on the WAL of a running delayd: the
//! report is then a snapshot of a log being written (the last segment may
//! end in a batch still being written, shown as a torn tail) and names the
//! running process.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::wal::{inspect_segment, SegmentScan};

#[derive(Debug, Serialize)]
struct SegmentReport {
    file: String,
    bytes: u64,
    schedules: u64,
    dones: u64,
    live: u64,
    live_bytes: u64,
    dead_bytes: u64,
}

#[derive(Debug, Serialize)]
struct Report {
    dir: String,
    segments: Vec<SegmentReport>,
    live_records: u64,
    live_bytes: u64,
    dead_bytes: u64,
    oldest_due_ms: Option<u64>,
    newest_due_ms: Option<u64>,
    routes: BTreeMap<String, u64>,
    corruption: Vec<crate::wal::Corruption>,
    torn_tail_bytes: u64,
    /// The delayd holding the WAL's lock, if one is running.
    in_use_by_pid: Option<u32>,
}

pub fn run(dir: &Path, json: bool) -> anyhow::Result<()> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read WAL directory {}", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("wal-") && n.ends_with(".log"))
        })
        .collect();
    files.sort();
    let total: u64 = files
        .iter()
        .filter_map(|f| f.metadata().ok())
        .map(|m| m.len())
        .sum();
    let bar = if json || total < (64 << 20) {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total).with_style(
            ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        )
    };

    // Pass 1: every segment's frames. Liveness needs the whole log (a Done
    // can sit in a later segment than its Schedule).
    let mut scans: Vec<(String, u64, SegmentScan)> = Vec::new();
    let last = files.len().saturating_sub(1);
    for (i, path) in files.iter().enumerate() {
        bar.set_message(
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        );
        let scan = inspect_segment(path, u32::MAX, i == last)?;
        let bytes = path.metadata().map(|m| m.len()).unwrap_or(0);
        bar.inc(bytes);
        scans.push((path.display().to_string(), bytes, scan));
    }
    bar.finish_and_clear();
    // Live = last Schedule copy of an id with no later Done.
    let mut live: HashMap<u64, (usize, u64, u32, String)> = HashMap::new(); // id -> (segment, due, size, route)
    for (i, (_, _, scan)) in scans.iter().enumerate() {
        for f in &scan.frames {
            match &f.done {
                None => {
                    live.insert(f.id, (i, f.due_ms, f.size, f.route.clone()));
                }
                Some(_) => {
                    live.remove(&f.id);
                }
            }
        }
    }
    let mut per_segment = vec![(0u64, 0u64); scans.len()];
    let mut routes = BTreeMap::new();
    let (mut oldest, mut newest) = (None::<u64>, None::<u64>);
    for (seg, due, size, route) in live.values() {
        per_segment[*seg].0 += 1;
        per_segment[*seg].1 += *size as u64;
        *routes.entry(route.clone()).or_insert(0) += 1;
        oldest = Some(oldest.map_or(*due, |o| o.min(*due)));
        newest = Some(newest.map_or(*due, |n| n.max(*due)));
    }
    let mut report = Report {
        dir: dir.display().to_string(),
        segments: Vec::new(),
        live_records: live.len() as u64,
        live_bytes: 0,
        dead_bytes: 0,
        oldest_due_ms: oldest,
        newest_due_ms: newest,
        routes,
        corruption: Vec::new(),
        torn_tail_bytes: 0,
        in_use_by_pid: crate::wal::live_holder(dir),
    };
    for (i, (file, bytes, scan)) in scans.into_iter().enumerate() {
        let (live_n, live_bytes) = per_segment[i];
        let dead = bytes.saturating_sub(live_bytes);
        report.live_bytes += live_bytes;
        report.dead_bytes += dead;
        report.corruption.extend(scan.corruption);
        report.torn_tail_bytes += scan.torn_tail_bytes;
        report.segments.push(SegmentReport {
            file,
            bytes,
            schedules: scan.frames.iter().filter(|f| f.done.is_none()).count() as u64,
            dones: scan.frames.iter().filter(|f| f.done.is_some()).count() as u64,
            live: live_n,
            live_bytes,
            dead_bytes: dead,
        });
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    if !report.corruption.is_empty() {
        anyhow::bail!("{} corrupt frame(s) found", report.corruption.len());
    }
    Ok(())
}

fn print_table(r: &Report) {
    println!("WAL {}", r.dir);
    if let Some(pid) = r.in_use_by_pid {
        println!("in use by delayd pid {pid}: a snapshot of a log being written");
    }
    println!(
        "{:<40} {:>12} {:>10} {:>10} {:>10} {:>12} {:>12}",
        "segment", "bytes", "schedules", "dones", "live", "live bytes", "dead bytes"
    );
    for s in &r.segments {
        let name = Path::new(&s.file)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        println!(
            "{:<40} {:>12} {:>10} {:>10} {:>10} {:>12} {:>12}",
            name, s.bytes, s.schedules, s.dones, s.live, s.live_bytes, s.dead_bytes
        );
    }
    println!(
        "live records: {}  live bytes: {}  dead bytes: {}",
        r.live_records, r.live_bytes, r.dead_bytes
    );
    let fmt = |ms: Option<u64>| {
        ms.and_then(|m| chrono::DateTime::from_timestamp_millis(m as i64))
            .map(|t| t.to_rfc3339())
            .unwrap_or_else(|| "-".into())
    };
    println!(
        "oldest due: {}  newest due: {}",
        fmt(r.oldest_due_ms),
        fmt(r.newest_due_ms)
    );
    for (route, n) in &r.routes {
        println!("  route {route}: {n} pending");
    }
    if r.torn_tail_bytes > 0 {
        println!("torn tail: {} bytes (cut on next start)", r.torn_tail_bytes);
    }
    if r.corruption.is_empty() {
        println!("corruption: none");
    }
    for c in &r.corruption {
        println!(
            "CORRUPT {} at offset {}: {} ({} bytes skipped)",
            c.segment.display(),
            c.offset,
            c.reason,
            c.skipped_bytes
        );
    }
}
