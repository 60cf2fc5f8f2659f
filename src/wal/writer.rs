//! The single writer thread: batches appends, one fdatasync per batch.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::claims::{Claim, Claims};
use super::frame::{self, Salt};
use super::fs::WalFile;
use super::halt::Halt;
use super::reserve::Reserve;
use super::segments::{segment_name, sync_dir, SegmentTable};
use super::{Appended, WalConfig, WalError, WalPos};

/// How an append is answered.
pub enum Reply {
    Plain(oneshot::Sender<Result<Appended, WalError>>),
    /// A Schedule its appender arms: answered with a [`Claim`], opened
    /// before any record of its batch is answered.
    Claimed(oneshot::Sender<Result<Claimed, WalError>>),
}

/// A durable Schedule, claimed until its appender drops the claim.
#[derive(Debug)]
pub struct Claimed {
    pub appended: Appended,
    pub claim: Claim,
}

impl Reply {
    fn fail(self, e: WalError) {
        match self {
            Reply::Plain(tx) => drop(tx.send(Err(e))),
            Reply::Claimed(tx) => drop(tx.send(Err(e))),
        }
    }
}

pub enum AppendRequest {
    Schedule {
        /// `Some` for a compaction copy, which keeps its id.
        id: Option<u64>,
        due_ms: u64,
        /// The message's identity (kept by a compaction copy too).
        uid: u128,
        route: String,
        message: Vec<u8>,
        /// A new message from an intake, or a compaction copy: never
        /// written on the disk reserve's room (see [`Reserve`]). A copy
        /// frees space only once its whole compaction is done, so on that
        /// room it would take what the fired messages' Dones and the far
        /// tier's loads need (sim seed 9104734).
        off_reserve: bool,
        /// An Acked mark written right after it, in the same batch and so
        /// the same segment: a compaction copy of a record whose ack is
        /// settled (a restart reads the copy as the newest record under its
        /// id, and only a mark after it says so).
        mark_after: Option<u64>,
    },
    Done {
        id: u64,
        segment: u64,
        /// A fired message's Done: it waits, unwritten, for the next batch
        /// that is written anyway, or `WalConfig::lazy_done_wait` at most,
        /// so it costs no fdatasync of its own. Losing it to a crash only
        /// sends the message again after the restart.
        lazy: bool,
        /// Acked marks written just before it, in the same batch and so
        /// the same segment (a cancel's marks: they last as long as the
        /// Done, which lasts as long as the Schedule it retires).
        marks: Vec<u64>,
        /// A cancel's Done: its Schedule's segment is held until the Done
        /// is durable, or failed and the Schedule is live again.
        hold: Option<RetireHold>,
    },
    /// The source's ack of stored message `id` was confirmed (or, with
    /// `engine::dedup::CANCELLED_MARK` set, it was cancelled). Lazy unless
    /// asked: losing an ack's mark to a crash only leaves the message among
    /// those a restart compares redeliveries with. `keeps`: the segment a
    /// restart reads the record back from (its Schedule's, perhaps a
    /// compaction copy's, or its Remembered frame's), which the mark must
    /// outlive; `None`: the one its id was written to.
    Acked {
        id: u64,
        lazy: bool,
        keeps: Option<u32>,
    },
    /// What redelivery detection keeps of a departing message (see
    /// `Wal::append_remembered`). Written, like a Done, on the disk
    /// reserve's room: it goes just before a segment that holds more is
    /// deleted, so it frees space too.
    Remembered(frame::Remembered),
}

impl AppendRequest {
    /// A Schedule under a new id that is not a new message (a far load's
    /// copy): it may be written on the disk reserve's room.
    pub fn schedule(due_ms: u64, uid: u128, route: &str, message: Vec<u8>) -> Self {
        AppendRequest::Schedule {
            id: None,
            due_ms,
            uid,
            route: route.to_owned(),
            message,
            off_reserve: false,
            mark_after: None,
        }
    }

