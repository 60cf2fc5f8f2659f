//! The log's fatal-error latch. Set once (an fsync that failed, a segment
//! that cannot be created), never cleared. The writer checks it on every
//! batch; the runtime waits on it, so a failure with no intake traffic still
//! stops the process and fails `/healthz`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::watch;

#[derive(Clone)]
pub struct Halt {
    flag: Arc<AtomicBool>,
    reason: Arc<watch::Sender<Option<String>>>,
}

impl Default for Halt {
    fn default() -> Self {
        Self {
            flag: Arc::new(AtomicBool::new(false)),
            reason: Arc::new(watch::channel(None).0),
        }
    }
}

impl Halt {
    /// Latch the log as stopped; the first reason is kept.
    pub fn stop(&self, reason: impl std::fmt::Display) {
        let reason = reason.to_string();
        self.reason.send_if_modified(|r| {
            if r.is_some() {
                return false;
            }
            *r = Some(reason);
            true
        });
        self.flag.store(true, Ordering::Release);
    }

    pub fn is_stopped(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// Why the log stopped, once it has.
    pub fn reason(&self) -> Option<String> {
        self.reason.borrow().clone()
    }

    /// Resolves with the reason once the log stops.
    pub async fn stopped(&self) -> String {
        let mut rx = self.reason.subscribe();
        let reason = match rx.wait_for(Option::is_some).await {
            Ok(r) => r.clone().unwrap_or_default(),
            // The sender lives in `self`, so it cannot be gone.
            Err(_) => std::future::pending().await,
        };
        reason
    }
}
