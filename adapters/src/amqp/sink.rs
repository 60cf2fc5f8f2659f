//! [`AmqpSink`]: publishes delayd's due messages to RabbitMQ with publisher
//! confirms.
//!
//! Every publish is `mandatory`, so a message no queue takes comes back as
//! `basic.return`; the publish reports [`PublishOutcome::Unroutable`] once the
//! broker has confirmed it, [`PublishOutcome::Delivered`] when it was confirmed
//! and not returned, and [`SinkError::Transient`] on a `basic.nack`, a lost
//! channel or connection, or no confirm within
//! [`SinkConfig::confirm_timeout`]. A message AMQP cannot carry (a property or
//! header name over 255 bytes, a `u64` header above `i64::MAX`) is
//! [`SinkError::Permanent`].
//!
//! # Batches on a few channels, returns matched by content
//!
//! Confirms are cheap for the broker only when they are pipelined: many
//! publishes on one channel, acknowledged with `basic.ack multiple`. But
//! RabbitMQ does not say which publish a `basic.return` belongs to, and lapin
//! hands each return to one of the confirms of a coalesced ack, not
//! necessarily the returned message's own. So the sink works in batches: a
//! worker per channel takes up to [`SinkConfig::batch`] queued publishes,
//! sends them back to back, and waits for every confirm of the batch. A
//! return always precedes its message's ack, so once the batch is confirmed
//! every return for it has arrived, attached to some confirm of the batch.
//! Each returned message is then matched to its publish by content (exchange,
//! routing key, properties, body). A return that matches nothing exactly marks
//! every publish of the batch with the same exchange and routing key as
//! unroutable: a possible duplicate in the unroutable queue, never a loss.
//!
//! Channels are opened lazily on the shared publish connection. A channel
//! that fails is dropped and its batch reported [`SinkError::Transient`]; the
//! next batch opens a fresh one, reconnecting if needed.
//!
//! A publish to a missing exchange makes the broker close the channel. Once
//! one has, publishes to that exchange fail at once (with the broker's
//! `NOT_FOUND` error) for [`MISSING_EXCHANGE_RECHECK`], so thousands of due
//! messages for a missing exchange cost one channel a second, not one each.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use lapin::message::BasicReturnMessage;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::protocol::AMQPSoftError;
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation};
use tokio::sync::{oneshot, Notify};
use tracing::{debug, warn};

use super::connection::{AmqpError, Broker};
use super::convert::{message_properties, short_string, ConvertError};
use super::topology::{ensure_queue, is_soft_error};
use crate::message::Message;
use crate::traits::{BoxFuture, Fence, PublishOutcome, Sink, SinkError, Target, FENCED};

/// How an [`AmqpSink`] publishes.
#[derive(Debug, Clone)]
pub struct SinkConfig {
    /// Confirm-mode channels, each with one batch in flight. Default 4; at least 1.
    pub channels: usize,
    /// Most publishes sent back to back on a channel before waiting for
    /// their confirms. Default 256; at least 1.
    pub batch: usize,
    /// How long a batch waits for the broker's confirms before its
    /// publishes report [`SinkError::Transient`] (they may then arrive twice,
    /// which delayd's at-least-once contract allows). Default 30 s.
    pub confirm_timeout: Duration,
    /// When a batch's channel fails before its confirms, publish its
    /// messages again one by one on a new channel (those that had landed
    /// then arrive twice, as two broker messages). Default true. Off, they
    /// report [`SinkError::Transient`] and the caller decides: the bench
    /// turns it off so that it never sends one message twice unawares.
    pub republish_unconfirmed: bool,
}

impl Default for SinkConfig {
    fn default() -> Self {
        Self {
            channels: 4,
            batch: 256,
            confirm_timeout: Duration::from_secs(30),
            republish_unconfirmed: true,
        }
    }
}

type Reply = oneshot::Sender<Result<PublishOutcome, SinkError>>;

/// One queued publish.
struct Job {
    exchange: ShortString,
    routing_key: ShortString,
    properties: BasicProperties,
    body: Vec<u8>,
    reply: Reply,
    /// Sent only while it holds ([`Sink::publish_fenced`]).
    fence: Option<Fence>,
}