    /// A compaction copy of a stored Schedule: it keeps its id and uid
    /// (`mark_after`: see [`AppendRequest::Schedule`]).
    pub fn copy(
        id: u64,
        due_ms: u64,
        uid: u128,
        route: &str,
        message: Vec<u8>,
        mark_after: Option<u64>,
    ) -> Self {
        AppendRequest::Schedule {
            id: Some(id),
            due_ms,
            uid,
            route: route.to_owned(),
            message,
            off_reserve: true,
            mark_after,
        }
    }

    fn is_off_reserve(&self) -> bool {
        matches!(
            self,
            AppendRequest::Schedule {
                off_reserve: true,
                ..
            }
        )
    }

    /// A new message's Schedule, from an intake.
    pub fn new_message(due_ms: u64, uid: u128, route: &str, message: Vec<u8>) -> Self {
        AppendRequest::Schedule {
            id: None,
            due_ms,
            uid,
            route: route.to_owned(),
            message,
            off_reserve: true,
            mark_after: None,
        }
    }

    pub fn done(id: u64, segment: u64) -> Self {
        AppendRequest::Done {
            id,
            segment,
            lazy: false,
            marks: Vec::new(),
            hold: None,
        }
    }

    /// A Done with Acked marks just before it (see `Done::marks`).
    pub fn done_with_marks(id: u64, segment: u64, marks: Vec<u64>) -> Self {
        AppendRequest::Done {
            id,
            segment,
            lazy: false,
            marks,
            hold: None,
        }
    }

    /// [`AppendRequest::done_with_marks`] holding its Schedule's segment
    /// (see `Done::hold`).
    pub fn retiring_done(id: u64, segment: u64, marks: Vec<u64>, hold: RetireHold) -> Self {
        AppendRequest::Done {
            id,
            segment,
            lazy: false,
            marks,
            hold: Some(hold),
        }
    }

    /// A Done that may wait for the next batch (see `Done::lazy`).
    pub fn lazy_done(id: u64, segment: u64) -> Self {
        AppendRequest::Done {
            id,
            segment,
            lazy: true,
            marks: Vec::new(),
            hold: None,
        }
    }

    fn is_lazy(&self) -> bool {
        matches!(
            self,
            AppendRequest::Done { lazy: true, .. } | AppendRequest::Acked { lazy: true, .. }
        )
    }

    fn size(&self) -> usize {
        match self {
            AppendRequest::Schedule {
                route,
                message,
                mark_after,
                ..
            } => 64 + route.len() + message.len() + if mark_after.is_some() { 32 } else { 0 },
            AppendRequest::Done { marks, .. } => 40 + 32 * marks.len(),
            AppendRequest::Acked { .. } => 32,
            AppendRequest::Remembered(_) => 96,
        }
    }
}

enum Command {
    /// A record, with when it was sent: its wait counts from then.
    Append(AppendRequest, Reply, Instant),
    /// Everything sent before this is durable when the reply comes.
    Close(oneshot::Sender<Result<(), WalError>>),
}

