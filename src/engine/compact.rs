//! Background space management: delete dead segments, compact sparse ones.

use std::collections::HashSet;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use tokio::sync::oneshot;

use crate::wal::frame::{REMEMBERED_CANCELLED, REMEMBERED_LEFT};
use crate::wal::{Appended, Record, Remembered, WalError, WalPos};

use super::dedup::{self, Evidence};
use super::{EngineError, Inner};

pub(crate) async fn run(inner: Arc<Inner>, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(inner.config.gc_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        if let Err(e) = once(&inner).await {
            tracing::error!(error = %e, "WAL garbage collection failed");
        }
        sweep_keys(&inner);
    }
}

/// Rebuild the key index without stale entries once they could make up
/// half of it, so its size stays proportional to what is pending.
fn sweep_keys(inner: &Inner) {
    let mut state = inner.state();
    let in_memory = state.pending() - state.far_pending();
    if state.indexed_keys() as u64 > 2 * in_memory + 1024 {
        state.sweep_keys();
    }
}

/// Delete what is dead, then compact at most one sparse segment.
pub(crate) async fn once(inner: &Arc<Inner>) -> Result<(), EngineError> {
    let _one_at_a_time = inner.compacting.lock().await;
    write_missing_dones(inner).await?;
    collect_garbage(inner).await?;
    if let Some(segment) = inner.wal.compaction_candidate(inner.clock.now_ms()) {
        compact(inner, segment).await?;
        collect_garbage(inner).await?;
    }
    write_owed_frames(inner).await;
    Ok(())
}

/// The Remembered frames a full disk refused while their segments went:
/// the room those segments left is theirs now.
async fn write_owed_frames(inner: &Arc<Inner>) {
    let mut written = Vec::new();
    for w in remember_departing(inner, &[]) {
        let result = match w.written {
            Ok(rx) => rx.await.unwrap_or(Err(WalError::Stopped)),
            Err(e) => Err(e),
        };
        written.push((w.frame, result));
    }
    if !written.is_empty() {
        // It may sync the ledger of owed frames.
        let inner = inner.clone();
        let _ = tokio::task::spawn_blocking(move || {
            settle_remembered(&inner, written, false, &[]);
        })
        .await;
    }
}

/// Write the Dones recovery found missing (see `engine::missing_dones`)
/// before anything is deleted: until then the copies they retire are held
/// dead only by Dones that collection may remove.
async fn write_missing_dones(inner: &Inner) -> Result<(), EngineError> {
    let missing = std::mem::take(&mut *inner.missing_dones.lock().expect("poisoned"));
    if missing.is_empty() {
        return Ok(());
    }
    let written = async {
        let mut replies = Vec::with_capacity(missing.len());
        for &(id, segment) in &missing {
            replies.push(inner.wal.append_done_copy(id, segment)?);
        }
        for reply in replies {
            reply.await.map_err(|_| EngineError::WriterGone)??;
        }
        Ok::<_, EngineError>(())
    }
    .await;
    if written.is_err() {
        // Tried again next round; nothing is collected until they are durable.
        *inner.missing_dones.lock().expect("poisoned") = missing;
    } else {
        tracing::info!(
            count = missing.len(),
            "wrote the Dones a compaction cut short left out"
        );
    }
    written
}

/// Delete dead segments, keeping what redelivery detection needs of them.
async fn collect_garbage(inner: &Arc<Inner>) -> Result<(), EngineError> {
    let inner = inner.clone();
    tokio::task::spawn_blocking(move || {
        let wal = inner.wal.clone();
        wal.collect_garbage_after(|segments| {
            let reserve_held = inner.wal.reserve_is_held();
            let written = remember_departing(&inner, segments)
                .into_iter()
                .map(|w| {
                    let result = w
                        .written
                        .and_then(|rx| rx.blocking_recv().unwrap_or(Err(WalError::Stopped)));
                    (w.frame, result)
                })
                .collect();
            settle_remembered(&inner, written, reserve_held, segments)
        })
    })
    .await
    .map_err(|_| EngineError::WriterGone)??;
    Ok(())
}

