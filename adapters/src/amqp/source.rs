//! [`AmqpSource`]: consumes one RabbitMQ queue for one delayd route.
//!
//! A background task owns the channel and the lapin consumer and forwards each
//! delivery, converted to a [`Message`](crate::Message), to
//! [`Source::next`]. On start and after every reconnect it declares the
//! route's topology (durable queue, optional exchange bound to it), sets the
//! prefetch (`basic.qos`) and starts a manual-ack consumer.
//!
//! When the connection or channel dies the task reopens a channel (the shared
//! consume connection reconnects with back-off) and consumes again; `next`
//! just waits meanwhile. Deliveries handed out from the dead channel can no
//! longer be settled: their [`AckHandle`] returns
//! [`SourceError::Connection`], and RabbitMQ redelivers those messages (with
//! `redelivered = true`) on the new channel. An ack succeeds only once
//! RabbitMQ is known to have processed it (a round trip on the channel
//! follows it), so a message whose ack was lost in a dying connection is
//! never reported as acked.
//!
//! A stream queue ([`SourceConfig::stream`]) is read from an offset: see
//! [`super::stream`] for its identity, checkpoint and acks.
//!
//! [`Source::pause`] cancels the consumer (`basic.cancel`): new messages stay
//! in the broker, deliveries already received are still returned by `next`
//! and may be acked. [`Source::resume`] consumes again. Both answer at once
//! even while the broker is unreachable; the task applies the state when it
//! reconnects.
//!
//! `next` is cancel-safe: it only receives from a queue, so it can sit in a
//! `select!` with a shutdown signal. [`Source::close`] closes the channel
//! and waits for it; dropping the source stops the task, which closes the
//! channel too. Either way unacked deliveries go back to the queue.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_lite::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::FieldTable;
use lapin::{Acker, Channel, Consumer};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{debug, error, info, warn};

use super::connection::{AmqpError, Backoff, Broker};
use super::convert::{message_from_delivery, short_string};
use super::stream::{self, StreamAck, StreamConfig, StreamPosition};
use super::topology::{ensure_bound_queue, ExchangeType};
use crate::traits::{AckHandle, BoxFuture, Consuming, Delivery, Source, SourceError};

/// What an [`AmqpSource`] consumes and how.
#[derive(Debug, Clone)]
pub struct SourceConfig {
    /// Queue to consume. Declared durable (no arguments) if it does not
    /// exist; an existing queue with other arguments is used as it is.
    pub queue: String,
    /// Exchange producers publish to (`from.exchange`). When set, delayd
    /// declares it (durable, of [`exchange_type`](Self::exchange_type)) and
    /// binds it to [`queue`](Self::queue). When `None` producers publish to
    /// the queue directly or through their own bindings.
    pub exchange: Option<String>,
    /// Type of [`exchange`](Self::exchange). Default `topic`.
    pub exchange_type: ExchangeType,
    /// Binding keys of the exchange-to-queue binding. Empty means the default
    /// of the exchange type: `#` (every routing key on a topic exchange), or
    /// `""` for fanout. A direct exchange needs explicit keys: `#` there only
    /// matches the routing key `#`.
    pub binding_keys: Vec<String>,
    /// Unacknowledged deliveries the broker may have in flight to delayd
    /// (`basic.qos` prefetch count, per consumer). 0 means unlimited, which
    /// defeats backpressure; default 1000.
    pub prefetch: u16,
    /// Consumer tags are this prefix, a dot and a counter (visible in the
    /// management UI). Default `delayd`.
    pub consumer_tag_prefix: String,
    /// Arguments of the queue's declaration (`x-queue-type = "quorum"`,
    /// `x-delivery-limit`, ...). Empty: a classic queue, or whatever the
    /// vhost's default queue type is.
    pub queue_arguments: crate::FieldTable,
    /// The queue is a stream (declare it with `x-queue-type = "stream"` in
    /// [`queue_arguments`](Self::queue_arguments)): read it from the offset
    /// this checkpoint keeps.
    pub stream: Option<StreamConfig>,
}

impl SourceConfig {
    /// Consume `queue` with defaults: no exchange, prefetch 1000, tag prefix `delayd`.
    pub fn new(queue: impl Into<String>) -> Self {
        Self {
            queue: queue.into(),
            exchange: None,
            exchange_type: ExchangeType::default(),
            binding_keys: Vec::new(),
            prefetch: 1000,
            consumer_tag_prefix: "delayd".to_owned(),
            queue_arguments: crate::FieldTable::default(),
            stream: None,
        }
    }