pub struct Writer {
    tx: Mutex<Option<mpsc::Sender<Command>>>,
    halt: Halt,
    fsyncs: Arc<AtomicU64>,
    /// Records sent, and records answered (written or failed): equal when
    /// the writer has nothing left to do.
    sent: AtomicU64,
    answered: Arc<AtomicU64>,
    /// Every seq (and so every id) of a durable record is below this, and
    /// every one handed out from now on, restarts included, at or above.
    next_seq: Arc<AtomicU64>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Writer {
    pub fn start(
        config: WalConfig,
        segments: Arc<Mutex<SegmentTable>>,
        claims: Arc<Claims>,
        reserve: Arc<Reserve>,
        next_seq: u64,
        last: Option<u32>,
    ) -> Result<Self, WalError> {
        let halt = Halt::default();
        let fsyncs = Arc::new(AtomicU64::new(0));
        let answered = Arc::new(AtomicU64::new(0));
        let shared_next_seq = Arc::new(AtomicU64::new(next_seq));
        let mut state = WriterState {
            fsyncs: fsyncs.clone(),
            answered: answered.clone(),
            shared_next_seq: shared_next_seq.clone(),
            config,
            segments,
            claims,
            reserve,
            sealed_while_unheld: false,
            file: None,
            head: 0,
            head_bytes: 0,
            salt: Salt::UNSALTED,
            next_seq,
            buf: Vec::with_capacity(1 << 20),
            halt: halt.clone(),
        };
        if !last.is_some_and(|ordinal| state.resume(ordinal)) {
            state.rotate()?;
        }
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("delayd-wal-writer".into())
            .spawn(move || state.run(rx))
            .map_err(|e| WalError::Invalid(format!("cannot start WAL writer thread: {e}")))?;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            halt,
            fsyncs,
            sent: AtomicU64::new(0),
            answered,
            next_seq: shared_next_seq,
            thread: Mutex::new(Some(thread)),
        })
    }

    pub fn send(
        &self,
        request: AppendRequest,
    ) -> Result<oneshot::Receiver<Result<Appended, WalError>>, WalError> {
        let (reply, rx) = oneshot::channel();
        self.send_with(request, Reply::Plain(reply))?;
        Ok(rx)
    }

    /// [`Writer::send`] for a Schedule answered with a claim.
    pub fn send_claimed(
        &self,
        request: AppendRequest,
    ) -> Result<oneshot::Receiver<Result<Claimed, WalError>>, WalError> {
        let (reply, rx) = oneshot::channel();
        self.send_with(request, Reply::Claimed(reply))?;
        Ok(rx)
    }

    fn send_with(&self, request: AppendRequest, reply: Reply) -> Result<(), WalError> {
        if self.is_stopped() {
            return Err(WalError::Stopped);
        }
        let guard = self.tx.lock().expect("writer sender poisoned");
        let tx = guard.as_ref().ok_or(WalError::Stopped)?;
        tx.send(Command::Append(request, reply, Instant::now()))
            .map_err(|_| WalError::Stopped)?;
        self.sent.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    /// Every seq, and so every id, of a durable record is below this; every
    /// one handed out from now on, restarts included, is at or above it.
    pub fn next_seq(&self) -> u64 {
        self.next_seq.load(Ordering::Acquire)
    }

    /// Every record sent so far was answered (a test's condition to wait
    /// for: lazy Dones included).
    pub fn is_idle(&self) -> bool {
        self.answered.load(Ordering::Acquire) >= self.sent.load(Ordering::Acquire)
    }

    /// Records sent and not yet answered (a test's condition to wait for).
    pub fn unanswered(&self) -> u64 {
        self.sent
            .load(Ordering::Acquire)
            .saturating_sub(self.answered.load(Ordering::Acquire))
    }

    pub fn is_stopped(&self) -> bool {
        self.halt.is_stopped()
    }

    pub fn halt(&self) -> &Halt {
        &self.halt
    }

    /// Group commits (fdatasyncs) done so far.
    pub fn fsyncs(&self) -> u64 {
        self.fsyncs.load(Ordering::Relaxed)
    }

    pub fn close(&self) -> Result<(), WalError> {
        let Some(tx) = self.tx.lock().expect("writer sender poisoned").take() else {
            return Ok(());
        };
        let (reply, rx) = oneshot::channel();
        let sent = tx.send(Command::Close(reply)).is_ok();
        drop(tx);
        let result = if sent {
            rx.blocking_recv().unwrap_or(Err(WalError::Stopped))
        } else {
            Err(WalError::Stopped)
        };
        if let Some(handle) = self.thread.lock().expect("writer thread poisoned").take() {
            let _ = handle.join();
        }
        result
    }
}