/// A Remembered frame for record `id` leaving segment `from` (`None`: it
/// owes one, or its cancel is newer than its frame).
#[derive(Debug, Clone, Copy)]
struct Frame {
    id: u64,
    from: Option<u32>,
    /// The frame says it was cancelled.
    cancelled: bool,
    /// What it says.
    payload: Remembered,
}

/// A Remembered frame on its way.
struct FrameWrite {
    frame: Frame,
    written: Result<oneshot::Receiver<Result<Appended, WalError>>, WalError>,
}

/// Before `segments` are deleted: remembered records whose ack is
/// unconfirmed and that were written there (a Schedule, or a Remembered
/// frame) are compared by digest from now on, and get a Remembered frame
/// for a restart to read (see `dedup::Unconfirmed::departing`). Returns
/// the frames' writes, to wait for before the segments go and to hand to
/// [`settle_remembered`]. Blocking reads, usually none.
fn remember_departing(inner: &Inner, segments: &[u32]) -> Vec<FrameWrite> {
    let departing = inner.state().unconfirmed.departing(segments);
    let mut writes = Vec::new();
    for d in departing {
        let digest = match d.evidence {
            Evidence::Digest(digest) => digest,
            Evidence::At(pos) => match inner.wal.read(pos) {
                Ok(Record::Schedule {
                    id: stored,
                    route,
                    message,
                    ..
                }) if stored == d.id => {
                    let digest = dedup::digest(&route, &message);
                    inner.state().unconfirmed.set_digest(d.id, digest);
                    digest
                }
                other => {
                    tracing::warn!(id = d.id, error = ?other.err(), "cannot read a remembered record before its segment goes; a redelivery of it will be stored again");
                    continue;
                }
            },
        };
        if !d.durable {
            inner.state().unconfirmed.set_frame(d.id, None);
            continue;
        }
        let flags = if d.cancelled { REMEMBERED_CANCELLED } else { 0 }
            | if d.left { REMEMBERED_LEFT } else { 0 };
        let frame = Remembered {
            id: d.id,
            uid: d.uid,
            fp: d.fp,
            digest,
            flags,
        };
        writes.push(FrameWrite {
            frame: Frame {
                id: d.id,
                from: d.from,
                cancelled: d.cancelled,
                payload: frame,
            },
            written: inner.wal.append_remembered(frame),
        });
    }
    writes
}