/// The jobs of `batch` whose fence still holds; the others are answered
/// [`FENCED`] (a retry for the caller) and never sent.
fn drop_fenced(batch: Vec<Job>) -> Vec<Job> {
    let mut kept = Vec::with_capacity(batch.len());
    for job in batch {
        match &job.fence {
            Some(fence) if !fence() => {
                let _ = job.reply.send(Err(SinkError::Transient(FENCED.to_owned())));
            }
            _ => kept.push(job),
        }
    }
    kept
}

/// Publishes waiting for one channel worker.
#[derive(Default)]
struct Queue {
    jobs: Mutex<VecDeque<Job>>,
    ready: Arc<Notify>,
}

/// What the sink and its workers share: a queue per worker, and the
/// exchanges recently reported missing.
struct Shared {
    queues: Vec<Queue>,
    missing: MissingExchanges,
}

impl Shared {
    /// The queue (and so the channel) of an exchange and routing key: the
    /// same key always goes through the same channel, so publishes with one
    /// routing key reach the broker in the order they were queued.
    fn queue_for(&self, exchange: &str, routing_key: &str) -> &Queue {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (exchange, routing_key).hash(&mut h);
        &self.queues[(h.finish() % self.queues.len() as u64) as usize]
    }
}

/// After the broker reports an exchange missing, publishes to it fail at
/// once for this long instead of each costing a channel (the broker closes
/// the channel of a publish to a missing exchange).
const MISSING_EXCHANGE_RECHECK: Duration = Duration::from_secs(1);

/// Exchanges the broker recently reported missing, with the error it gave.
#[derive(Default)]
struct MissingExchanges(Mutex<HashMap<ShortString, (Instant, String)>>);

impl MissingExchanges {
    /// The broker's error, if `exchange` was reported missing within
    /// [`MISSING_EXCHANGE_RECHECK`].
    fn check(&self, exchange: &ShortString) -> Option<String> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match map.get(exchange) {
            Some((at, why)) if at.elapsed() < MISSING_EXCHANGE_RECHECK => Some(why.clone()),
            Some(_) => {
                map.remove(exchange);
                None
            }
            None => None,
        }
    }

    fn is_empty(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }

    /// Remember `exchange` as missing if `why` (a single publish's failure)
    /// says so.
    fn note(&self, exchange: &ShortString, why: &str) {
        if is_missing_exchange(why) {
            let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
            if map.len() >= 64 {
                // Many names (per-message target overrides): forget the expired.
                map.retain(|_, (at, _)| at.elapsed() < MISSING_EXCHANGE_RECHECK);
            }
            map.insert(exchange.clone(), (Instant::now(), why.to_owned()));
        }
    }
}

/// RabbitMQ's reply text for a publish to a missing exchange.
fn is_missing_exchange(why: &str) -> bool {
    why.contains("NOT_FOUND - no exchange")
}

/// A [`Sink`] publishing to one RabbitMQ broker. Share it between tasks
/// (`&self` publishes run concurrently).
pub struct AmqpSink {
    broker: Arc<Broker>,
    config: SinkConfig,
    shared: Arc<Shared>,
    /// Workers are spawned on the first publish (inside the caller's runtime).
    workers: OnceLock<()>,
}

impl std::fmt::Debug for AmqpSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpSink")
            .field("broker", &self.broker)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn permanent(error: ConvertError) -> SinkError {
    SinkError::Permanent(error.to_string())
}

impl AmqpSink {
    /// A sink publishing on `broker` (normally
    /// [`BrokerConnections::publish`](super::BrokerConnections)). Connects
    /// lazily on the first publish.
    pub fn new(broker: Arc<Broker>, config: SinkConfig) -> Self {
        let config = SinkConfig {
            channels: config.channels.max(1),
            batch: config.batch.max(1),
            ..config
        };
        Self {
            broker,
            shared: Arc::new(Shared {
                queues: (0..config.channels).map(|_| Queue::default()).collect(),
                missing: MissingExchanges::default(),
            }),
            config,
            workers: OnceLock::new(),
        }
    }

    /// The broker this sink publishes to.
    pub fn broker(&self) -> &Arc<Broker> {
        &self.broker
    }