struct WriterState {
    fsyncs: Arc<AtomicU64>,
    answered: Arc<AtomicU64>,
    shared_next_seq: Arc<AtomicU64>,
    config: WalConfig,
    segments: Arc<Mutex<SegmentTable>>,
    claims: Arc<Claims>,
    /// Released at the first ENOSPC, for the write to try once more.
    reserve: Arc<Reserve>,
    /// The head was sealed early since the reserve was last held.
    sealed_while_unheld: bool,
    file: Option<(Box<dyn WalFile>, PathBuf)>,
    head: u32,
    head_bytes: u64,
    /// The head segment's CRC salt.
    salt: Salt,
    next_seq: u64,
    buf: Vec<u8>,
    halt: Halt,
}

/// One record of a batch, waiting for the batch's fsync.
struct Pending {
    reply: Reply,
    /// A cancel's Done's hold on its Schedule's segment.
    hold: Option<RetireHold>,
    appended: Appended,
    kind: Kind,
    /// A Schedule's due time (what its claim is ordered by).
    due_ms: u64,
    /// A Schedule's route (claims are per route).
    route: Option<String>,
}

/// A Schedule counted dead ahead of its Done, its segment held
/// ([`SegmentTable::hold_retiring`]). Dropped unwritten (its batch failed,
/// the log stopped, the request never reached the writer), the Schedule is
/// live again: a segment deleted while the Done was on its way lost the
/// message whose cancel then failed
/// (`engine::tests::a_cancel_whose_done_fails_keeps_the_message_on_disk`).
pub struct RetireHold {
    segments: Arc<Mutex<SegmentTable>>,
    ordinal: u32,
    written: bool,
}

impl RetireHold {
    /// Count a Schedule in `ordinal` dead and hold the segment.
    pub fn take(segments: &Arc<Mutex<SegmentTable>>, ordinal: u32) -> Self {
        segments
            .lock()
            .expect("segment table poisoned")
            .hold_retiring(ordinal);
        RetireHold {
            segments: segments.clone(),
            ordinal,
            written: false,
        }
    }

    /// The Done is durable: the Schedule stays dead.
    fn written(mut self) {
        self.written = true;
    }
}

impl Drop for RetireHold {
    fn drop(&mut self) {
        self.segments
            .lock()
            .expect("segment table poisoned")
            .release_retiring(self.ordinal, self.written);
    }
}

/// What a written record counts as in the segment table.
enum Kind {
    Schedule,
    /// A Done retiring a Schedule of the segment with this first seq.
    Done(u64),
    /// An Acked mark for this id, kept by this segment (see
    /// [`SegmentTable::record_mark`]).
    Acked(u64, Option<u32>),
    /// Counts for nothing (a Remembered frame).
    Mark,
}

/// The writer's shortest sleep while a batch waits (`lazy_done_wait` = 0
/// must not make it spin).
const MIN_SLEEP_STEP: Duration = Duration::from_micros(500);