/// Record where each Remembered frame went; returns the segments to keep
/// for now. A frame that failed (a full disk) while the disk reserve was
/// held keeps the segment it leaves: its record is still read back there,
/// and the next round tries again on the reserve's room (the failure gave
/// it out). Once the reserve is out, or past
/// [`crate::wal::Wal::hold_back_limit`] bytes of such segments, a segment
/// goes all the same, since a full disk must still empty (sim seed 420
/// stayed full for good): it owes its frame, written by the next round
/// that has room ([`write_owed_frames`]), and meanwhile held by the ledger
/// of owed frames (`wal::ledger`), written in place before the segment
/// goes. Beyond what the ledger holds, a record is remembered in memory
/// only, and a restart takes a late redelivery of it for a new message (a
/// copy under another id, never a loss; see
/// [`super::Engine::frames_owed`]). If the ledger cannot be written,
/// every segment of the round (`offered`) stays for a later round.
fn settle_remembered(
    inner: &Inner,
    written: Vec<(Frame, Result<Appended, WalError>)>,
    reserve_held: bool,
    offered: &[u32],
) -> Vec<u32> {
    // A frame that failed for another reason than a full disk (a failed
    // fsync, the log stopped) keeps its segment whatever its size: nothing
    // presses for room, and going on without the frame forgot what it
    // carried (sim seed 9173454: after a failed fsync, a compaction deleted
    // the segment holding a cancel's mark; the frame that would have
    // carried the cancel on had failed, and a restart read an older frame
    // back, not cancelled).
    let mut keep: Vec<u32> = written
        .iter()
        .filter(|(_, result)| matches!(result, Err(e) if !matches!(e, WalError::DiskFull(_))))
        .filter_map(|(frame, _)| frame.from)
        .collect();
    let mut failed: Vec<u32> = written
        .iter()
        .filter(|(_, result)| reserve_held && matches!(result, Err(WalError::DiskFull(_))))
        .filter_map(|(frame, _)| frame.from)
        .filter(|from| !keep.contains(from))
        .collect();
    failed.sort_unstable();
    failed.dedup();
    keep.sort_unstable();
    keep.dedup();
    let mut held_back = 0;
    for segment in failed {
        held_back += inner.wal.segment_size(segment);
        if held_back > inner.wal.hold_back_limit() {
            break;
        }
        keep.push(segment);
    }
    // The frames owed from now on, to the ledger before their segments go.
    let owed: Vec<Remembered> = written
        .iter()
        .filter(|(frame, result)| {
            result.is_err() && frame.from.is_none_or(|from| !keep.contains(&from))
        })
        .map(|(frame, _)| frame.payload)
        .collect();
    let ledgered = match inner.wal.hold_owed_frames(&owed) {
        Ok(held) => owed[..held].iter().map(|f| f.id).collect::<HashSet<u64>>(),
        // Even the ledger found no room (a copy-on-write file system): the
        // segments go all the same, a full disk must still empty, and the
        // frames are owed in memory only, as without a ledger.
        Err(WalError::DiskFull(_)) => HashSet::new(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot write the ledger of owed Remembered frames; the segments stay for a later round");
            keep_all(inner, written, offered);
            return offered.to_vec();
        }
    };
    let mut state = inner.state();
    for (
        Frame {
            id,
            from,
            cancelled,
            ..
        },
        result,
    ) in written
    {
        match result {
            Ok(appended) => state
                .unconfirmed
                .frame_written(id, appended.pos.segment, cancelled),
            Err(e) => match from.filter(|from| keep.contains(from)) {
                Some(from) => {
                    tracing::debug!(id, error = %e, "no Remembered frame yet: its segment is kept for a later round");
                    state.unconfirmed.set_frame(id, Some(from));
                }
                None => {
                    let held = ledgered.contains(&id);
                    if from.is_some() {
                        if held {
                            tracing::info!(id, error = %e, "no Remembered frame (the disk is full): the ledger of owed frames holds it until there is room");
                        } else {
                            tracing::warn!(id, error = %e, "no Remembered frame (the disk is full) and the ledger of owed frames is full too: written once there is room; a restart before that takes a late redelivery of this message for a new one");
                        }
                        metrics::counter!("delayd_wal_remembered_owed_total").increment(1);
                    }
                    state.unconfirmed.owe_frame(id);
                }
            },
        }
    }
    keep
}

/// The ledger could not be written: every segment of the round stays, and
/// each frame that failed is tried again next round from where it is.
fn keep_all(inner: &Inner, written: Vec<(Frame, Result<Appended, WalError>)>, offered: &[u32]) {
    let mut state = inner.state();
    for (frame, result) in written {
        match (result, frame.from) {
            (Ok(appended), _) => {
                state
                    .unconfirmed
                    .frame_written(frame.id, appended.pos.segment, frame.cancelled)
            }
            (Err(_), Some(from)) if offered.contains(&from) => {
                state.unconfirmed.set_frame(frame.id, Some(from))
            }
            // Owed already: as the ledger's last good write left it.
            (Err(_), _) => {}
        }
    }
}