    /// Declares a durable queue (e.g. `delayd.invalid`, `delayd.unroutable`)
    /// on the publish connection. An existing queue with other arguments is
    /// accepted as it is.
    pub async fn declare_queue(&self, queue: &str) -> Result<(), AmqpError> {
        ensure_queue(&self.broker, queue, &crate::FieldTable::default()).await
    }

    /// Queues the publish before returning (calls made in order reach the
    /// broker in that order, per routing key), taking the message so its
    /// body is not copied; the future says what the broker did with it.
    pub fn enqueue_owned(
        &self,
        message: Message,
        target: &Target,
    ) -> BoxFuture<'static, Result<PublishOutcome, SinkError>> {
        self.enqueue_fenced(message, target, None)
    }

    /// [`AmqpSink::enqueue_owned`], sent only if `fence` holds once the
    /// worker has a channel for it.
    pub fn enqueue_fenced(
        &self,
        message: Message,
        target: &Target,
        fence: Option<Fence>,
    ) -> BoxFuture<'static, Result<PublishOutcome, SinkError>> {
        let job = match self.job(&message, target) {
            Ok(job) => job,
            Err(e) => return Box::pin(async move { Err(e) }),
        };
        let (reply, outcome) = oneshot::channel();
        self.start_workers();
        let queue = self.shared.queue_for(job.0.as_str(), job.1.as_str());
        {
            let mut jobs = queue.jobs.lock().unwrap_or_else(|e| e.into_inner());
            let (exchange, routing_key, properties) = job;
            jobs.push_back(Job {
                exchange,
                routing_key,
                properties,
                body: message.body,
                reply,
                fence,
            });
        }
        queue.ready.notify_one();
        Box::pin(async move {
            outcome
                .await
                .map_err(|_| SinkError::Transient("sink worker stopped".to_owned()))?
        })
    }

    /// Exchange, routing key and properties, or why AMQP cannot carry them.
    fn job(
        &self,
        message: &Message,
        target: &Target,
    ) -> Result<(ShortString, ShortString, BasicProperties), SinkError> {
        let exchange = short_string(&target.destination, "exchange name").map_err(permanent)?;
        let routing_key = target
            .routing_key
            .as_deref()
            .unwrap_or(&message.routing_key);
        let routing_key = short_string(routing_key, "routing key").map_err(permanent)?;
        let properties = message_properties(message).map_err(permanent)?;
        Ok((exchange, routing_key, properties))
    }

    fn start_workers(&self) {
        self.workers.get_or_init(|| {
            for (index, queue) in self.shared.queues.iter().enumerate() {
                let worker = Worker {
                    broker: self.broker.clone(),
                    shared: Arc::downgrade(&self.shared),
                    index,
                    ready: queue.ready.clone(),
                    config: self.config.clone(),
                    channel: None,
                };
                tokio::spawn(worker.run());
            }
        });
    }
}

impl Drop for AmqpSink {
    fn drop(&mut self) {
        // Wake the workers so they notice the queues are gone and stop.
        for queue in &self.shared.queues {
            queue.ready.notify_one();
        }
    }
}

/// Owns one confirm-mode channel and publishes the batches of its queue on it.
struct Worker {
    broker: Arc<Broker>,
    shared: std::sync::Weak<Shared>,
    /// Its queue in `shared.queues`.
    index: usize,
    ready: Arc<Notify>,
    config: SinkConfig,
    channel: Option<Channel>,
}

impl Worker {
    async fn run(mut self) {
        loop {
            let Some(batch) = self.next_batch().await else {
                return;
            };
            self.publish_batch(batch).await;
        }
    }

    /// Wait for queued publishes and take up to `batch` of them. `None` once
    /// the sink is dropped.
    async fn next_batch(&self) -> Option<Vec<Job>> {
        loop {
            let notified = self.ready.notified();
            let shared = self.shared.upgrade()?;
            {
                let queue = &shared.queues[self.index];
                let mut jobs = queue.jobs.lock().unwrap_or_else(|e| e.into_inner());
                if !jobs.is_empty() {
                    let n = jobs.len().min(self.config.batch);
                    return Some(jobs.drain(..n).collect());
                }
            }
            drop(shared);
            notified.await;
        }
    }