impl WriterState {
    fn run(mut self, rx: mpsc::Receiver<Command>) {
        // Requests in arrival order; lazy Dones stay here until a batch is
        // written anyway (so only the last batch is ever unsynced, as the
        // crash rules require).
        let mut batch: Vec<(AppendRequest, Reply)> = Vec::new();
        let mut bytes = 0;
        // When the batch must be written: lazy Dones wait `lazy_done_wait`
        // at most, other records `commit_delay`. A batch that reaches
        // `max_batch_bytes` goes at once, or (while the writer sleeps out a
        // commit delay) when it wakes, one step later at most.
        let mut deadline: Option<Instant> = None;
        loop {
            let first = match deadline {
                None => match rx.recv() {
                    Ok(cmd) => cmd,
                    Err(_) => break,
                },
                // Sleep out the wait, in steps of `commit_delay` or
                // `lazy_done_wait` at most, whichever is shorter, rather than
                // waking for every record that joins the batch: a wake-up
                // per step instead of one per record. A record that may not
                // wait as long as the batch (a Done joining Schedules) is
                // found within one step, and its own wait counts from when
                // it was sent. A Done's wait is what a kill -9 turns into
                // same-id copies (docs/fault-campaign.md), so it is not left
                // behind a Schedule's longer commit delay.
                Some(at) if !self.config.commit_delay.is_zero() => {
                    let left = at.saturating_duration_since(Instant::now());
                    std::thread::sleep(left.min(self.sleep_step()));
                    match rx.try_recv() {
                        Ok(cmd) => cmd,
                        Err(mpsc::TryRecvError::Empty) => {
                            if at <= Instant::now() {
                                self.write_batch(&mut batch);
                                (bytes, deadline) = (0, None);
                            }
                            continue;
                        }
                        Err(mpsc::TryRecvError::Disconnected) => break,
                    }
                }
                Some(at) => {
                    let left = at.saturating_duration_since(Instant::now());
                    match rx.recv_timeout(left) {
                        Ok(cmd) => cmd,
                        Err(mpsc::RecvTimeoutError::Timeout) => {
                            self.write_batch(&mut batch);
                            (bytes, deadline) = (0, None);
                            continue;
                        }
                        Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    }
                }
            };
            let mut close = None;
            let mut next = Some(first);
            while let Some(cmd) = next.take() {
                match cmd {
                    Command::Append(req, reply, sent) => {
                        let wait = if req.is_lazy() {
                            self.config.lazy_done_wait
                        } else {
                            self.config.commit_delay
                        };
                        deadline = Some(deadline.map_or(sent + wait, |at| at.min(sent + wait)));
                        bytes += req.size();
                        batch.push((req, reply));
                    }
                    Command::Close(reply) => close = Some(reply),
                }
                if close.is_none() && bytes < self.config.max_batch_bytes {
                    next = rx.try_recv().ok();
                }
            }
            let due = deadline.is_none_or(|at| at <= Instant::now());
            if !due && close.is_none() && bytes < self.config.max_batch_bytes {
                continue;
            }
            self.write_batch(&mut batch);
            (bytes, deadline) = (0, None);
            if let Some(reply) = close {
                let result = if self.is_stopped() {
                    Err(WalError::Stopped)
                } else {
                    Ok(())
                };
                let _ = reply.send(result);
                return;
            }
        }
        self.write_batch(&mut batch);
    }

    /// The longest the writer sleeps at once while a batch waits.
    fn sleep_step(&self) -> Duration {
        let done_wait = self.config.lazy_done_wait.max(MIN_SLEEP_STEP);
        self.config.commit_delay.min(done_wait)
    }

    fn is_stopped(&self) -> bool {
        self.halt.is_stopped()
    }

    fn write_batch(&mut self, batch: &mut Vec<(AppendRequest, Reply)>) {
        let n = batch.len() as u64;
        self.write_batch_answered(batch);
        self.answered.fetch_add(n, Ordering::AcqRel);
    }