/// A record a compaction moves on to the WAL's head.
enum Move {
    /// A live Schedule, copied under its id.
    Schedule {
        id: u64,
        old: WalPos,
        due_ms: u64,
        uid: u128,
        route: String,
        message: Vec<u8>,
        /// The mark written after the copy (see [`dedup::Unconfirmed::mark_for_copy`]).
        mark_after: Option<u64>,
    },
    /// A Done whose Schedule lies in a segment that stays.
    Done { id: u64, target: u64 },
    /// A mark still needed; `keeps`: the segment its record is read back
    /// from, when its seq does not say it (see `Wal::append_acked`).
    Mark { id: u64, keeps: Option<u32> },
}

/// Room a compaction keeps beyond its copies' own bytes: the commit
/// frames of their batches and a new head segment's header.
const COPY_SLACK: u64 = 256;

/// An Acked mark's frame, with room for the commit frame that may follow.
const MARK_BYTES: u64 = 64;

/// Each scanned frame's bytes: up to the next one (a commit frame between
/// them counts too, so a copy's size is never underestimated).
fn frame_spans(frames: &[(u32, Record)], segment_bytes: u64) -> Vec<u64> {
    let ends = frames
        .iter()
        .skip(1)
        .map(|(offset, _)| u64::from(*offset))
        .chain(std::iter::once(segment_bytes));
    frames
        .iter()
        .zip(ends)
        .map(|((offset, _), end)| end.saturating_sub(u64::from(*offset)))
        .collect()
}

