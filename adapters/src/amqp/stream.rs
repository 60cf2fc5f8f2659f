//! A RabbitMQ stream as a route's ingress, consumed over AMQP 0-9-1.
//!
//! A stream keeps every message in order, each at an offset. A consumer
//! names where it starts (`x-stream-offset`), and RabbitMQ tells each
//! delivery's offset in an `x-stream-offset` header. So a message's identity
//! is exact: (stream, offset), as a Kafka record's is (topic, partition,
//! offset). Two messages with the same bytes (twins) sit at two offsets and
//! are never taken for one another.
//!
//! The header is the broker's, not the producer's: it is taken off the
//! message and kept in [`Message::offset`](crate::Message::offset), which is
//! stored with it and never republished.
//!
//! AMQP 0-9-1 keeps no consumer offset on the broker, so delayd keeps one:
//! a checkpoint file holds the next offset to read. It moves, in order
//! ([`crate::offsets`]), only past offsets whose messages are durable in
//! delayd, and an ack resolves once a checkpoint covering its offset is on
//! disk. After a restart delayd reads from the checkpoint; the few messages
//! stored after it are read again and recognised by their bytes, which
//! include the offset.
//!
//! `basic.ack` on a stream only returns credit (the prefetch window): a
//! stream forgets nothing when acked.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable as AmqpFieldTable};
use tokio::sync::{mpsc, oneshot};
use tracing::{error, warn};

use crate::message::{Message, Value};
use crate::offsets::{OffsetTracker, TopicPartition};
use crate::traits::{AckHandle, BoxFuture, SourceError};

/// The header RabbitMQ puts on every delivery from a stream.
pub const OFFSET_HEADER: &str = "x-stream-offset";

/// How often settled offsets are written to the checkpoint.
const CHECKPOINT_INTERVAL: Duration = Duration::from_millis(20);

/// Where delayd keeps a stream ingress's next offset.
#[derive(Debug, Clone)]
pub struct StreamConfig {
    pub offsets: Arc<dyn OffsetStore>,
}

impl StreamConfig {
    /// The next offset in a checkpoint file beside the local WAL (its
    /// directory is created if missing).
    pub fn file(checkpoint: PathBuf) -> Self {
        Self {
            offsets: Arc::new(FileOffsets { path: checkpoint }),
        }
    }
}

/// Where a stream ingress's next offset is kept durably: a file beside the
/// local WAL ([`FileOffsets`]), or the broker-kept store's state stream,
/// so that a new owner resumes where the last one left off.
pub trait OffsetStore: Send + Sync + std::fmt::Debug + 'static {
    /// The next offset saved for `queue`; `None`: none (the stream is read
    /// from its first retained message).
    fn load(&self, queue: &str) -> Result<Option<i64>, CheckpointError>;
    /// Save `next` for `queue` durably. Called on a blocking thread.
    fn save(&self, queue: &str, next: i64) -> Result<(), CheckpointError>;
}

/// The next offset in a file: `{"queue": ..., "next": N}`.
#[derive(Debug)]
pub struct FileOffsets {
    pub path: PathBuf,
}

impl OffsetStore for FileOffsets {
    fn load(&self, queue: &str) -> Result<Option<i64>, CheckpointError> {
        load_checkpoint(&self.path, queue)
    }

    fn save(&self, queue: &str, next: i64) -> Result<(), CheckpointError> {
        save_checkpoint(&self.path, queue, next)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("stream checkpoint {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("stream checkpoint {path}: cannot read it ({reason}); move it aside to read the stream from its first retained message")]
    Malformed { path: PathBuf, reason: String },
    /// The broker-kept store could not record the offset (the lock lost,
    /// a state write refused).
    #[error("stream offset of {queue} in the state stream: {reason}")]
    State { queue: String, reason: String },
}

/// Read the next offset saved for `queue`. `None`: no checkpoint, or one
/// of another queue (logged).
pub fn load_checkpoint(path: &Path, queue: &str) -> Result<Option<i64>, CheckpointError> {
    let text = match std::fs::read(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(CheckpointError::Io {
                path: path.to_owned(),
                source,
            })
        }
    };
    // `{"queue": ..., "next": N}`
    let malformed = |reason: String| CheckpointError::Malformed {
        path: path.to_owned(),
        reason,
    };
    let saved: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| malformed(e.to_string()))?;
    let (Some(saved_queue), Some(next)) = (saved["queue"].as_str(), saved["next"].as_i64()) else {
        return Err(malformed("no \"queue\" text and \"next\" offset".into()));
    };
    if saved_queue != queue {
        warn!(path = %path.display(), saved = %saved_queue, queue,
              "the stream checkpoint is another queue's; reading this stream from its first retained message");
        return Ok(None);
    }
    Ok(Some(next))
}