    /// Also declare `exchange` of type `kind` and bind it to the queue.
    pub fn with_exchange(mut self, exchange: impl Into<String>, kind: ExchangeType) -> Self {
        self.exchange = Some(exchange.into());
        self.exchange_type = kind;
        self
    }

    fn effective_binding_keys(&self) -> Vec<String> {
        if self.binding_keys.is_empty() {
            vec![self.exchange_type.default_binding_key().to_owned()]
        } else {
            self.binding_keys.clone()
        }
    }
}

enum Command {
    Pause(oneshot::Sender<()>),
    Resume(oneshot::Sender<()>),
}

/// A [`Source`] reading one RabbitMQ queue. See the module docs.
pub struct AmqpSource {
    queue: String,
    consuming: Consuming,
    deliveries: mpsc::UnboundedReceiver<Delivery>,
    commands: mpsc::UnboundedSender<Command>,
    /// `None` once [`Source::close`] has taken it.
    task: Option<JoinHandle<()>>,
}

/// How long [`Source::close`] waits for the channel's close-ok.
const CLOSE_WAIT: Duration = Duration::from_secs(1);

/// How long a pause waits for `basic.cancel` and the consumer's end.
const CANCEL_WAIT: Duration = Duration::from_secs(5);

impl std::fmt::Debug for AmqpSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpSource")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

impl AmqpSource {
    /// Starts consuming in the background on `broker` (normally
    /// [`BrokerConnections::consume`](super::BrokerConnections)). Must be
    /// called inside a tokio runtime. Returns at once; connection problems are
    /// retried in the background and logged.
    pub fn start(broker: Arc<Broker>, config: SourceConfig) -> Result<Self, AmqpError> {
        // Refuse names AMQP cannot carry now rather than retrying forever.
        short_string(&config.queue, "queue name")?;
        if let Some(exchange) = &config.exchange {
            short_string(exchange, "exchange name")?;
        }
        for key in &config.binding_keys {
            short_string(key, "binding key")?;
        }
        short_string(
            &format!("{}.{}", config.consumer_tag_prefix, u64::MAX),
            "consumer tag",
        )?;
        if config.exchange.is_some()
            && config.exchange_type == ExchangeType::Direct
            && config.binding_keys.is_empty()
        {
            warn!(queue = %config.queue,
                  "direct source exchange bound with key \"#\": only messages published with routing key \"#\" will reach delayd");
        }

        let (deliveries_tx, deliveries) = mpsc::unbounded_channel();
        let (commands, commands_rx) = mpsc::unbounded_channel();
        let queue = config.queue.clone();
        let consuming = Consuming::default();
        let stream = match &config.stream {
            Some(stream_config) => {
                let (position, rewinds) = StreamPosition::start(&config.queue, stream_config)?;
                Some(StreamIntake {
                    position,
                    rewinds,
                    floor: 0,
                    expect: None,
                    rewound: Default::default(),
                })
            }
            None => None,
        };
        let worker = Worker {
            consuming: consuming.clone(),
            broker,
            config,
            deliveries: deliveries_tx,
            commands: commands_rx,
            paused: false,
            backoff: Backoff::default(),
            consumers_started: 0,
            sessions: 0,
            acks: Arc::default(),
            stream,
        };
        let task = tokio::spawn(worker.run());
        Ok(Self {
            queue,
            consuming,
            deliveries,
            commands,
            task: Some(task),
        })
    }

    /// The queue this source consumes.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    async fn command(&self, make: fn(oneshot::Sender<()>) -> Command) -> Result<(), SourceError> {
        let (reply, done) = oneshot::channel();
        self.commands
            .send(make(reply))
            .map_err(|_| SourceError::Closed)?;
        done.await.map_err(|_| SourceError::Closed)
    }
}

impl Drop for AmqpSource {
    fn drop(&mut self) {
        // Dropping the task's channel closes it: unacked messages are requeued.
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Source for AmqpSource {
    fn next(&mut self) -> BoxFuture<'_, Result<Delivery, SourceError>> {
        Box::pin(async move { self.deliveries.recv().await.ok_or(SourceError::Closed) })
    }

    fn pause(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
        Box::pin(self.command(Command::Pause))
    }

    fn resume(&mut self) -> BoxFuture<'_, Result<(), SourceError>> {
        Box::pin(self.command(Command::Resume))
    }

    fn consuming(&self) -> Consuming {
        self.consuming.clone()
    }

    /// Closes the channel and waits (at most [`CLOSE_WAIT`]) until the task
    /// has, so a connection closed next does not race the channel's close
    /// (lapin then logs a spurious "Connection error: invalid channel").
    fn close(mut self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            self.deliveries.close();
            if let Some(task) = self.task.take() {
                let abort = task.abort_handle();
                if tokio::time::timeout(CLOSE_WAIT, task).await.is_err() {
                    abort.abort();
                }
            }
        })
    }
}