/// Copy a segment's live records to the head, repoint the index, delete it.
async fn compact(inner: &Arc<Inner>, segment: u32) -> Result<(), EngineError> {
    // Copies free space only once all are written and the segment goes,
    // and never on the disk reserve's room (see the WAL's writer): a
    // compaction that cannot finish waits for room, rather than spend what
    // the Dones and the far tier's loads need (sim seed 9104734).
    let wal = inner.wal.clone();
    if !tokio::task::spawn_blocking(move || wal.has_room())
        .await
        .map_err(|_| EngineError::WriterGone)??
    {
        tracing::debug!(segment, "compaction postponed: the disk reserve is out");
        return Ok(());
    }
    let wal = inner.wal.clone();
    let frames = tokio::task::spawn_blocking(move || wal.scan_segment(segment))
        .await
        .map_err(|_| EngineError::WriterGone)??;
    let first_seq = inner
        .wal
        .segment_first_seq(segment)
        .ok_or(crate::wal::WalError::NoSegment(segment))?;
    let mut copies = Vec::new();
    // Dones and cancel marks moved on: durable before the segment goes.
    let mut done_copies = Vec::new();
    // Kept after another segment: its Dones may retire Schedule copies
    // there whose own segment is gone (seed 413), so they all move on.
    let outlives = inner.wal.outlives_existing(segment);
    {
        // Under the engine lock, so no Done for these ids can slip in between
        // the liveness check and the copy (see wal's crash rules).
        let state = inner.state();
        let located = frames
            .iter()
            .filter(|(offset, record)| {
                let at = WalPos {
                    segment,
                    offset: *offset,
                };
                matches!(record, Record::Schedule { id, .. }
                    if state.locate(*id).is_some_and(|(slot, _, _)| slot.pos == at))
            })
            .count() as u64;
        // A Schedule that is durable but not yet armed by its appender is
        // live without being located: copying only what is located would
        // lose it. Leave the segment for a later round.
        if located < inner.wal.segment_live(segment) {
            tracing::debug!(
                segment = first_seq,
                "compaction postponed: a record is not armed yet"
            );
            return Ok(());
        }
        // A Done naming this very segment moves on too while the segment
        // must outlive another: a compaction cut short left an original of
        // the Schedule it retires there (seed 9195864: a cancel's Done
        // named the copy's segment, went with it, and the original fired
        // after the next restart).
        let target_kept =
            |target: u64| outlives || (target != first_seq && inner.wal.segment_exists(target));
        // Ids whose Done moves on (their Schedule is still on disk): a
        // restart may read that Schedule back, so their cancel marks move
        // on too (seed 7247).
        let retiring: HashSet<u64> = frames
            .iter()
            .filter_map(|(_, record)| match record {
                Record::Done {
                    id,
                    segment: target,
                    ..
                } if target_kept(*target) => Some(*id),
                _ => None,
            })
            .collect();
        // What moves on, planned first: it is written only if it fits.
        let mut plan = Vec::new();
        // Ids whose Schedule is copied.
        let mut copied = HashSet::new();
        let mut bytes = 0;
        let spans = frame_spans(&frames, inner.wal.segment_size(segment));
        for ((offset, record), span) in frames.into_iter().zip(spans) {
            let old = WalPos { segment, offset };
            let moves = match record {
                Record::Schedule {
                    id,
                    due_ms,
                    uid,
                    route,
                    message,
                    ..
                } => state
                    .locate(id)
                    .is_some_and(|(slot, _, _)| slot.pos == old)
                    .then(|| Move::Schedule {
                        id,
                        old,
                        due_ms,
                        uid,
                        route,
                        message,
                        mark_after: state.unconfirmed.mark_for_copy(id),
                    }),
                Record::Done {
                    id,
                    segment: target,
                    ..
                } => target_kept(target).then_some(Move::Done { id, target }),
                // A cancel's mark moves on while its record may still be
                // compared with a redelivery: remembered here, or on disk
                // for a restart to read back (in doubt, its plain mark
                // perhaps gone). Without it, a redelivery of the cancelled
                // message (or of its twin) whose ack was in doubt would be
                // stored again and fire.
                Record::Acked { id, .. }
                    if id & dedup::CANCELLED_MARK != 0
                        && (state.unconfirmed.contains(id & !dedup::CANCELLED_MARK)
                            || retiring.contains(&(id & !dedup::CANCELLED_MARK))) =>
                {
                    Some(Move::Mark { id, keeps: None })
                }
                // A settled record's mark moves on while it is remembered
                // (its Schedule too, with a mark after the copy, below).
                Record::Acked { id, .. }
                    if id & dedup::CANCELLED_MARK == 0
                        && state.unconfirmed.is_settled(id & !dedup::MATCHED_MARK) =>
                {
                    Some(Move::Mark { id, keeps: None })
                }
                // A plain ack mark moves on while its Schedule may be read
                // back: it is pending in another segment (a compaction's
                // copy, which its seq does not name: the moved mark keeps
                // that segment), the segment its id was written to stays,
                // or the Schedule is copied here (the mark follows the
                // copy). Lost, it left a settled record to a restart as one
                // in doubt (sim seed 427,654; `SegmentTable::record_mark`
                // keeps it from garbage collection the same way).
                Record::Acked { id, .. }
                    if id & (dedup::CANCELLED_MARK | dedup::MATCHED_MARK) == 0 =>
                {
                    // Pending elsewhere, or fired with its copy still on
                    // disk (a restart reads it back, and this mark with it).
                    let elsewhere = state
                        .locate(id)
                        .map(|(slot, _, _)| slot.pos.segment)
                        .filter(|&s| s != segment)
                        .or_else(|| inner.wal.copy_mark_home(segment, id));
                    let kept = match inner.wal.segment_covering(id) {
                        Some(seq) if seq == first_seq => copied.contains(&id),
                        Some(_) => true,
                        None => false,
                    };
                    (elsewhere.is_some() || kept).then_some(Move::Mark {
                        id,
                        keeps: elsewhere,
                    })
                }
                Record::Acked { .. } => None,
                // Written again by `remember_departing` if still remembered.
                Record::Remembered { .. } => None,
            };
            if let Some(Move::Schedule { id, .. }) = &moves {
                copied.insert(*id);
            }
            if let Some(m) = moves {
                bytes += span;
                if matches!(
                    m,
                    Move::Schedule {
                        mark_after: Some(_),
                        ..
                    }
                ) {
                    bytes += MARK_BYTES;
                }
                plan.push(m);
            }
        }
        if inner.wal.free_bytes()? < bytes + COPY_SLACK {
            tracing::debug!(
                segment = first_seq,
                bytes,
                "compaction postponed: no room for its copies"
            );
            return Ok(());
        }
        for m in plan {
            match m {
                Move::Schedule {
                    id,
                    old,
                    due_ms,
                    uid,
                    route,
                    message,
                    mark_after,
                } => {
                    let copy = inner
                        .wal
                        .append_copy(id, due_ms, uid, &route, message, mark_after)?;
                    copies.push((id, old, mark_after.is_some(), copy));
                }
                Move::Done { id, target } => {
                    done_copies.push(inner.wal.append_done_copy(id, target)?);
                }
                Move::Mark { id, keeps } => {
                    done_copies.push(inner.wal.append_acked_now(id, keeps)?)
                }
            }
        }
    }
    let moved = copies.len();
    let mut placed = Vec::with_capacity(copies.len());
    for (id, old, marked, rx) in copies {
        let appended = rx.await.map_err(|_| EngineError::WriterGone)??;
        placed.push((id, old, marked, appended.pos));
    }
    for rx in done_copies {
        let appended = rx.await.map_err(|_| EngineError::WriterGone)??;
        // The segments of the moved Dones and marks take over what this one
        // had to outlive: a cancel's mark and its Done may land apart, and
        // the mark must last as long as the Schedule the Done names
        // (`a_cancel_mark_moved_by_a_compaction_outlives_the_cancelled_schedule`).
        inner.wal.keep_after(appended.pos.segment, segment);
    }
    let mut late_dones = Vec::new();
    let mut late_marks = Vec::new();
    {
        let mut state = inner.state();
        for (id, old, marked, new) in placed {
            let still_here = state.locate(id).is_some_and(|(slot, _, _)| slot.pos == old);
            if still_here && state.relocate(id, new) {
                state.unconfirmed.moved(id, old, new);
                // Its ack was settled while it was copied: the mark written
                // then keeps the original's segment, not the copy's.
                if let Some(mark) = state.unconfirmed.mark_for_copy(id).filter(|_| !marked) {
                    late_marks.push(inner.wal.append_acked_now(mark, Some(new.segment))?);
                }
                inner.wal.mark_dead(old);
                // Should the removal below not happen (a crash), the copy's
                // segment must outlive the original's (see `Wal::keep_after`).
                inner.wal.keep_after(new.segment, old.segment);
            } else {
                // It finished while being copied: retire the copy too.
                late_dones.push(inner.wal.append_done(id, new)?);
            }
        }
    }
    for rx in late_dones.into_iter().chain(late_marks) {
        rx.await.map_err(|_| EngineError::WriterGone)??;
    }
    let reserve_held = inner.wal.reserve_is_held();
    let mut written = Vec::new();
    for w in remember_departing(inner, &[segment]) {
        let result = match w.written {
            Ok(rx) => rx.await.unwrap_or(Err(WalError::Stopped)),
            Err(e) => Err(e),
        };
        written.push((w.frame, result));
    }
    // It may sync the ledger of owed frames.
    let settled = {
        let inner = inner.clone();
        tokio::task::spawn_blocking(move || {
            settle_remembered(&inner, written, reserve_held, &[segment])
        })
        .await
        .map_err(|_| EngineError::WriterGone)?
    };
    if settled.is_empty() {
        inner.wal.remove_compacted(segment)?;
    } else {
        // Dead now: collected once its Remembered frames are written.
        tracing::debug!(
            segment = first_seq,
            "compacted segment kept for its Remembered frames"
        );
        return Ok(());
    }
    tracing::info!(segment = first_seq, moved, "compacted WAL segment");
    metrics::counter!("delayd_wal_compactions_total").increment(1);
    Ok(())
}
