//! A warm standby (#39): while another instance owns a RabbitMQ route, a
//! candidate keeps the route's current generation read, on an observer
//! session of its own, so that taking the route over reads only the last
//! moments' records.
//!
//! A candidate used to read the whole generation only once chosen, while
//! it waited out the former owner's lease: 0.4-1.8 s for 13,000-142,000
//! records on the loaded three-node cluster, which outlasted a 1 s lease
//! in half the hand-overs of the long campaign. Now it reads what was
//! written since its last round, every [`KEEP_UP_EVERY`].
//!
//! What it holds is a [`Replay`]: the live set with its messages, as the
//! restore would build it (the restore completes it with
//! [`StateSession::catch_up`] once the route is owned, and an integration
//! test checks the result against a cold read). Holding messages costs
//! memory the owner does not spend (it keeps them in its WAL), so a set
//! over [`MAX_BYTES`] is let go, and the candidate reads once chosen, as
//! before.

use std::future::Future;
use std::time::{Duration, Instant};

use delayd_adapters::amqp::state::{ReadAhead, StateError, StateSession};

use super::departed::{self, Replay};

/// How often a standby reads what the owner wrote.
pub const KEEP_UP_EVERY: Duration = Duration::from_secs(1);

/// The most message bytes a standby holds per route.
pub const MAX_BYTES: usize = 256 << 20;

/// One route's generation as a candidate keeps it.
pub struct Warm {
    route: String,
    observer: Option<StateSession>,
    ahead: Option<ReadAhead<Replay>>,
    /// Over [`MAX_BYTES`]: no longer kept up.
    let_go: bool,
}

impl Warm {
    pub fn new(route: &str) -> Self {
        Self {
            route: route.to_owned(),
            observer: None,
            ahead: None,
            let_go: false,
        }
    }

    /// Read what was written since the last round; `open` gives an
    /// observer session when none is open. A failure drops what was held
    /// (a read cut short leaves it applied in part) and the session.
    pub async fn keep_up<F, Fut>(&mut self, open: F)
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<StateSession, StateError>>,
    {
        if self.let_go {
            return;
        }
        self.round(open).await;
        let bytes = self.ahead.as_ref().map_or(0, |a| a.state.bytes());
        if bytes > MAX_BYTES {
            tracing::info!(route = %self.route, bytes, max = MAX_BYTES, "the route's live set is too large to hold on standby: it is read once this instance is chosen");
            self.ahead = None;
            self.let_go = true;
            self.close();
        }
    }

    /// The generation as read after a last round (the candidate has been
    /// chosen and waits out the former owner's lease), whatever its size.
    pub async fn finish<F, Fut>(mut self, open: F) -> Option<ReadAhead<Replay>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<StateSession, StateError>>,
    {
        self.round(open).await;
        self.ahead.take()
    }

    async fn round<F, Fut>(&mut self, open: F)
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<StateSession, StateError>>,
    {
        let started = Instant::now();
        let observer = match &self.observer {
            Some(observer) => observer,
            None => match open().await {
                Ok(observer) => self.observer.insert(observer),
                Err(error) => {
                    tracing::debug!(route = %self.route, %error, "could not open a session to read the state ahead");
                    self.ahead = None;
                    return;
                }
            },
        };
        let held = self.ahead.as_ref().map(|a| (a.generation, a.read));
        let route = &self.route;
        match observer
            .keep_up(self.ahead.take(), || Replay::new(route, departed::KEPT))
            .await
        {
            Ok(ahead) => {
                tracing::debug!(route = %self.route, generation = ahead.as_ref().map(|a| a.generation), read = ahead.as_ref().map_or(0, |a| match held {
                    Some((generation, read)) if generation == a.generation => a.read - read,
                    _ => a.read,
                }), live = ahead.as_ref().map_or(0, |a| a.state.len()), read_ms = started.elapsed().as_millis() as u64, "state read ahead");
                self.ahead = ahead;
            }
            Err(error) => {
                tracing::debug!(route = %self.route, %error, "could not read the state ahead; it is read again in full");
                self.close();
            }
        }
    }

    fn close(&mut self) {
        if let Some(observer) = self.observer.take() {
            tokio::spawn(async move { observer.close().await });
        }
    }
}

impl Drop for Warm {
    fn drop(&mut self) {
        self.close();
    }
}