    /// Write the batch and answer each of its records.
    fn write_batch_answered(&mut self, batch: &mut Vec<(AppendRequest, Reply)>) {
        if batch.is_empty() {
            return;
        }
        if self.is_stopped() {
            for (_, reply) in batch.drain(..) {
                reply.fail(WalError::Stopped);
            }
            return;
        }
        // A new message is admitted only while the reserve is held, but an
        // ENOSPC elsewhere (a batch just before, the far tier) may have
        // released it since: the room it left is not theirs, nor a
        // compaction copy's.
        if !self.reserve.is_held() {
            self.refuse_off_reserve(batch);
            if batch.is_empty() {
                return;
            }
        }
        // While the disk reserve is not held (released at an ENOSPC, or not
        // yet made again since a start on a full disk), the head is sealed
        // early, once: a full disk would never let it fill, and a sealed
        // segment whose records all left is deleted, which is how the disk
        // empties. A start goes on in its last segment, so it too must be
        // sealed this way (sim seed 2934: a resumed head of dead records
        // held the disk full for good).
        if self.reserve.is_held() {
            self.sealed_while_unheld = false;
        }
        let full = self.head_bytes >= self.config.segment_bytes;
        let seal_early = !self.sealed_while_unheld
            && !self.reserve.is_held()
            && self.head_bytes > frame::SEGMENT_HEADER_BYTES;
        if full || seal_early {
            let mut rotated = self.rotate();
            if matches!(rotated, Err(WalError::DiskFull(_))) && self.reserve.release() {
                rotated = self.rotate();
            }
            match rotated {
                Ok(()) => self.sealed_while_unheld |= seal_early,
                // Not full yet: the batch goes into the head, and a later
                // batch tries the seal again.
                Err(WalError::DiskFull(_)) if !full => {}
                Err(e) => {
                    // A full disk passes; anything else (the directory gone, a
                    // failed directory fsync) leaves no safe place to write.
                    let e = match e {
                        WalError::DiskFull(_) => e,
                        WalError::Io { path, source } => WalError::Fatal {
                            op: "segment create",
                            path,
                            source,
                        },
                        other => other,
                    };
                    tracing::error!(error = %e, "cannot start a new WAL segment");
                    if e.is_fatal() {
                        self.halt.stop(&e);
                    }
                    fail_all(batch.drain(..).map(|(_, r)| r), &e);
                    return;
                }
            }
        }
        self.buf.clear();
        let salt = self.salt;
        let batch_first_seq = self.next_seq;
        let mut pending = Vec::with_capacity(batch.len());
        let mut has_off_reserve = false;
        for (req, reply) in batch.drain(..) {
            let seq = self.next_seq;
            self.next_seq += 1;
            let offset = (self.head_bytes + self.buf.len() as u64) as u32;
            let pos = WalPos {
                segment: self.head,
                offset,
            };
            let mut hold = None;
            let (id, kind, due_ms, route) = match req {
                AppendRequest::Schedule {
                    id,
                    due_ms,
                    uid,
                    route,
                    message,
                    off_reserve,
                    mark_after,
                } => {
                    has_off_reserve |= off_reserve;
                    let id = id.unwrap_or(seq);
                    let schedule = frame::Schedule {
                        id,
                        due_ms,
                        uid,
                        route: &route,
                        message: &message,
                    };
                    frame::put_schedule(&mut self.buf, salt, seq, &schedule);
                    // In this segment: it needs no entry in the table.
                    if let Some(mark) = mark_after {
                        frame::put_acked(&mut self.buf, salt, self.next_seq, mark);
                        self.next_seq += 1;
                    }
                    (id, Kind::Schedule, due_ms, Some(route))
                }
                AppendRequest::Done {
                    id,
                    segment,
                    marks,
                    hold: retiring,
                    ..
                } => {
                    hold = retiring;
                    // Each mark takes a seq of its own, before the Done's.
                    let mut seq = seq;
                    for mark in marks {
                        frame::put_acked(&mut self.buf, salt, seq, mark);
                        seq = self.next_seq;
                        self.next_seq += 1;
                    }
                    frame::put_done(&mut self.buf, salt, seq, id, segment);
                    (id, Kind::Done(segment), 0, None)
                }
                AppendRequest::Acked { id, keeps, .. } => {
                    frame::put_acked(&mut self.buf, salt, seq, id);
                    (id, Kind::Acked(id, keeps), 0, None)
                }
                AppendRequest::Remembered(remembered) => {
                    frame::put_remembered(&mut self.buf, salt, seq, &remembered);
                    (remembered.id, Kind::Mark, 0, None)
                }
            };
            pending.push(Pending {
                reply,
                hold,
                appended: Appended { id, pos },
                kind,
                due_ms,
                route,
            });
        }
        // The Commit tells recovery where this batch began, so a batch torn
        // with its later pages on disk and earlier ones not is recognised.
        frame::put_commit(&mut self.buf, salt, self.next_seq, batch_first_seq);
        self.next_seq += 1;
        match self.flush(has_off_reserve) {
            Ok(()) => {
                // Durable: ids of a batch that failed may be handed out
                // again after a restart, these never.
                self.shared_next_seq
                    .fetch_max(self.next_seq, Ordering::AcqRel);
                {
                    let mut table = self.segments.lock().expect("segment table poisoned");
                    table.set_bytes(self.head, self.head_bytes);
                    for p in &pending {
                        match p.kind {
                            Kind::Schedule => table.record_schedule(self.head, p.due_ms),
                            Kind::Done(target) => table.record_done(self.head, target),
                            Kind::Acked(id, keeps) => table.record_mark(self.head, id, keeps),
                            Kind::Mark => {}
                        }
                    }
                }
                for p in &mut pending {
                    if let Some(hold) = p.hold.take() {
                        hold.written();
                    }
                }
                // All of the batch's claims before any answer.
                let claimed = pending
                    .iter_mut()
                    .filter(|p| matches!(p.reply, Reply::Claimed(_)))
                    .map(|p| {
                        let route = p.route.take().unwrap_or_default();
                        (Arc::from(route), p.due_ms, p.appended.id)
                    });
                let mut claims = self.claims.open(claimed).into_iter();
                for p in pending {
                    match p.reply {
                        Reply::Plain(tx) => drop(tx.send(Ok(p.appended))),
                        Reply::Claimed(tx) => {
                            let claim = claims.next().expect("one claim per claimed record");
                            // Refused (the appender went away): the claim
                            // comes back in the error and closes here.
                            drop(tx.send(Ok(Claimed {
                                appended: p.appended,
                                claim,
                            })));
                        }
                    }
                }
            }
            Err(e) => fail_all(pending.into_iter().map(|p| p.reply), &e),
        }
    }