/// Write the next offset for `queue`: a new file, synced, renamed over the
/// old one, and the directory synced, so a crash leaves the old or the new.
pub fn save_checkpoint(path: &Path, queue: &str, next: i64) -> Result<(), CheckpointError> {
    let io = |source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io)?;
    let tmp = path.with_extension("tmp");
    let body = serde_json::json!({ "queue": queue, "next": next }).to_string();
    let mut file = std::fs::File::create(&tmp).map_err(io)?;
    file.write_all(body.as_bytes()).map_err(io)?;
    file.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io)?;
    Ok(())
}

/// Requeued deliveries (offset, epoch) whose stream must be read again.
pub type Rewinds = mpsc::UnboundedReceiver<(i64, u64)>;

/// One stream ingress's offsets: what was handed out, what is durable in
/// delayd, and the checkpoint. Shared by the source's task, its acks and
/// the checkpoint writer.
pub struct StreamPosition {
    queue: String,
    offsets: Arc<dyn OffsetStore>,
    /// The stream as one "partition" of the shared offset tracker.
    tp: TopicPartition,
    tracker: Mutex<OffsetTracker>,
    /// The checkpoint read at start: where the first consumer begins.
    loaded: Option<i64>,
    /// Requeued deliveries: read the stream again from there.
    rewinds: mpsc::UnboundedSender<(i64, u64)>,
}

impl std::fmt::Debug for StreamPosition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamPosition")
            .field("queue", &self.queue)
            .field("offsets", &self.offsets)
            .finish_non_exhaustive()
    }
}

impl StreamPosition {
    /// Loads the checkpoint and starts its writer (a task that ends with
    /// the position). Returns the receiver of rewind requests.
    pub fn start(
        queue: &str,
        config: &StreamConfig,
    ) -> Result<(Arc<Self>, Rewinds), CheckpointError> {
        let loaded = config.offsets.load(queue)?;
        let (rewinds, rewind_rx) = mpsc::unbounded_channel();
        let position = Arc::new(Self {
            queue: queue.to_owned(),
            offsets: config.offsets.clone(),
            tp: (queue.to_owned(), 0),
            tracker: Mutex::new(OffsetTracker::default()),
            loaded,
            rewinds,
        });
        tokio::spawn(write_checkpoints(Arc::downgrade(&position)));
        Ok((position, rewind_rx))
    }

    fn tracker(&self) -> MutexGuard<'_, OffsetTracker> {
        self.tracker.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Where a consumer starts now: one past the last delivery handed out
    /// (those in hand are still stored), else the checkpoint. `None`: the
    /// stream's first retained message.
    pub fn start_offset(&self) -> Option<i64> {
        self.tracker().next(&self.tp).or(self.loaded)
    }

    /// A delivery at `offset` is handed out: the epoch its ack presents.
    pub fn delivered(&self, offset: i64) -> u64 {
        self.tracker().delivered(&self.tp, offset)
    }

    /// Deliveries from `offset` on will be read again, if `epoch` is still
    /// that offset's (a late requeue of an older copy changes nothing).
    pub fn rewind(&self, offset: i64, epoch: u64) -> bool {
        let mut tracker = self.tracker();
        if !tracker.is_current(&self.tp, offset, epoch) {
            return false;
        }
        tracker.rewind(&self.tp, offset);
        true
    }

    /// Write the checkpoint now if an ack waits for it (also at close).
    pub fn checkpoint_now(&self) {
        let commits = self.tracker().take_commits();
        for (tp, next) in commits {
            match self.offsets.save(&self.queue, next) {
                Ok(()) => self.tracker().committed(&tp, next),
                // The broker-kept store's session is over (its lock lost, a
                // state write failed): no commit comes for these acks.
                // Failed now, not at the intake's stop timeout (30 s,
                // retried every 20 ms meanwhile), which kept a former
                // owner from standing by again.
                Err(e @ CheckpointError::State { .. }) => {
                    warn!(queue = %self.queue, error = %e, "the stream offset cannot be recorded any more; deliveries waiting for it go back");
                    self.tracker().fail_waiters(&tp, &e.to_string());
                }
                Err(e) => {
                    error!(queue = %self.queue, error = %e, "cannot write the stream checkpoint; retrying");
                    self.tracker().commit_failed(&tp);
                }
            }
        }
    }
}

/// The checkpoint writer: every [`CHECKPOINT_INTERVAL`], past every offset
/// durable in delayd. A blocking thread does the file work.
async fn write_checkpoints(position: Weak<StreamPosition>) {
    let mut tick = tokio::time::interval(CHECKPOINT_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(position) = position.upgrade() else {
            return;
        };
        let _ = tokio::task::spawn_blocking(move || position.checkpoint_now()).await;
    }
}

/// The consumer arguments that start reading at `offset` (`None`: the
/// first retained message).
pub fn consumer_arguments(offset: Option<i64>) -> AmqpFieldTable {
    let mut args = AmqpFieldTable::default();
    let value = match offset {
        Some(offset) => AMQPValue::LongLongInt(offset),
        None => AMQPValue::LongString("first".into()),
    };
    args.insert(OFFSET_HEADER.into(), value);
    args
}