    async fn channel(&mut self) -> Result<Channel, SinkError> {
        if let Some(channel) = &self.channel {
            if channel.status().connected() {
                return Ok(channel.clone());
            }
        }
        self.channel = None;
        let channel = self
            .broker
            .try_channel()
            .await
            .map_err(|error| SinkError::Transient(error.to_string()))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|error| SinkError::Transient(format!("confirm.select failed: {error}")))?;
        debug!(endpoint = %self.broker.endpoint(), "publisher channel open");
        self.channel = Some(channel.clone());
        Ok(channel)
    }

    /// Publish a batch. If the channel fails under it (for example the broker
    /// closes it because one message's exchange does not exist), publish its
    /// messages again one by one, so only the culprit keeps failing.
    async fn publish_batch(&mut self, batch: Vec<Job>) {
        let Some(shared) = self.shared.upgrade() else {
            return fail(batch, "sink stopped");
        };
        let missing = &shared.missing;
        let batch = fail_known_missing(missing, batch);
        if batch.is_empty() {
            return;
        }
        match self.try_batch(batch).await {
            Ok(()) => {}
            Err((batch, failure)) if !self.config.republish_unconfirmed => {
                self.fail(batch, &failure.why)
            }
            Err((batch, _)) if batch.len() > 1 => {
                for job in batch {
                    if let Some(why) = missing.check(&job.exchange) {
                        let _ = job.reply.send(Err(SinkError::UnknownTarget(why)));
                    } else if let Err((single, failure)) = self.try_batch(vec![job]).await {
                        self.fail_single(missing, single, failure);
                    }
                }
            }
            Err((batch, failure)) => self.fail_single(missing, batch, failure),
        }
    }

    /// A publish that failed on its own: the broker refusing this message
    /// (406, 403) is [`SinkError::Permanent`], so it is parked rather than
    /// retried forever (each try costs a channel); a missing exchange is
    /// remembered; anything else is retried.
    fn fail_single(&self, missing: &MissingExchanges, batch: Vec<Job>, failure: Failure) {
        if let [job] = batch.as_slice() {
            missing.note(&job.exchange, &failure.why);
            if is_missing_exchange(&failure.why) {
                for job in batch {
                    let _ = job
                        .reply
                        .send(Err(SinkError::UnknownTarget(failure.why.clone())));
                }
                return;
            }
            if failure.refused {
                warn!(exchange = %job.exchange, routing_key = %job.routing_key,
                      why = %failure.why, "the broker refuses this message");
                for job in batch {
                    let _ = job
                        .reply
                        .send(Err(SinkError::Permanent(failure.why.clone())));
                }
                return;
            }
        }
        self.fail(batch, &failure.why)
    }

    async fn try_batch(&mut self, batch: Vec<Job>) -> Result<(), (Vec<Job>, Failure)> {
        if self.broker.is_blocked() {
            // A resource alarm: the broker reads nothing from this
            // connection, so a publish would hang. The core holds the route.
            for job in batch {
                let _ = job.reply.send(Err(SinkError::Unavailable(
                    "the broker blocked publishing (connection.blocked: a memory or disk alarm)"
                        .to_owned(),
                )));
            }
            return Ok(());
        }
        let channel = match self.channel().await {
            Ok(c) => c,
            Err(e) => {
                self.fail(batch, &e.to_string());
                return Ok(());
            }
        };
        // Getting a channel may have taken a reconnect, long enough for the
        // route to move to another instance.
        let batch = drop_fenced(batch);
        if batch.is_empty() {
            return Ok(());
        }
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        // Send everything first (pipelined), then collect the confirms. The
        // publishes are polled together, in order: lapin's `basic_publish`
        // queues its frames (and takes its delivery tag) on the first poll but
        // resolves only once the I/O thread has written them, so awaiting them
        // one by one would cost a thread round trip per message.
        let sends = batch.iter().map(|job| {
            channel.basic_publish(
                job.exchange.clone(),
                job.routing_key.clone(),
                options,
                &job.body,
                job.properties.clone(),
            )
        });
        // The time limit covers sending too: a connection the broker blocks
        // after the check above is not read, so the sends themselves hang.
        let limit = tokio::time::Instant::now() + self.config.confirm_timeout;
        let sent = match tokio::time::timeout_at(limit, join_in_order(sends)).await {
            Ok(sent) => sent,
            Err(_) => {
                self.timed_out(batch);
                return Ok(());
            }
        };
        let mut confirms = Vec::with_capacity(batch.len());
        for sent in sent {
            match sent {
                Ok(confirm) => confirms.push(confirm),
                Err(error) => {
                    self.channel_failed("basic.publish", &error);
                    // Published ones may or may not land: all retry (at-least-once).
                    let failure = Failure::new(format!("basic.publish failed: {error}"), &error);
                    return Err((batch, failure));
                }
            }
        }
        let waited = tokio::time::timeout_at(limit, async {
            let mut results = Vec::with_capacity(confirms.len());
            for confirm in confirms {
                results.push(confirm.await);
            }
            results
        })
        .await;
        let results = match waited {
            Ok(results) => results,
            Err(_) => {
                self.timed_out(batch);
                return Ok(());
            }
        };
        let failure = results.iter().find_map(|r| r.as_ref().err()).map(|error| {
            self.channel_failed("publisher confirm", error);
            Failure::new(format!("publisher confirm failed: {error}"), error)
        });
        // Every return of this batch is attached to one of its confirms.
        let failed: Vec<bool> = results.iter().map(|r| r.is_err()).collect();
        let mut returned: Vec<BasicReturnMessage> = Vec::new();
        let mut outcomes: Vec<Result<PublishOutcome, SinkError>> = Vec::with_capacity(batch.len());
        for result in results {
            outcomes.push(match result {
                Ok(Confirmation::Ack(ret)) => {
                    returned.extend(ret);
                    Ok(PublishOutcome::Delivered)
                }
                Ok(Confirmation::Nack(ret)) => {
                    returned.extend(ret);
                    Err(SinkError::Transient(
                        "broker nacked the message (basic.nack)".to_owned(),
                    ))
                }
                Ok(Confirmation::NotRequested) => {
                    self.channel = None;
                    Err(SinkError::Transient(
                        "channel was not in confirm mode".to_owned(),
                    ))
                }
                Err(error) => Err(SinkError::Transient(format!(
                    "publisher confirm failed: {error}"
                ))),
            });
        }
        mark_returned(&batch, &returned, &mut outcomes);
        // Confirmed ones are settled; those whose confirm was lost with the
        // channel go back to the caller to be tried again.
        let mut unsettled = Vec::new();
        for ((job, outcome), result_failed) in batch.into_iter().zip(outcomes).zip(failed) {
            if result_failed {
                unsettled.push(job);
            } else {
                let _ = job.reply.send(outcome);
            }
        }
        match failure {
            Some(why) if !unsettled.is_empty() => Err((unsettled, why)),
            _ => Ok(()),
        }
    }

    /// No confirm within `confirm_timeout`: drop the channel, fail the batch.
    fn timed_out(&mut self, batch: Vec<Job>) {
        warn!(timeout = ?self.config.confirm_timeout, "no publisher confirms in time; dropping the channel");
        self.channel = None;
        let why = format!(
            "no publisher confirm within {:?}",
            self.config.confirm_timeout
        );
        self.fail(batch, &why);
    }

    /// Fail publishes: [`SinkError::Unavailable`] while the connection is
    /// down (the core holds the route's messages, in order, until it is
    /// back), else [`SinkError::Transient`] (retried per message).
    fn fail(&self, batch: Vec<Job>, why: &str) {
        if self.broker.is_connected() && !self.broker.is_blocked() {
            return fail(batch, why);
        }
        for job in batch {
            let _ = job.reply.send(Err(SinkError::Unavailable(why.to_owned())));
        }
    }

    fn channel_failed(&mut self, what: &str, error: &lapin::Error) {
        if self.broker.is_connected() {
            // The broker closed this channel (e.g. the exchange does not exist).
            warn!(endpoint = %self.broker.endpoint(), %error, "{what} failed; reopening the channel");
        } else {
            // Connection loss: logged once by the broker connection, not per publish.
            debug!(endpoint = %self.broker.endpoint(), %error, "{what} failed; connection down");
        }
        self.channel = None;
    }
}

