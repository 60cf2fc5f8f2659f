//! One route's intake: consume, work out the due time, store durably, and
//! only then acknowledge. Bad input goes to the route's invalid destination.
//!
//! Records are queued for the WAL in the order they are consumed (the wait
//! for durability runs concurrently), so messages due at the same time keep
//! their source order. A Kafka tombstone on a `cancel_on_tombstone` route
//! waits for every earlier record to be stored, then cancels by key.
//!
//! In retry mode a message out of attempts goes to the park destination.

use std::sync::Arc;
use std::time::Duration;

use delayd_adapters::log_burst::BurstLog;
use delayd_adapters::{AckHandle, BoxFuture, Delivery, Source, SourceError};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::engine::{Admission, Arrival, Engine, EngineError, Outcome, Pressure, Stored};
use crate::route::{handoff, rewrite, Destination, Plan, Route};
use crate::wal::WalError;

use super::backpressure::Backpressure;
use super::brokers::Brokers;
use super::identity::{kafka_identity, stream_identity};
use super::in_hand::{InHand, Ticket};
use super::park::park;
use super::store::RouteStore;
use crate::finisher::Finisher;
use crate::id::MessageId;

/// A delivery whose WAL record is queued (or that is invalid, or that waits
/// for room).
enum Started {
    Store(Attempt),
    Invalid(Box<Aside>),
    /// Retry mode, out of attempts.
    Park(Box<Aside>),
}

/// A delivery to publish aside (invalid, or parked), then ack.
struct Aside {
    message: delayd_adapters::Message,
    ack: Box<dyn AckHandle>,
}

/// One try at storing a delivery.
enum Attempt {
    Storing {
        held: Box<Held>,
        stored: BoxFuture<'static, Result<Stored, EngineError>>,
        /// Counts against `max_pending` until the record is armed.
        admission: Admission,
    },
    /// At a backpressure limit: held unacked until there is room.
    Refused { why: Pressure, held: Box<Held> },
}

/// A delivery delayd keeps unacknowledged until it is stored. It is never
/// handed back to the broker to be tried later: every requeue counts against
/// a quorum queue's `x-delivery-limit`, past which the broker drops or
/// dead-letters the message. The prefetch bounds how many are held.
struct Held {
    message: delayd_adapters::Message,
    /// `message` encoded, as stored.
    encoded: Arc<[u8]>,
    due: u64,
    /// Its identity, assigned at intake (see `crate::id`).
    uid: MessageId,
    /// Redelivered or not, and the source session it came on.
    arrival: Arrival,
    ack: Box<dyn AckHandle>,
    /// Its place among the deliveries in hand (AMQP only): a redelivery of
    /// it takes its identity and supersedes it.
    ticket: Option<Ticket>,
}

/// The intake's warnings that come in bursts (see [`BurstLog`]).
#[derive(Debug, Default)]
pub struct IntakeBursts {
    unsent_acks: BurstLog,
    store_failures: BurstLog,
}

/// How long a delivery whose store failed for a passing reason waits
/// before it is stored again.
const STORE_RETRY: Duration = Duration::from_millis(500);

/// While paused, how often the intake looks whether it may resume.
const RECHECK: Duration = Duration::from_millis(100);

/// At stop, how long the source may take to pause.
const STOP_WAIT: Duration = Duration::from_secs(5);

#[derive(Clone)]
pub struct Intake {
    pub route: Arc<Route>,
    pub engine: Engine,
    pub brokers: Brokers,
    /// Deliveries being stored at once (group commit batches them).
    pub concurrency: usize,
    /// Cancelled when the process must stop because the WAL failed.
    pub fatal: CancellationToken,
    /// Shared backpressure state (limits, full disk, paused routes).
    pub pressure: Arc<Backpressure>,
    /// Bytes of message bodies being stored, shared by every route's intake
    /// (`engine.max_bytes_in_flight`): a delivery waits, unacked, for room.
    pub bytes: Arc<Semaphore>,
    /// The budget `bytes` started with.
    pub byte_budget: usize,
    /// The route's broker-kept store (`store.kind = "broker"`).
    pub store: Option<RouteStore>,
    /// Deliveries taken and not yet settled, for one identity per message
    /// across redeliveries (shared by the route's terms of ownership).
    pub in_hand: Arc<InHand>,
    /// Warnings that come once per delivery when a connection or an
    /// ownership ends: logged once a burst.
    pub bursts: Arc<IntakeBursts>,
}