/// Settles one delivery on the channel it came from.
struct AmqpAck {
    acker: Acker,
    tag: u64,
    acks: Arc<Mutex<AckCoalescer>>,
}

type AckWaiter = oneshot::Sender<Result<(), SourceError>>;

/// Turns many single acks into few `basic.ack multiple=true`.
///
/// Delivery tags on a channel count up from 1. A delivery settled out of
/// order waits here until every earlier one is settled too; then one
/// `multiple` ack covers the whole contiguous run, and each waiting `ack()`
/// completes. A requeued delivery is nacked at once on its own and counts as
/// settled, so it never holds the run back. One coalescer per channel session.
#[derive(Default)]
struct AckCoalescer {
    /// Every tag up to this one is settled.
    frontier: u64,
    /// Settled tags beyond the frontier: the acker (None if nacked) and who waits.
    settled: BTreeMap<u64, (Option<Acker>, Option<AckWaiter>)>,
    /// Acker of the highest acked tag behind the frontier, not yet sent.
    ready: Option<Acker>,
    /// Waiters covered by `ready`.
    waiting: Vec<AckWaiter>,
    /// A task is about to send `ready`: others just wait for it.
    flushing: bool,
    /// The session's channel closed (see [`AckCoalescer::end`]).
    ended: bool,
    /// The session's channel and prefetch, for the round trip that proves
    /// an ack was processed (see [`flush_acks`]).
    session: Option<(Channel, u16)>,
}

impl AckCoalescer {
    /// Record a settled tag and move the frontier. Returns true when the
    /// caller must flush (nobody else is about to).
    fn settle(&mut self, tag: u64, acker: Option<Acker>, waiter: Option<AckWaiter>) -> bool {
        if self.ended {
            // Dropped unanswered: the caller hears "not sent".
            return false;
        }
        self.settled.insert(tag, (acker, waiter));
        while let Some((acker, waiter)) = self.settled.remove(&(self.frontier + 1)) {
            self.frontier += 1;
            if acker.is_some() {
                self.ready = acker;
            }
            self.waiting.extend(waiter);
        }
        let must_flush = !self.flushing && (self.ready.is_some() || !self.waiting.is_empty());
        self.flushing |= must_flush;
        must_flush
    }

    /// The session's channel is gone: nothing more can be sent on it. The
    /// settled tags waiting for an earlier one are let go (their waiters
    /// hear "not sent"), and so is every later settle.
    fn end(&mut self) {
        self.ended = true;
        self.settled.clear();
    }

    /// What the flusher sends next; when nothing is left it stops being the
    /// flusher (under the same lock, so no settle is left without one).
    fn take(&mut self) -> Option<Flush> {
        if self.ready.is_none() && self.waiting.is_empty() {
            self.flushing = false;
            return None;
        }
        Some(Flush {
            acker: self.ready.take(),
            waiters: std::mem::take(&mut self.waiting),
            session: self.session.clone(),
        })
    }
}

/// One `multiple` ack to send and who waits for it.
struct Flush {
    acker: Option<Acker>,
    waiters: Vec<AckWaiter>,
    session: Option<(Channel, u16)>,
}

/// How long the round trip after an ack may take before the ack counts as
/// not confirmed (the message is then still recognised if redelivered).
const ACK_CONFIRM_WAIT: Duration = Duration::from_secs(10);

/// Prove that the broker processed everything sent on `channel` so far:
/// RabbitMQ handles a channel's methods in order, so once a synchronous one
/// sent after an ack is answered, the ack was applied. `basic.qos` with the
/// session's own prefetch changes nothing.
async fn round_trip(channel: &Channel, prefetch: u16) -> Result<(), SourceError> {
    let qos = channel.basic_qos(prefetch, BasicQosOptions { global: false });
    match tokio::time::timeout(ACK_CONFIRM_WAIT, qos).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => Err(SourceError::AckInDoubt(format!(
            "basic.ack sent, but the channel failed before the broker confirmed processing it: {error}"
        ))),
        Err(_) => Err(SourceError::AckInDoubt(format!(
            "basic.ack sent, but the broker did not answer the round trip after it within {ACK_CONFIRM_WAIT:?}"
        ))),
    }
}

fn settle_result(result: Result<bool, lapin::Error>, what: &str) -> Result<(), SourceError> {
    match result {
        Ok(true) => Ok(()),
        // lapin refuses to send it: the channel the delivery came on is gone.
        Ok(false) => Err(SourceError::Connection(format!(
            "{what} not sent: the delivery's channel is closed; the broker will redeliver it"
        ))),
        // Perhaps written to the socket before it failed.
        Err(error) => Err(SourceError::AckInDoubt(format!("{what} failed: {error}"))),
    }
}