/// Why a batch failed under its channel.
struct Failure {
    why: String,
    /// The broker closed the channel refusing the content: 406
    /// PRECONDITION_FAILED (a `user_id` that is not the login, an
    /// `expiration` that is not a number) or 403 ACCESS_REFUSED.
    refused: bool,
}

impl Failure {
    fn new(why: String, error: &lapin::Error) -> Self {
        let refused = is_soft_error(error, AMQPSoftError::PRECONDITIONFAILED)
            || is_soft_error(error, AMQPSoftError::ACCESSREFUSED);
        Self { why, refused }
    }
}

/// How many futures [`join_in_order`] joins per allocation: futures-util's
/// `join_all` keeps up to 30 in one boxed slice (and boxes each beyond).
/// lapin's publish future is 1,064 bytes, past glibc's per-thread cache
/// (1,032), so a box per publish cost a slow malloc and free each: 5-7 % of
/// delayd's CPU while it released a burst.
const JOINED_PER_ALLOCATION: usize = 30;

/// Runs `futures` concurrently and returns their outputs in order. Each poll
/// visits the unfinished ones in order, so their first polls (where lapin
/// queues the frames) happen in order too.
/// The futures are all made before the returned one is first polled.
pub(crate) fn join_in_order<F: Future>(
    futures: impl IntoIterator<Item = F>,
) -> impl Future<Output = Vec<F::Output>> {
    let mut futures = futures.into_iter().peekable();
    let mut groups = Vec::new();
    while futures.peek().is_some() {
        groups.push(join_all(futures.by_ref().take(JOINED_PER_ALLOCATION)));
    }
    async move { join_all(groups).await.into_iter().flatten().collect() }
}