impl Intake {
    /// Consume until `stop`, then wait for the deliveries being stored.
    ///
    /// Backpressure: at a limit the source is paused (deliveries it had
    /// already received still come through and are stored if there is room,
    /// else returned to the broker); once relieved it resumes.
    pub async fn run(self, mut source: Box<dyn Source>, stop: CancellationToken) {
        let permits = Arc::new(Semaphore::new(self.concurrency.max(1)));
        let finisher = Finisher::start();
        let this = Arc::new(self);
        let route = this.route.name().to_owned();
        let mut paused: Option<Pressure> = None;
        this.pressure.set_paused(&route, None);
        // Limits are looked at between deliveries and on this tick: with the
        // prefetch all taken (held at a limit or waiting for a full disk) no
        // delivery comes to trigger the pause.
        let mut recheck = tokio::time::interval(RECHECK);
        recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            paused = this.apply_backpressure(&mut *source, paused).await;
            // Both sources' `next` are channel receives: cancel-safe.
            let delivery = tokio::select! {
                d = source.next() => d,
                _ = stop.cancelled() => break,
                _ = recheck.tick() => continue,
            };
            let delivery = match delivery {
                Ok(d) => d,
                Err(SourceError::Closed) => break,
                Err(e) => {
                    tracing::warn!(route = %route, error = %e, "source error");
                    continue;
                }
            };
            if this.is_cancel(&delivery) {
                // Every earlier record must be stored before the cancel looks.
                let Ok(all) = permits.acquire_many(this.concurrency.max(1) as u32).await else {
                    break;
                };
                this.cancel_by_tombstone(delivery).await;
                drop(all);
                continue;
            }
            let Ok(permit) = permits.clone().acquire_owned().await else {
                break;
            };
            // Room for its bytes (one message bigger than the budget goes alone).
            let size = delivery.message.body.len().clamp(1, this.byte_budget) as u32;
            let byte_permit = tokio::select! {
                p = this.bytes.clone().acquire_many_owned(size) => match p {
                    Ok(p) => p,
                    Err(_) => break,
                },
                _ = stop.cancelled() => {
                    // Not taken: the broker gets it back when the channel closes.
                    drop(delivery);
                    break;
                }
            };
            let span = tracing::debug_span!(
                "intake",
                route = %route,
                redelivered = delivery.redelivered,
                message_id = delivery.message.properties.message_id.as_deref().unwrap_or(""),
            );
            let started = span.in_scope(|| this.start(delivery));
            let this = this.clone();
            let stop = stop.clone();
            finisher.run(
                async move {
                    this.finish(started, &stop).await;
                    drop((permit, byte_permit));
                }
                .instrument(span),
            );
        }
        // Bounded: a source whose connection died mid-call may never answer.
        match tokio::time::timeout(STOP_WAIT, source.pause()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::debug!(error = %e, "pausing source at shutdown"),
            Err(_) => {
                tracing::warn!(route = %route, "the source did not pause in time; closing it")
            }
        }
        // Deliveries already taken finish storing and get acked (or go back
        // to the broker when the channel closes).
        let all = permits.acquire_many(this.concurrency.max(1) as u32);
        if tokio::time::timeout(STOP_WAIT * 6, all).await.is_err() {
            tracing::warn!(route = %route, "deliveries still being stored at stop; the broker gets them back");
        }
        this.pressure.set_paused(&route, None);
        source.close().await;
    }

    /// Pause the source at a limit, resume it once relieved. Returns the
    /// new state (why it is paused, or `None`).
    async fn apply_backpressure(
        &self,
        source: &mut dyn Source,
        paused: Option<Pressure>,
    ) -> Option<Pressure> {
        let route = self.route.name();
        match paused {
            None => {
                let why = self.pressure.reason(&self.engine)?;
                tracing::warn!(route, reason = %why, pending = self.engine.pending(), "backpressure: pausing consumption; messages wait in the broker");
                if let Err(e) = source.pause().await {
                    tracing::warn!(route, error = %e, "cannot pause the source");
                }
                self.pressure.set_paused(route, Some(why));
                Some(why)
            }
            Some(why) => {
                if !self.pressure.relieved(&self.engine, why) {
                    return Some(why);
                }
                tracing::info!(route, reason = %why, pending = self.engine.pending(), "backpressure relieved: resuming consumption");
                if let Err(e) = source.resume().await {
                    tracing::warn!(route, error = %e, "cannot resume the source");
                    return Some(why);
                }
                self.pressure.set_paused(route, None);
                None
            }
        }
    }

    fn is_cancel(&self, delivery: &Delivery) -> bool {
        self.route.config.cancel_on_tombstone
            && delivery.message.null_value
            && delivery.message.key.is_some()
    }

    /// A tombstone: cancel the pending messages with its key, then ack it.
    async fn cancel_by_tombstone(&self, delivery: Delivery) {
        let route = self.route.name();
        let key = delivery.message.key.clone().unwrap_or_default();
        match self.engine.cancel_by_key(route, &key).await {
            // Every match being published already: too late, as with DELETE.
            Ok(_) | Err(EngineError::InFlight(_)) => {
                tracing::debug!(route, "tombstone");
                if let Err(e) = delivery.ack.ack().await {
                    tracing::warn!(route, error = %e, "ack of tombstone failed");
                }
            }
            Err(e) => {
                tracing::error!(route, error = %e, "cannot cancel by tombstone; it will be read again");
                tokio::time::sleep(Duration::from_millis(500)).await;
                let _ = delivery.ack.requeue().await;
            }
        }
    }

    /// Work out the due time and queue the WAL record, in consumption order.
    fn start(&self, delivery: Delivery) -> Started {
        let route = self.route.name();
        let Delivery {
            mut message,
            redelivered,
            session,
            ack,
        } = delivery;
        let now = self.engine.now_ms();
        // A copy another instance handed back keeps its due time, whatever
        // the route's mode says, and its identity (see `route::handoff`).
        let (plan, handed_uid) = match handoff::receive(&mut message) {
            Some(h) => (Ok(Plan::Due(h.due_ms)), h.uid),
            None => (self.route.plan(&mut message, now), None),
        };
        match plan {
            Ok(Plan::Park) => Started::Park(Box::new(Aside { message, ack })),
            Ok(Plan::Due(due)) => {
                let encoded: Arc<[u8]> = delayd_adapters::encode(&message).into();
                let (uid, ticket) = match handed_uid {
                    Some(uid) => (uid, None),
                    None => self.identify(&message, &encoded, redelivered, session),
                };
                let held = Box::new(Held {
                    message,
                    encoded,
                    due,
                    uid,
                    arrival: Arrival {
                        redelivered,
                        session,
                    },
                    ack,
                    ticket,
                });
                // At a limit the delivery waits, unacked; the intake loop
                // pauses the source before taking more.
                Started::Store(self.admit(held))
            }
            Err(reason) => {
                tracing::warn!(route, %reason, "invalid delay; sending to the invalid destination");
                rewrite::with_error(&mut message, &reason.to_string());
                Started::Invalid(Box::new(Aside { message, ack }))
            }
        }
    }

    /// A new delivery's identity: a Kafka record's or a stream message's
    /// follows from where it was read; an AMQP delivery's is minted, unless it is a redelivery of
    /// one still in hand (see `super::in_hand`).
    fn identify(
        &self,
        message: &delayd_adapters::Message,
        encoded: &Arc<[u8]>,
        redelivered: bool,
        session: u64,
    ) -> (MessageId, Option<Ticket>) {
        if let Some(uid) = kafka_identity(message) {
            return (uid, None);
        }
        let queue = self.route.config.from.queue.as_deref().unwrap_or_default();
        if let Some(uid) = stream_identity(message, queue, encoded) {
            return (uid, None);
        }
        let (uid, ticket) =
            self.in_hand
                .take_in(encoded.clone(), redelivered, session, MessageId::mint);
        (uid, Some(ticket))
    }

    /// Queue the WAL record of a held delivery.
    fn store(&self, held: Box<Held>, admission: Admission) -> Attempt {
        let encoded = held.encoded.to_vec();
        let stored = match &self.store {
            Some(store) => store.store(&held.message, held.due, held.uid, encoded, held.arrival),
            None => Box::pin(self.engine.store(
                self.route.name(),
                held.due,
                held.uid,
                encoded,
                held.arrival,
            )),
        };
        Attempt::Storing {
            held,
            stored,
            admission,
        }
    }

    /// Wait for the record to be durable, then ack (or park). A delivery
    /// that cannot be stored yet (a limit, a full disk, a passing error) is
    /// held and stored again later; only shutdown or a fatal WAL error hands
    /// it back to the broker.
    async fn finish(&self, started: Started, stop: &CancellationToken) {
        let route = self.route.name();
        let mut attempt = match started {
            Started::Store(attempt) => attempt,
            // Boxed, as rare: their futures hold a whole message, and this
            // one is kept for every delivery in hand (up to the prefetch).
            Started::Invalid(aside) => {
                let Aside { message, ack } = *aside;
                return Box::pin(self.reject(message, ack, stop)).await;
            }
            Started::Park(aside) => {
                tracing::info!(route, "out of retry attempts; parking the message");
                let Aside { message, ack } = *aside;
                return Box::pin(self.send_aside(message, ack, &self.route.park, "parked", stop))
                    .await;
            }
        };
        loop {
            let (held, stored, admission) = match attempt {
                Attempt::Storing {
                    held,
                    stored,
                    admission,
                } => (held, stored, admission),
                Attempt::Refused { why, held } => {
                    tracing::debug!(route, reason = %why, "at a backpressure limit; holding the delivery until there is room");
                    metrics::counter!("delayd_backpressure_held_total", "route" => route.to_owned())
                        .increment(1);
                    let Some(held) = self.hold(held, RECHECK, stop).await else {
                        return;
                    };
                    let Some(held) = self.unless_superseded(held).await else {
                        return;
                    };
                    attempt = self.admit(held);
                    continue;
                }
            };
            let result = stored.await;
            drop(admission);
            let wait = match result {
                Ok(stored) => return self.stored(stored, held).await,
                Err(EngineError::Wal(WalError::TooLarge { size, max })) => {
                    let reason =
                        format!("message of {size} bytes exceeds wal.max_message_bytes ({max})");
                    tracing::warn!(route, %reason, "sending to the invalid destination");
                    let mut message = held.message;
                    rewrite::with_error(&mut message, &reason);
                    return Box::pin(self.reject(message, held.ack, stop)).await;
                }
                Err(EngineError::Wal(e)) if e.is_fatal() => {
                    tracing::error!(route, error = %e, "WAL failed; stopping");
                    let _ = held.ack.requeue().await;
                    self.fatal.cancel();
                    return;
                }
                Err(EngineError::Wal(WalError::DiskFull(dir))) => {
                    // Said once for all by `disk_full`: one line per held
                    // delivery per probe was thousands a minute.
                    tracing::debug!(route, dir = %dir.display(), "disk full: holding the delivery until there is space");
                    metrics::counter!("delayd_store_failures_total", "route" => route.to_owned())
                        .increment(1);
                    self.pressure.disk_full();
                    super::backpressure::DISK_PROBE
                }
                Err(e) => {
                    if let Some(left_out) =
                        self.bursts.store_failures.admit(std::time::Instant::now())
                    {
                        tracing::error!(route, error = %e, repeats_left_out = left_out, "cannot store message; holding it to try again (repeats within 10 s are counted, not logged)");
                    }
                    metrics::counter!("delayd_store_failures_total", "route" => route.to_owned())
                        .increment(1);
                    STORE_RETRY
                }
            };
            let Some(held) = self.hold(held, wait, stop).await else {
                return;
            };
            let Some(held) = self.unless_superseded(held).await else {
                return;
            };
            attempt = self.admit(held);
        }
    }

    /// A held delivery is to be stored again, unless a redelivery of it
    /// took over meanwhile (its channel closed): then it is given back
    /// (a no-op on a closed channel) and `None` is returned.
    async fn unless_superseded(&self, held: Box<Held>) -> Option<Box<Held>> {
        if !held.ticket.as_ref().is_some_and(Ticket::superseded) {
            return Some(held);
        }
        tracing::info!(route = %self.route.name(), uid = %held.uid, "a redelivery of a held delivery took over; not storing the held copy again");
        metrics::counter!("delayd_redeliveries_superseding_total", "route" => self.route.name().to_owned())
            .increment(1);
        let _ = held.ack.requeue().await;
        None
    }

    /// Store a held delivery if a limit lets it in now.
    fn admit(&self, held: Box<Held>) -> Attempt {
        match self.engine.admit() {
            Ok(admission) => self.store(held, admission),
            Err(why) => Attempt::Refused { why, held },
        }
    }

    /// Keep `held` for `wait`. At shutdown it goes back to the broker (the
    /// channel would return it anyway) and `None` is returned.
    async fn hold(
        &self,
        held: Box<Held>,
        wait: Duration,
        stop: &CancellationToken,
    ) -> Option<Box<Held>> {
        tokio::select! {
            _ = tokio::time::sleep(wait) => Some(held),
            _ = stop.cancelled() => {
                if let Err(e) = held.ack.requeue().await {
                    tracing::debug!(route = %self.route.name(), error = %e, "returning a held delivery at shutdown");
                }
                None
            }
        }
    }

    /// The record is durable: ack the delivery.
    async fn stored(&self, stored: Stored, held: Box<Held>) {
        let route = self.route.name();
        self.pressure.stored();
        match stored {
            Stored::New(id) => {
                metrics::counter!("delayd_scheduled_total", "route" => route.to_owned())
                    .increment(1);
                tracing::debug!(route, id, uid = %held.uid, due = held.due, "scheduled");
            }
            Stored::Copy { id, uid } => {
                metrics::counter!("delayd_scheduled_total", "route" => route.to_owned())
                    .increment(1);
                tracing::debug!(route, id, %uid, due = held.due, "scheduled under a stored message's id (its ack was in doubt)");
            }
            Stored::Duplicate => tracing::debug!(route, "a redelivery of a stored message"),
        }
        let id = stored.id();
        if let Some(id) = id {
            // From here a byte-equal redelivery may be this one's twin.
            self.engine.ack_sending(id);
        }
        match held.ack.ack().await {
            Ok(()) => {
                if let Some(id) = id {
                    self.engine.confirm_ack(id);
                }
            }
            // Stored, but the broker will redeliver it: dedup catches that.
            Err(SourceError::Connection(e)) => {
                if let Some(id) = id {
                    self.engine.ack_not_sent(id);
                }
                if let Some(left_out) = self.bursts.unsent_acks.admit(std::time::Instant::now()) {
                    tracing::warn!(route, error = %e, repeats_left_out = left_out, "ack not sent after store; the broker will redeliver the message (repeats within 10 s are counted, not logged)");
                }
            }
            // Perhaps applied, perhaps not: a redelivery is stored again
            // under this one's id (see `engine::dedup`).
            Err(e) => tracing::warn!(route, error = %e, "ack failed after store"),
        }
    }

    /// Publish to the invalid destination; ack only once that is confirmed.
    async fn reject(
        &self,
        message: delayd_adapters::Message,
        ack: Box<dyn AckHandle>,
        stop: &CancellationToken,
    ) {
        self.send_aside(message, ack, &self.route.invalid, "invalid", stop)
            .await
    }

    /// Publish to an invalid or park destination (`kind` names it in logs
    /// and the `delayd_{kind}_total` metric); ack only once that is
    /// confirmed. Until then the delivery is held and published again (no
    /// requeue: see [`Held`]).
    async fn send_aside(
        &self,
        message: delayd_adapters::Message,
        ack: Box<dyn AckHandle>,
        dest: &Destination,
        kind: &'static str,
        stop: &CancellationToken,
    ) {
        loop {
            match park(&self.brokers, dest, &message, &self.route, kind).await {
                Outcome::Done => {
                    if let Err(e) = ack.ack().await {
                        tracing::warn!(route = %self.route.name(), error = %e, kind, "ack of message sent aside failed");
                    }
                    return;
                }
                Outcome::Retry(reason)
                | Outcome::Unavailable(reason)
                | Outcome::Release(reason) => {
                    tracing::error!(route = %self.route.name(), %reason, kind, "cannot publish the message aside; holding it to try again");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(STORE_RETRY) => {}
                _ = stop.cancelled() => {
                    let _ = ack.requeue().await;
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Instant;

    use delayd_adapters::{Consuming, FieldTable, Message, Value};
    use tokio::sync::mpsc;

    use super::*;
    use crate::config::Config;
    use crate::engine::{EngineConfig, SystemClock};
    use crate::wal::WalConfig;

    /// What happened to each delivery, by name.
    type Settled = Arc<Mutex<Vec<(&'static str, &'static str)>>>;

    struct Ack {
        name: &'static str,
        settled: Settled,
    }

    impl Ack {
        fn settle(self, how: &'static str) -> BoxFuture<'static, Result<(), SourceError>> {
            self.settled.lock().unwrap().push((self.name, how));
            Box::pin(async { Ok(()) })
        }
    }

    impl AckHandle for Ack {
        fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), SourceError>> {
            self.settle("ack")
        }
        fn requeue(self: Box<Self>) -> BoxFuture<'static, Result<(), SourceError>> {
            self.settle("requeue")
        }
    }

    /// Deliveries the test hands in, whatever pause says (a broker's
    /// prefetched deliveries keep coming too).
    struct Feed(mpsc::UnboundedReceiver<Delivery>);

    impl Source for Feed {
        fn next(&mut self) -> BoxFuture<'_, Result<Delivery, SourceError>> {
            Box::pin(async { self.0.recv().await.ok_or(SourceError::Closed) })
        }
        fn pause(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
            Box::pin(async { Ok(()) })
        }
        fn resume(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
            Box::pin(async { Ok(()) })
        }
        fn consuming(&self) -> Consuming {
            Consuming::default()
        }
    }

    async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// An intake on route "r" (x-delay) of a broker never connected to.
    fn intake(engine: &Engine, in_hand: Arc<InHand>) -> Intake {
        let config = Config::from_toml_str(
            r#"
[brokers.rabbit]
kind = "amqp"
url = "amqp://guest:guest@127.0.0.1:5672/%2f"
[[routes]]
name = "r"
from = { broker = "rabbit", queue = "q" }
to = { broker = "rabbit", exchange = "out" }
"#,
        )
        .unwrap();
        Intake {
            route: Arc::new(Route::compile(&config.routes[0], &config)),
            engine: engine.clone(),
            brokers: Brokers::default(),
            concurrency: 8,
            fatal: CancellationToken::new(),
            pressure: Arc::default(),
            bytes: Arc::new(Semaphore::new(1 << 20)),
            byte_budget: 1 << 20,
            store: None,
            in_hand,
            bursts: Arc::default(),
        }
    }

    /// A delivery's `finish` future, and the engine's store future, are
    /// allocated for every delivery in hand (up to the prefetch, per
    /// route). They were 4,608 and 1,152 bytes: the delivery held in
    /// several states, the rare paths' futures inline, the write's future
    /// held twice. A kilobyte each is the bound kept.
    #[tokio::test]
    async fn a_deliverys_futures_stay_under_a_kilobyte() {
        let dir = tempfile::tempdir().unwrap();
        let (engine, _) = Engine::open(
            EngineConfig::new(WalConfig::new(dir.path())),
            Arc::new(SystemClock),
        )
        .unwrap();
        let intake = intake(&engine, Arc::default());
        let mut message = Message::with_body(b"x".to_vec());
        message.headers = FieldTable(vec![("x-delay".into(), Value::I64(600_000))]);
        let settled = Settled::default();
        let started = intake.start(Delivery {
            message,
            redelivered: false,
            session: 1,
            ack: Box::new(Ack {
                name: "a",
                settled: settled.clone(),
            }),
        });
        let stop = CancellationToken::new();
        let finish = intake.finish(started, &stop);
        let size = std::mem::size_of_val(&finish);
        assert!(size <= 1024, "the finish future is {size} bytes");
        // The engine's store future, boxed per delivery too (`Intake::store`).
        let store = engine.store("r", 1, MessageId::mint(), vec![1], false);
        let size = std::mem::size_of_val(&store);
        assert!(size <= 1024, "the store future is {size} bytes");
        drop(store);
        finish.await;
        assert_eq!(*settled.lock().unwrap(), [("a", "ack")]);
    }

    /// A delivery held unacked (here at `max_pending`; a failed store holds
    /// it the same way) whose channel closes: the broker redelivers it, and
    /// the redelivery must keep the held copy's identity while the held copy
    /// is not stored again. (The held copy was stored again under its
    /// identity and the redelivery under a new one: one message, two
    /// `x-delayd-id`s, as the cluster campaign's node kills made happen.)
    #[tokio::test]
    async fn a_redelivery_of_a_held_delivery_takes_its_identity_and_is_stored_once() {
        let dir = tempfile::tempdir().unwrap();
        let engine_config = EngineConfig {
            max_pending: 2,
            ..EngineConfig::new(WalConfig::new(dir.path()))
        };
        let (engine, _) = Engine::open(engine_config, Arc::new(SystemClock)).unwrap();
        // Two messages already pending: the next delivery is held.
        let far = engine.now_ms() + 3_600_000;
        let mut fillers = Vec::new();
        for body in [b"filler 1".to_vec(), b"filler 2".to_vec()] {
            fillers.push(engine.schedule("other", far, body).await.unwrap());
        }
        let in_hand = Arc::new(InHand::default());
        let intake = intake(&engine, in_hand.clone());
        let (feed, deliveries) = mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        let running = tokio::spawn(intake.run(Box::new(Feed(deliveries)), stop.clone()));

        let settled = Settled::default();
        let mut message = Message::with_body(b"close order 7".to_vec());
        message.headers = FieldTable(vec![("x-delay".into(), Value::I64(600_000))]);
        let deliver = |name, redelivered| Delivery {
            message: message.clone(),
            redelivered,
            // The redelivery comes on the next channel session.
            session: if redelivered { 2 } else { 1 },
            ack: Box::new(Ack {
                name,
                settled: settled.clone(),
            }),
        };
        feed.send(deliver("first", false)).unwrap();
        wait_until("the first copy held", || in_hand.len() == 1).await;
        // Its channel closed; the broker delivers the message again.
        feed.send(deliver("again", true)).unwrap();
        wait_until("the redelivery taken in", || in_hand.len() == 2).await;
        // Room for both, should both be stored.
        for id in fillers {
            assert!(engine.cancel(id).await.unwrap());
        }
        wait_until("both copies settled", || settled.lock().unwrap().len() == 2).await;
        let mut outcomes = settled.lock().unwrap().clone();
        outcomes.sort();
        assert_eq!(outcomes, [("again", "ack"), ("first", "requeue")]);
        let pending = engine.list(&Default::default());
        assert_eq!(pending.len(), 1, "stored twice: {pending:?}");
        stop.cancel();
        running.await.unwrap();
    }
}