/// The single flusher of a channel: let the other deliveries settled in this
/// wake-up join, send one `multiple` ack for all of them, make a round trip
/// on the channel, tell the waiters, and repeat while more became ready.
/// Only one flusher at a time, so `multiple` acks go out in increasing tag
/// order (an older one sent after a newer one would name an unknown tag and
/// close the channel).
///
/// Why the round trip: lapin reports an ack as sent once it is queued for
/// the socket. If the connection dies before RabbitMQ reads it, RabbitMQ
/// redelivers the message, and had delayd forgotten it as acked, it would
/// store and send it a second time under a new id. Waiters therefore hear
/// success only once RabbitMQ answered a method sent after the ack.
async fn flush_acks(acks: &Mutex<AckCoalescer>) {
    tokio::task::yield_now().await;
    loop {
        let next = acks.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(Flush {
            acker,
            waiters,
            session,
        }) = next
        else {
            return;
        };
        let result = match acker {
            Some(acker) => {
                match settle_result(
                    acker.ack(BasicAckOptions { multiple: true }).await,
                    "basic.ack",
                ) {
                    Ok(()) => match &session {
                        Some((channel, prefetch)) => round_trip(channel, *prefetch).await,
                        None => Ok(()),
                    },
                    Err(e) => Err(e),
                }
            }
            None => Ok(()),
        };
        for waiter in waiters {
            let _ = waiter.send(result.clone());
        }
    }
}

impl AckHandle for AmqpAck {
    /// Completes once a (possibly `multiple`) ack covering this delivery was
    /// sent and RabbitMQ answered a method sent after it on the channel.
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), SourceError>> {
        Box::pin(async move {
            let (waiter, done) = oneshot::channel();
            let must_flush = self.acks.lock().unwrap_or_else(|e| e.into_inner()).settle(
                self.tag,
                Some(self.acker),
                Some(waiter),
            );
            if must_flush {
                flush_acks(&self.acks).await;
            }
            // The sender is dropped unanswered only if the session ended first.
            done.await.unwrap_or_else(|_| {
                Err(SourceError::Connection(
                    "basic.ack not sent: the delivery's channel is closed; the broker will redeliver it".into(),
                ))
            })
        })
    }

    fn requeue(self: Box<Self>) -> BoxFuture<'static, Result<(), SourceError>> {
        Box::pin(async move {
            let options = BasicNackOptions {
                multiple: false,
                requeue: true,
            };
            let result = settle_result(self.acker.nack(options).await, "basic.nack");
            let must_flush = self
                .acks
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .settle(self.tag, None, None);
            if must_flush {
                flush_acks(&self.acks).await;
            }
            result
        })
    }
}

/// The background task behind an [`AmqpSource`].
struct Worker {
    consuming: Consuming,
    broker: Arc<Broker>,
    config: SourceConfig,
    deliveries: mpsc::UnboundedSender<Delivery>,
    commands: mpsc::UnboundedReceiver<Command>,
    paused: bool,
    /// Back-off between failed session set-ups (declaration refused, ...).
    backoff: Backoff,
    consumers_started: u64,
    /// Channel sessions set up so far: the current one's number.
    sessions: u64,
    /// Ack coalescing for the current channel session.
    acks: Arc<Mutex<AckCoalescer>>,
    /// A stream queue's offsets.
    stream: Option<StreamIntake>,
}

/// What a worker reading a stream keeps.
struct StreamIntake {
    position: Arc<StreamPosition>,
    /// Requeued deliveries (offset, epoch): read again from there.
    rewinds: stream::Rewinds,
    /// Deliveries below this offset are skipped: a consumer starts at the
    /// chunk holding its offset, which may begin earlier.
    floor: i64,
    /// The offset the current consumer asked for and has not yet seen:
    /// its first delivery beyond it means retention removed the gap.
    expect: Option<i64>,
    /// A session's end requeues its deliveries one by one: one line a burst.
    rewound: crate::log_burst::BurstLog,
}

/// Why a session ended.
enum End {
    /// The source was dropped: stop.
    Stop,
    /// The channel or consumer failed: set up a new session.
    Reconnect,
}