/// Fails the jobs whose exchange is known to be missing; returns the rest.
fn fail_known_missing(missing: &MissingExchanges, batch: Vec<Job>) -> Vec<Job> {
    if missing.is_empty() {
        return batch;
    }
    let mut rest = Vec::with_capacity(batch.len());
    for job in batch {
        match missing.check(&job.exchange) {
            Some(why) => {
                let _ = job.reply.send(Err(SinkError::UnknownTarget(why)));
            }
            None => rest.push(job),
        }
    }
    rest
}

fn fail(batch: Vec<Job>, why: &str) {
    for job in batch {
        let _ = job.reply.send(Err(SinkError::Transient(why.to_owned())));
    }
}

/// Turn the confirmed publishes that came back as `basic.return` into
/// [`PublishOutcome::Unroutable`], matching returns to publishes by content.
fn mark_returned(
    batch: &[Job],
    returned: &[BasicReturnMessage],
    outcomes: &mut [Result<PublishOutcome, SinkError>],
) {
    let mut taken = vec![false; batch.len()];
    for ret in returned {
        let d = &ret.delivery;
        let same_route = |job: &Job| job.exchange == d.exchange && job.routing_key == d.routing_key;
        let exact = (0..batch.len()).find(|&i| {
            let job = &batch[i];
            !taken[i] && same_route(job) && job.body == d.data && job.properties == d.properties
        });
        debug!(exchange = %d.exchange, routing_key = %d.routing_key,
               reply_code = ret.reply_code, reply_text = %ret.reply_text,
               "message returned as unroutable");
        match exact {
            Some(i) => {
                taken[i] = true;
                if outcomes[i].is_ok() {
                    outcomes[i] = Ok(PublishOutcome::Unroutable);
                }
            }
            None => {
                // Cannot tell which: every candidate is treated as returned.
                warn!(exchange = %d.exchange, routing_key = %d.routing_key,
                      "returned message matches no publish exactly; marking every publish on that route unroutable");
                for (i, job) in batch.iter().enumerate() {
                    if same_route(job) && outcomes[i].is_ok() {
                        outcomes[i] = Ok(PublishOutcome::Unroutable);
                    }
                }
            }
        }
    }
}

