//! A warm standby (#39): while another instance owns a RabbitMQ route, a
//! candidate follows the route's current generation as the owner writes
//! it, on an observer session of its own, so that taking the route over
//! reads only the last moment's records.
//!
//! A candidate used to read the whole generation only once chosen, while
//! it waited out the former owner's lease: 0.4-1.8 s for 13,000-142,000
//! records on the loaded three-node cluster, which outlasted a 1 s lease
//! in half the hand-overs of the long campaign. Now it reads the generation
//! once ([`StateSession::read_ahead`]) and then applies each record as it
//! is written ([`StateSession::follow`]); when a checkpoint deletes the
//! generation, it reads the next one.
//!
//! What it holds is a [`Replay`]: the live set with its messages, as the
//! restore would build it (the restore completes it with
//! [`StateSession::catch_up`] once the route is owned; an integration test
//! checks the result against a cold read). Holding messages costs memory
//! the owner does not spend (it keeps them in its WAL), so a set over
//! [`MAX_BYTES`] is let go, and the candidate reads once chosen, as before.

use std::future::Future;
use std::time::{Duration, Instant};

use delayd_adapters::amqp::state::{Following, ReadAhead, StateError, StateSession};

use super::departed::{self, Replay};

/// How often a standby checks on what it follows.
pub const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The most message bytes a standby holds per route.
pub const MAX_BYTES: usize = 256 << 20;

/// One route's generation as a candidate keeps it.
pub struct Warm {
    route: String,
    observer: Option<StateSession>,
    following: Option<Following<Replay>>,
    /// Read, but not followed (the follow could not start): still a prefix
    /// of its generation.
    unfollowed: Option<ReadAhead<Replay>>,
    /// Over [`MAX_BYTES`]: no longer followed.
    let_go: bool,
}

impl Warm {
    pub fn new(route: &str) -> Self {
        Self {
            route: route.to_owned(),
            observer: None,
            following: None,
            unfollowed: None,
            let_go: false,
        }
    }

    /// Check on what is followed; if the follow ended or nothing is
    /// followed yet, resume it or read the current generation and follow
    /// that. `open` gives an observer session when none is open.
    pub async fn check<F, Fut>(&mut self, open: F)
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<StateSession, StateError>>,
    {
        if self.let_go {
            return;
        }
        if let Some(following) = self.following.as_ref().filter(|f| !f.ended()) {
            let bytes = following.with(|a| a.state.bytes()).unwrap_or(0);
            if bytes > MAX_BYTES {
                tracing::info!(route = %self.route, bytes, max = MAX_BYTES, "the route's live set is too large to hold on standby: it is read once this instance is chosen");
                self.following = None;
                self.let_go = true;
                self.close();
            }
            return;
        }
        // Nothing to follow (no state yet, a checkpoint under way): read
        // again at the next check.
        let Some(ahead) = self.resume_or_read(open).await else {
            return;
        };
        let Some(observer) = &self.observer else {
            self.unfollowed = Some(ahead);
            return;
        };
        match observer.follow(ahead).await {
            Ok(following) => self.following = Some(following),
            Err((error, ahead)) => {
                tracing::debug!(route = %self.route, %error, "could not follow the route's state");
                self.unfollowed = Some(ahead);
                self.close();
            }
        }
    }

    /// What is held once chosen (the candidate waits out the former
    /// owner's lease): what was followed, or, if nothing was, the current
    /// generation read now, whatever its size. Nothing is held after it,
    /// and the observer session is closed.
    pub async fn finish<F, Fut>(&mut self, open: F) -> Option<ReadAhead<Replay>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<StateSession, StateError>>,
    {
        let ahead = match self.following.take_if(|f| !f.ended()) {
            Some(following) => following.stop(),
            None => self.resume_or_read(open).await,
        };
        self.close();
        self.unfollowed = None;
        self.let_go = false;
        ahead
    }

    /// What an ended follow holds, if its generation is still the current
    /// one (its connection closed: a drain closes every connection on its
    /// node), on a new observer session; else the current generation read
    /// whole. None if there is nothing to read or a read failed (the
    /// session is then closed).
    async fn resume_or_read<F, Fut>(&mut self, open: F) -> Option<ReadAhead<Replay>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<StateSession, StateError>>,
    {
        let held = match self.following.take() {
            Some(following) => {
                self.close();
                following.stop()
            }
            None => self.unfollowed.take(),
        };
        if self.observer.is_none() {
            match open().await {
                Ok(observer) => self.observer = Some(observer),
                Err(error) => {
                    tracing::debug!(route = %self.route, %error, "could not open a session to read the state ahead");
                    return None;
                }
            }
        }
        let observer = self.observer.as_ref()?;
        let result = match held {
            Some(held) => match observer.current_generation().await {
                Ok((Some(current), _)) if current == held.generation => {
                    tracing::debug!(route = %self.route, generation = current, "the follow ended (its connection closed); resuming where it was");
                    return Some(held);
                }
                Ok(_) => self.read().await,
                Err(error) => Err(error),
            },
            None => self.read().await,
        };
        result.unwrap_or_else(|error| {
            tracing::debug!(route = %self.route, %error, "could not read the state ahead; it is read once the route is owned");
            self.close();
            None
        })
    }

    /// The current generation read whole on the observer session.
    async fn read(&self) -> Result<Option<ReadAhead<Replay>>, StateError> {
        let Some(observer) = &self.observer else {
            return Ok(None);
        };
        let started = Instant::now();
        let ahead = observer
            .read_ahead(Replay::new(&self.route, departed::KEPT))
            .await?;
        tracing::debug!(route = %self.route, generation = ahead.as_ref().map(|a| a.generation), read = ahead.as_ref().map_or(0, |a| a.read), read_ms = started.elapsed().as_millis() as u64, "state read ahead");
        Ok(ahead)
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