impl Worker {
    async fn run(mut self) {
        info!(queue = %self.config.queue, "AMQP source starting");
        let mut delay: Option<Duration> = None;
        loop {
            // Set up a session, answering pause/resume meanwhile.
            let (channel, consumer) = loop {
                let attempt = async {
                    if let Some(delay) = delay {
                        tokio::time::sleep(delay).await;
                    }
                    setup(
                        &self.broker,
                        &self.config,
                        self.paused,
                        &mut self.consumers_started,
                        &mut self.backoff,
                        &mut self.stream,
                    )
                    .await
                };
                tokio::select! {
                    biased;
                    () = self.deliveries.closed() => return,
                    command = self.commands.recv() => match command {
                        None => return,
                        Some(Command::Pause(reply)) => { self.paused = true; let _ = reply.send(()); }
                        Some(Command::Resume(reply)) => { self.paused = false; let _ = reply.send(()); }
                    },
                    session = attempt => break session,
                }
            };
            self.sessions += 1;
            // New channel, new delivery tags. Acks still waiting on the old
            // channel fail (the broker redelivers those messages).
            let old = std::mem::take(&mut self.acks);
            old.lock().unwrap_or_else(|e| e.into_inner()).end();
            // A stream's acks only return credit: nothing to prove applied.
            self.acks.lock().unwrap_or_else(|e| e.into_inner()).session = self
                .stream
                .is_none()
                .then(|| (channel.clone(), self.config.prefetch));
            self.consuming.set(true);
            let end = self.consume(channel, consumer).await;
            self.consuming.set(false);
            match end {
                End::Stop => {
                    if let Some(stream) = &self.stream {
                        let position = stream.position.clone();
                        let _ =
                            tokio::task::spawn_blocking(move || position.checkpoint_now()).await;
                    }
                    return;
                }
                End::Reconnect => {
                    let next = self.backoff.next_delay();
                    debug!(queue = %self.config.queue, delay = ?next, "re-establishing AMQP consumer");
                    delay = Some(next);
                }
            }
        }
    }

    fn forward(&mut self, mut delivery: lapin::message::Delivery) {
        let message = message_from_delivery(&mut delivery);
        if let Some(stream) = &mut self.stream {
            let Some(delivery) = stream.delivery(
                &self.config.queue,
                message,
                delivery,
                &self.acks,
                &self.consuming,
                &self.broker,
            ) else {
                return;
            };
            let _ = self.deliveries.send(delivery);
            return;
        }
        let delivery = Delivery {
            message,
            redelivered: delivery.redelivered,
            session: self.sessions,
            ack: Box::new(AmqpAck {
                acker: delivery.acker,
                tag: delivery.delivery_tag,
                acks: self.acks.clone(),
            }),
        };
        // If the source is gone the delivery is dropped unacked: the channel
        // closes with it and the broker requeues the message.
        let _ = self.deliveries.send(delivery);
    }

    /// Runs one session until the channel fails or the source is dropped.
    async fn consume(&mut self, channel: Channel, mut consumer: Option<Consumer>) -> End {
        let queue = self.config.queue.clone();
        loop {
            tokio::select! {
                biased;
                () = self.deliveries.closed() => {
                    close_channel(&channel).await;
                    return End::Stop;
                }
                command = self.commands.recv() => match command {
                    None => {
                        close_channel(&channel).await;
                        return End::Stop;
                    }
                    Some(Command::Pause(reply)) => {
                        self.paused = true;
                        // Bounded: on a connection that dies mid-cancel,
                        // the cancel-ok or the stream's end may never come,
                        // and the source would neither answer nor reconnect.
                        let healthy = match consumer.take() {
                            Some(c) => tokio::time::timeout(CANCEL_WAIT, self.cancel(&channel, c))
                                .await
                                .unwrap_or_else(|_| {
                                    warn!(queue = %queue, "basic.cancel not answered in time; reconnecting");
                                    false
                                }),
                            None => true,
                        };
                        info!(queue = %queue, "AMQP source paused");
                        let _ = reply.send(());
                        if !healthy {
                            return End::Reconnect;
                        }
                    }
                    Some(Command::Resume(reply)) => {
                        self.paused = false;
                        let _ = reply.send(());
                        info!(queue = %queue, "AMQP source resumed");
                        if consumer.is_none() {
                            match start_consumer(&channel, &self.config, &mut self.consumers_started, &mut self.stream).await {
                                Ok(c) => consumer = Some(c),
                                Err(error) => {
                                    warn!(queue = %queue, %error, "cannot resume consuming; reconnecting");
                                    return End::Reconnect;
                                }
                            }
                        }
                    }
                },
                rewind = next_rewind(&mut self.stream) => {
                    let (offset, epoch) = rewind;
                    if let Err(end) = self.rewind(&channel, &mut consumer, offset, epoch).await {
                        return end;
                    }
                }
                item = next_delivery(&mut consumer) => match item {
                    Some(Ok(delivery)) => self.forward(delivery),
                    Some(Err(error)) => {
                        warn!(queue = %queue, %error, "AMQP consumer failed; reconnecting");
                        return End::Reconnect;
                    }
                    None => {
                        warn!(queue = %queue, "AMQP consumer cancelled by the broker (queue deleted?); consuming again");
                        return End::Reconnect;
                    }
                },
            }
        }
    }