/// Take the broker's offset header off a delivered message and keep the
/// offset in [`Message::offset`]. `None` if it has none.
pub fn take_offset(message: &mut Message) -> Option<i64> {
    let offset = match message.headers.remove(OFFSET_HEADER)? {
        Value::I64(o) => o,
        Value::I32(o) => i64::from(o),
        Value::U32(o) => i64::from(o),
        Value::U64(o) => i64::try_from(o).ok()?,
        _ => return None,
    };
    message.offset = Some(offset);
    Some(offset)
}

/// Gives a delivery's credit back to the broker when awaited: a
/// `basic.ack`, coalesced with its neighbours' into `multiple` acks by the
/// source. Credit only: a stream keeps the message whatever the answer.
pub type Credit = BoxFuture<'static, ()>;

/// Settles one stream delivery: credit back to the broker at once, and the
/// ack resolves once the checkpoint is past it.
pub struct StreamAck {
    pub(super) credit: Credit,
    pub(super) offset: i64,
    pub(super) epoch: u64,
    pub(super) position: Arc<StreamPosition>,
}

impl StreamAck {
    /// Give the credit back; what is left to settle: (offset, epoch, position).
    async fn give_credit(self) -> (i64, u64, Arc<StreamPosition>) {
        self.credit.await;
        (self.offset, self.epoch, self.position)
    }
}

impl AckHandle for StreamAck {
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), SourceError>> {
        Box::pin(async move {
            let (offset, epoch, position) = self.give_credit().await;
            let (waiter, done) = oneshot::channel();
            let tp = position.tp.clone();
            position.tracker().settle(&tp, offset, epoch, waiter);
            match done.await {
                Ok(Ok(())) => Ok(()),
                Ok(Err(reason)) => Err(SourceError::Connection(reason)),
                Err(_) => Err(SourceError::Connection(format!(
                    "{}@{offset}: the source closed before its checkpoint",
                    position.queue
                ))),
            }
        })
    }

    /// Read the stream again from this delivery (the broker has no queue
    /// to put it back in).
    fn requeue(self: Box<Self>) -> BoxFuture<'static, Result<(), SourceError>> {
        Box::pin(async move {
            let (offset, epoch, position) = self.give_credit().await;
            position
                .rewinds
                .send((offset, epoch))
                .map_err(|_| SourceError::Closed)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_survives_and_names_its_queue() {
        let dir = std::env::temp_dir().join(format!("delayd-stream-ckpt-{}", std::process::id()));
        let path = dir.join("orders.offset");
        assert_eq!(load_checkpoint(&path, "orders").unwrap(), None);
        save_checkpoint(&path, "orders", 42).unwrap();
        save_checkpoint(&path, "orders", 43).unwrap();
        assert_eq!(load_checkpoint(&path, "orders").unwrap(), Some(43));
        assert_eq!(
            load_checkpoint(&path, "payments").unwrap(),
            None,
            "another queue's checkpoint is not this one's"
        );
        std::fs::write(&path, b"{not json").unwrap();
        let e = load_checkpoint(&path, "orders").unwrap_err().to_string();
        assert!(e.contains("orders.offset"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The broker-kept store that records the offsets, its session over.
    #[derive(Debug)]
    struct SessionOver;

    impl OffsetStore for SessionOver {
        fn load(&self, _: &str) -> Result<Option<i64>, CheckpointError> {
            Ok(None)
        }
        fn save(&self, queue: &str, _: i64) -> Result<(), CheckpointError> {
            Err(CheckpointError::State {
                queue: queue.to_owned(),
                reason: "this instance does not own the route".into(),
            })
        }
    }

    #[tokio::test]
    async fn acks_waiting_for_an_offset_the_state_stream_cannot_take_fail_at_once() {
        let config = StreamConfig {
            offsets: Arc::new(SessionOver),
        };
        let (position, _rewinds) = StreamPosition::start("orders", &config).unwrap();
        let epoch = position.delivered(7);
        let (waiter, mut acked) = tokio::sync::oneshot::channel();
        position.tracker().settle(&position.tp, 7, epoch, waiter);
        position.checkpoint_now();
        let outcome = acked.try_recv().expect("the ack is answered at once");
        assert!(outcome.unwrap_err().contains("does not own the route"));
    }

    #[test]
    fn the_offset_header_moves_into_the_message() {
        let mut m = Message::with_body("x");
        m.headers.insert("a", Value::I32(1));
        m.headers.insert(OFFSET_HEADER, Value::I64(7));
        assert_eq!(take_offset(&mut m), Some(7));
        assert_eq!(m.offset, Some(7));
        assert!(m.headers.get(OFFSET_HEADER).is_none());
        assert_eq!(m.headers.len(), 1);
        assert_eq!(take_offset(&mut Message::with_body("y")), None);
    }
}