    /// Answer the batch's new messages and compaction copies "disk full",
    /// unwritten.
    fn refuse_off_reserve(&self, batch: &mut Vec<(AppendRequest, Reply)>) {
        let (refused, kept): (Vec<_>, Vec<_>) =
            batch.drain(..).partition(|(req, _)| req.is_off_reserve());
        batch.extend(kept);
        if !refused.is_empty() {
            let full = WalError::DiskFull(self.config.dir.clone());
            fail_all(refused.into_iter().map(|(_, reply)| reply), &full);
        }
    }

    /// Write the buffer and fdatasync. A write error cuts the file back to the
    /// start of the batch; an ENOSPC releases the disk reserve, and a batch
    /// without new messages or compaction copies (the reserve's room is
    /// never theirs) tries once more. An fsync error stops the log for good.
    fn flush(&mut self, has_off_reserve: bool) -> Result<(), WalError> {
        let written = match self.write_buf() {
            Err(WalError::DiskFull(_)) if self.reserve.release() && !has_off_reserve => {
                self.write_buf()
            }
            written => written,
        };
        if let Err(e) = &written {
            tracing::error!(error = %e, "WAL write failed; batch rejected");
        }
        written?;
        self.sync_head()
    }

    /// Append the buffer; on failure, cut the head back to where it began.
    fn write_buf(&mut self) -> Result<(), WalError> {
        let (file, path) = self.file.as_mut().ok_or(WalError::Stopped)?;
        if let Err(e) = file.append(&self.buf) {
            let err = WalError::io(path, e);
            // The cut is made durable at once: the segment may be sealed
            // next, and a sealed segment must not end in half a batch.
            // (Appends go to the end, so the next batch starts at the cut.)
            let cut = file.set_len(self.head_bytes).and_then(|_| file.sync_all());
            if let Err(e) = cut {
                let err = WalError::Fatal {
                    op: "cut-back of a failed write",
                    path: path.clone(),
                    source: e,
                };
                tracing::error!(error = %err, "stopping the log");
                self.halt.stop(&err);
                return Err(err);
            }
            return Err(err);
        }
        Ok(())
    }