impl Sink for AmqpSink {
    fn publish(
        &self,
        message: Message,
        target: Target,
    ) -> BoxFuture<'static, Result<PublishOutcome, SinkError>> {
        self.enqueue_owned(message, &target)
    }

    fn publish_fenced(
        &self,
        message: Message,
        target: Target,
        fence: Fence,
    ) -> BoxFuture<'static, Result<PublishOutcome, SinkError>> {
        self.enqueue_fenced(message, &target, Some(fence))
    }

    fn declare_destination<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), SinkError>> {
        Box::pin(async move {
            self.declare_queue(name)
                .await
                .map_err(|e| SinkError::Transient(format!("cannot declare queue {name:?}: {e}")))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::amqp::connection::BrokerOptions;

    #[test]
    fn only_a_missing_exchange_is_remembered_and_only_for_a_while() {
        let missing = MissingExchanges::default();
        let (orders, other) = (ShortString::from("orders"), ShortString::from("other"));
        assert!(missing.is_empty());
        missing.note(
            &orders,
            "publisher confirm failed: NOT_FOUND - no exchange 'orders' in vhost '/'",
        );
        missing.note(&other, "publisher confirm failed: connection reset");
        let why = missing.check(&orders).expect("orders is remembered");
        assert!(why.contains("NOT_FOUND - no exchange 'orders'"));
        assert_eq!(missing.check(&other), None, "not a missing exchange");
        // Expired entries are forgotten on the next check.
        let long_ago = Instant::now() - MISSING_EXCHANGE_RECHECK;
        missing.0.lock().unwrap().get_mut(&orders).unwrap().0 = long_ago;
        assert_eq!(missing.check(&orders), None);
        assert!(missing.is_empty());
    }

    fn unreachable_sink() -> AmqpSink {
        let mut options = BrokerOptions::named("test");
        options.backoff_initial = Duration::from_secs(60);
        // Port 1 on localhost: connection refused at once.
        let broker = Broker::new("amqp://guest:guest@127.0.0.1:1/%2f", options).unwrap();
        AmqpSink::new(Arc::new(broker), SinkConfig::default())
    }

    #[tokio::test]
    async fn join_in_order_polls_first_in_order_and_keeps_output_order() {
        // More than one group of `JOINED_PER_ALLOCATION`.
        const N: usize = 2 * JOINED_PER_ALLOCATION + 5;
        let first_polls = Arc::new(Mutex::new(Vec::new()));
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..N).map(|_| oneshot::channel()).unzip();
        let polls = first_polls.clone();
        let futures = receivers.into_iter().enumerate().map(move |(i, rx)| {
            let first_polls = polls.clone();
            async move {
                first_polls.lock().unwrap().push(i);
                rx.await.unwrap_or(usize::MAX)
            }
        });
        let joined = tokio::spawn(join_in_order(futures));
        // Every one is started before any completes (lapin queues frames then).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while first_polls.lock().unwrap().len() < N {
            assert!(tokio::time::Instant::now() < deadline, "not all started");
            tokio::task::yield_now().await;
        }
        assert_eq!(*first_polls.lock().unwrap(), (0..N).collect::<Vec<_>>());
        // Complete them in reverse order.
        for (i, tx) in senders.into_iter().enumerate().rev() {
            tokio::task::yield_now().await;
            tx.send(i * 10).unwrap();
        }
        assert_eq!(
            joined.await.unwrap(),
            (0..N).map(|i| i * 10).collect::<Vec<_>>()
        );
    }

    #[tokio::test]
    async fn broker_down_is_unavailable_and_backs_off() {
        let sink = unreachable_sink();
        let message = Message::with_body("x");
        for _ in 0..3 {
            let outcome = sink.publish(message.clone(), Target::queue("q")).await;
            assert!(
                matches!(outcome, Err(SinkError::Unavailable(_))),
                "{outcome:?}"
            );
        }
        // Nothing is left queued.
        for queue in &sink.shared.queues {
            assert!(queue.jobs.lock().unwrap().is_empty());
        }
    }

    #[tokio::test]
    async fn messages_amqp_cannot_carry_are_permanent() {
        let sink = unreachable_sink();
        let mut message = Message::with_body("x");
        message.routing_key = "k".repeat(256);
        let outcome = sink.publish(message.clone(), Target::exchange("x")).await;
        assert!(
            matches!(outcome, Err(SinkError::Permanent(_))),
            "{outcome:?}"
        );

        let mut message = Message::with_body("x");
        message
            .headers
            .insert("big", crate::message::Value::U64(u64::MAX));
        let outcome = sink.publish(message.clone(), Target::queue("q")).await;
        assert!(
            matches!(outcome, Err(SinkError::Permanent(_))),
            "{outcome:?}"
        );
    }
}