    /// A stream delivery was requeued: read the stream again from it. The
    /// deliveries after it that are in hand become stale (their acks fail,
    /// and their copies read again are recognised by their bytes).
    async fn rewind(
        &mut self,
        channel: &Channel,
        consumer: &mut Option<Consumer>,
        offset: i64,
        epoch: u64,
    ) -> Result<(), End> {
        if let Some(c) = consumer.take() {
            let healthy = tokio::time::timeout(CANCEL_WAIT, self.cancel(channel, c))
                .await
                .unwrap_or(false);
            if !healthy {
                warn!(queue = %self.config.queue, "basic.cancel not answered in time; reconnecting");
                if let Some(stream) = &self.stream {
                    stream.position.rewind(offset, epoch);
                }
                return Err(End::Reconnect);
            }
        }
        let Some(stream) = &self.stream else {
            return Ok(());
        };
        if stream.position.rewind(offset, epoch) {
            if let Some(left_out) = stream.rewound.admit(std::time::Instant::now()) {
                info!(queue = %self.config.queue, offset, repeats_left_out = left_out, "reading the stream again from a requeued delivery (repeats within 10 s are counted, not logged)");
            }
        }
        if !self.paused {
            match start_consumer(
                channel,
                &self.config,
                &mut self.consumers_started,
                &mut self.stream,
            )
            .await
            {
                Ok(c) => *consumer = Some(c),
                Err(error) => {
                    warn!(queue = %self.config.queue, %error, "cannot consume the stream again; reconnecting");
                    return Err(End::Reconnect);
                }
            }
        }
        Ok(())
    }

    /// `basic.cancel`, then hands out the deliveries that arrived before the
    /// cancel took effect. Returns whether the channel is still usable.
    async fn cancel(&mut self, channel: &Channel, mut consumer: Consumer) -> bool {
        if let Err(error) = channel
            .basic_cancel(consumer.tag(), BasicCancelOptions::default())
            .await
        {
            warn!(queue = %self.config.queue, %error, "basic.cancel failed");
            return false;
        }
        // The stream ends once lapin has processed the cancel.
        while let Some(item) = consumer.next().await {
            match item {
                Ok(delivery) => self.forward(delivery),
                Err(error) => {
                    warn!(queue = %self.config.queue, %error, "AMQP consumer failed while pausing");
                    return false;
                }
            }
        }
        true
    }
}

impl StreamIntake {
    /// A stream delivery for the core, or `None` when it is skipped (before
    /// the consumer's start offset).
    /// Every delivery's ack goes through the session's coalescer (`acks`):
    /// a `multiple` ack must never cover a tag already acked on its own.
    fn delivery(
        &mut self,
        queue: &str,
        mut message: crate::Message,
        delivery: lapin::message::Delivery,
        acks: &Arc<Mutex<AckCoalescer>>,
        consuming: &Consuming,
        broker: &Arc<Broker>,
    ) -> Option<Delivery> {
        let (acker, tag) = (delivery.acker, delivery.delivery_tag);
        let Some(offset) = stream::take_offset(&mut message) else {
            // Not from a stream after all (the queue was declared by
            // someone else as another type): no exact identity.
            warn!(queue, "a delivery without x-stream-offset on a stream ingress; storing it with a new identity");
            return Some(Delivery {
                message,
                redelivered: delivery.redelivered,
                session: 0,
                ack: Box::new(AmqpAck {
                    acker,
                    tag,
                    acks: acks.clone(),
                }),
            });
        };
        if offset < self.floor {
            tokio::spawn(credit(acker, tag, acks.clone()));
            return None;
        }
        if let Some(expected) = self.expect.take() {
            if offset > expected {
                // Offsets are not one per message (a segment's tracking
                // chunk takes one too): ask the stream where it starts.
                tokio::spawn(check_truncation(
                    broker.clone(),
                    queue.to_owned(),
                    expected,
                    consuming.clone(),
                ));
            }
        }
        let epoch = self.position.delivered(offset);
        Some(Delivery {
            message,
            // Like a Kafka record: read again after a crash, recognised by
            // its bytes, which hold its offset.
            redelivered: true,
            session: 0,
            ack: Box::new(StreamAck {
                credit: Box::pin(credit(acker, tag, acks.clone())),
                offset,
                epoch,
                position: self.position.clone(),
            }),
        })
    }