    fn sync_head(&mut self) -> Result<(), WalError> {
        let (file, path) = self.file.as_mut().ok_or(WalError::Stopped)?;
        let started = Instant::now();
        if let Err(source) = file.sync_data() {
            let err = WalError::Fatal {
                op: "fdatasync",
                path: path.clone(),
                source,
            };
            tracing::error!(error = %err, "stopping the log");
            self.halt.stop(&err);
            return Err(err);
        }
        self.fsyncs.fetch_add(1, Ordering::Relaxed);
        metrics::histogram!("delayd_wal_fsync_seconds").record(started.elapsed().as_secs_f64());
        metrics::counter!("delayd_wal_fsyncs_total").increment(1);
        metrics::counter!("delayd_wal_written_bytes_total").increment(self.buf.len() as u64);
        self.head_bytes += self.buf.len() as u64;
        Ok(())
    }

    /// Take recovery's last segment as the head: appends go on after its
    /// last whole batch (recovery cut any torn tail, durably). A head that
    /// is already full is sealed at the first batch, as any full head is.
    /// False if it cannot be opened (a new head is made instead).
    fn resume(&mut self, ordinal: u32) -> bool {
        let mut table = self.segments.lock().expect("segment table poisoned");
        let Some((_, path, salt)) = table.file(ordinal) else {
            return false;
        };
        let Some(bytes) = table.bytes(ordinal) else {
            return false;
        };
        match self.config.fs.open_append(&path) {
            Ok(file) => {
                table.unseal(ordinal);
                self.head = ordinal;
                self.head_bytes = bytes;
                self.salt = salt;
                self.file = Some((file, path));
                true
            }
            Err(e) => {
                tracing::warn!(segment = %path.display(), error = %e, "cannot go on writing the last WAL segment; starting a new one");
                false
            }
        }
    }

    /// Seal the head and start a new segment named after the next seq.
    fn rotate(&mut self) -> Result<(), WalError> {
        let fs = &*self.config.fs;
        let path = self.config.dir.join(segment_name(self.next_seq));
        let file = fs.create_new(&path).map_err(|e| WalError::io(&path, e))?;
        let salt = Salt::random();
        let header = frame::segment_header(salt.value());
        let written = file.append(&header).and_then(|_| file.sync_all());
        if let Err(e) = written {
            // The removal is made durable before anything else is written:
            // else a power loss could keep the name, and this empty segment
            // would stand after the head, whose torn last batch (a later
            // write cut short) would then be read as corruption (sim seed
            // 1791).
            let _ = fs.remove_file(&path);
            sync_dir(fs, &self.config.dir)?;
            return Err(WalError::io(&path, e));
        }
        sync_dir(fs, &self.config.dir)?;
        let reader = fs.open(&path).map_err(|e| WalError::io(&path, e))?;
        let mut table = self.segments.lock().expect("segment table poisoned");
        if self.file.is_some() {
            table.seal(self.head);
        }
        self.head = table.add(
            self.next_seq,
            path.clone(),
            Arc::from(reader),
            frame::SEGMENT_HEADER_BYTES,
            salt,
        );
        self.head_bytes = frame::SEGMENT_HEADER_BYTES;
        self.salt = salt;
        self.file = Some((file, path));
        Ok(())
    }
}

fn fail_all(replies: impl Iterator<Item = Reply>, err: &WalError) {
    for reply in replies {
        let e = match err {
            WalError::Fatal { .. } | WalError::Stopped => WalError::Stopped,
            WalError::DiskFull(p) => WalError::DiskFull(p.clone()),
            other => WalError::Invalid(other.to_string()),
        };
        reply.fail(e);
    }
}