    /// The arguments of a consumer starting now, and the skip floor and
    /// truncation check that go with them.
    fn start(&mut self, queue: &str) -> FieldTable {
        let offset = self.position.start_offset();
        self.floor = offset.unwrap_or(0);
        self.expect = offset;
        match offset {
            Some(o) => info!(queue, offset = o, "reading the stream from its checkpoint"),
            None => info!(
                queue,
                "no checkpoint: reading the stream from its first retained message"
            ),
        }
        stream::consumer_arguments(offset)
    }
}

/// A consumer asked for `expected` and got a later offset first: if the
/// stream now starts past `expected`, retention removed what delayd had not
/// read. Loud, counted, and the route unready until restarted.
async fn check_truncation(broker: Arc<Broker>, queue: String, expected: i64, consuming: Consuming) {
    let first = match first_offset(&broker, &queue).await {
        Ok(first) => first,
        Err(e) => {
            warn!(queue, expected, error = %e, "cannot read where the stream starts; a truncation by retention cannot be ruled out");
            return;
        }
    };
    if first <= expected {
        return;
    }
    let lost = (first - expected) as u64;
    error!(queue, from = expected, to = first - 1, offsets = lost,
           "the stream's retention removed messages delayd had not read yet: they are lost; raise x-max-age / x-max-length-bytes (route not ready until restarted)");
    consuming.set_truncated(lost);
    metrics::counter!("delayd_stream_truncated_offsets_total", "queue" => queue).increment(lost);
}

/// The offset of the stream's first retained message: one delivery read
/// from "first" on a channel of its own.
async fn first_offset(broker: &Broker, queue: &str) -> Result<i64, AmqpError> {
    let channel = broker.try_channel().await?;
    let topology = |what: &str, source| AmqpError::Topology {
        what: format!("{what} on stream {queue:?}"),
        source,
    };
    channel
        .basic_qos(1, BasicQosOptions { global: false })
        .await
        .map_err(|e| topology("basic.qos", e))?;
    let mut consumer = channel
        .basic_consume(
            short_string(queue, "queue name")?,
            "delayd.first-offset".into(),
            BasicConsumeOptions::default(),
            stream::consumer_arguments(None),
        )
        .await
        .map_err(|e| topology("basic.consume", e))?;
    let first = tokio::time::timeout(CANCEL_WAIT, consumer.next()).await;
    close_channel(&channel).await;
    match first {
        Ok(Some(Ok(mut delivery))) => {
            let mut message = message_from_delivery(&mut delivery);
            stream::take_offset(&mut message).ok_or_else(|| {
                AmqpError::Stream(format!("{queue:?}: a delivery without x-stream-offset"))
            })
        }
        Ok(Some(Err(e))) => Err(topology("reading the first message", e)),
        Ok(None) | Err(_) => Err(AmqpError::Stream(format!(
            "{queue:?}: no first message within {CANCEL_WAIT:?}"
        ))),
    }
}

/// Settles a delivery that has no offset on a stream: credit only.
/// Give a stream delivery's credit back: its ack joins the session's
/// coalesced `multiple` acks (one frame for many deliveries, which costs a
/// consumer far less CPU than an ack each: docs/benchmarks.md).
async fn credit(acker: Acker, tag: u64, acks: Arc<Mutex<AckCoalescer>>) {
    let must_flush = acks
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .settle(tag, Some(acker), None);
    if must_flush {
        flush_acks(&acks).await;
    }
}

/// The next rewind request of a stream source, or never.
async fn next_rewind(stream: &mut Option<StreamIntake>) -> (i64, u64) {
    match stream {
        Some(s) => match s.rewinds.recv().await {
            Some(r) => r,
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

/// The next item of the consumer, or never when there is none (paused).
async fn next_delivery(
    consumer: &mut Option<Consumer>,
) -> Option<Result<lapin::message::Delivery, lapin::Error>> {
    match consumer {
        Some(consumer) => consumer.next().await,
        None => std::future::pending().await,
    }
}

async fn close_channel(channel: &Channel) {
    if channel.status().connected() {
        if let Err(error) = channel.close(200, "OK".into()).await {
            debug!(%error, "closing AMQP source channel");
        }
    }
}

/// Declares the topology, opens a channel, sets the prefetch and (unless
/// paused) starts the consumer; retries with back-off until it works.
async fn setup(
    broker: &Broker,
    config: &SourceConfig,
    paused: bool,
    consumers_started: &mut u64,
    backoff: &mut Backoff,
    stream: &mut Option<StreamIntake>,
) -> (Channel, Option<Consumer>) {
    loop {
        match try_setup(broker, config, paused, consumers_started, stream).await {
            Ok(session) => {
                info!(queue = %config.queue, paused, "AMQP source consuming");
                backoff.reset();
                return session;
            }
            Err(AmqpError::BackingOff { retry_in, .. }) => tokio::time::sleep(retry_in).await,
            Err(error) => {
                let delay = backoff.next_delay();
                if matches!(
                    error,
                    AmqpError::Connect { .. } | AmqpError::ConnectTimeout { .. }
                ) {
                    // The broker connection already logged this at warn.
                    debug!(queue = %config.queue, %error, retry_in = ?delay, "AMQP source waiting for the connection");
                } else {
                    warn!(queue = %config.queue, %error, retry_in = ?delay, "AMQP source set-up failed");
                }
                tokio::time::sleep(delay).await;
            }
        }
    }
}

async fn try_setup(
    broker: &Broker,
    config: &SourceConfig,
    paused: bool,
    consumers_started: &mut u64,
    stream: &mut Option<StreamIntake>,
) -> Result<(Channel, Option<Consumer>), AmqpError> {
    let keys = config.effective_binding_keys();
    let exchange = config
        .exchange
        .as_deref()
        .map(|e| (e, config.exchange_type, keys.as_slice()));
    ensure_bound_queue(broker, &config.queue, &config.queue_arguments, exchange).await?;
    let channel = broker.try_channel().await?;
    channel
        .basic_qos(config.prefetch, BasicQosOptions { global: false })
        .await
        .map_err(|source| AmqpError::Topology {
            what: format!("basic.qos prefetch {}", config.prefetch),
            source,
        })?;
    let consumer = if paused {
        None
    } else {
        Some(start_consumer(&channel, config, consumers_started, stream).await?)
    };
    Ok((channel, consumer))
}

async fn start_consumer(
    channel: &Channel,
    config: &SourceConfig,
    consumers_started: &mut u64,
    stream: &mut Option<StreamIntake>,
) -> Result<Consumer, AmqpError> {
    *consumers_started += 1;
    let arguments = match stream {
        Some(stream) => stream.start(&config.queue),
        None => FieldTable::default(),
    };
    let tag = format!("{}.{}", config.consumer_tag_prefix, consumers_started);
    let options = BasicConsumeOptions {
        no_ack: false,
        ..BasicConsumeOptions::default()
    };
    channel
        .basic_consume(
            short_string(&config.queue, "queue name")?,
            short_string(&tag, "consumer tag")?,
            options,
            arguments,
        )
        .await
        .map_err(|source| AmqpError::Topology {
            what: format!("basic.consume on queue {:?}", config.queue),
            source,
        })
}

#[cfg(test)]
mod coalescer_tests {
    use super::*;

    #[test]
    fn out_of_order_settles_release_waiters_only_when_contiguous() {
        let mut c = AckCoalescer::default();
        let (w3, _r3) = oneshot::channel();
        assert!(
            !c.settle(3, None, Some(w3)),
            "tag 3 released before 1 and 2"
        );
        let (w1, _r1) = oneshot::channel();
        assert!(c.settle(1, None, Some(w1)), "first settler flushes");
        assert_eq!(c.frontier, 1);
        assert!(!c.settle(2, None, None), "a flush is already due");
        assert_eq!(c.frontier, 3);
        let waiters = c.take().expect("work to flush").waiters;
        assert_eq!(waiters.len(), 2, "one flush covers tags 1 and 3");
        assert!(c.settled.is_empty());
        assert!(c.take().is_none());
        assert!(!c.flushing, "the flusher steps down when done");
    }

    /// A delivery of a session that has ended may still be settled (its
    /// store finished after the reconnect). Its ack can no longer be sent,
    /// and its `ack()` must say so, not wait for ever behind a tag the end
    /// let go: that task would hold its intake permit for good.
    #[test]
    fn a_settle_after_the_session_ended_is_answered_not_sent() {
        let mut c = AckCoalescer::default();
        let (w2, mut r2) = oneshot::channel();
        assert!(!c.settle(2, None, Some(w2)), "tag 1 is not settled yet");
        c.end();
        assert!(r2.try_recv().is_err(), "its waiter is let go: not sent");
        let (w1, mut r1) = oneshot::channel();
        let (w3, mut r3) = oneshot::channel();
        assert!(!c.settle(1, None, Some(w1)));
        assert!(!c.settle(3, None, Some(w3)));
        for r in [&mut r1, &mut r3] {
            assert!(
                matches!(r.try_recv(), Err(oneshot::error::TryRecvError::Closed)),
                "answered (dropped: not sent), not left waiting"
            );
        }
        assert!(c.take().is_none(), "nothing left to send on a dead channel");
    }
}
