//! Backpressure state shared by the intakes and shown by `/readyz`.
//!
//! An intake pauses its source (AMQP `basic.cancel`, Kafka partition pause)
//! when the engine refuses admission (`engine.max_pending`,
//! `engine.max_disk`) or a WAL write hits ENOSPC, and resumes when the engine
//! is relieved. Messages wait in the broker meanwhile; none is dropped.
//!
//! A full disk has no counter to watch, so it is probed: each delivery whose
//! store failed with ENOSPC is held (unacked) and stored again every
//! [`DISK_PROBE`]; the first that succeeds clears the state and the sources
//! resume. Nothing is requeued meanwhile, so a quorum queue's delivery limit
//! is never spent on a full disk.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::engine::{Engine, Pressure};

/// How long after an ENOSPC the intakes try storing again.
pub const DISK_PROBE: Duration = Duration::from_secs(5);

#[derive(Debug, Default)]
pub struct Backpressure {
    /// Routes whose source is paused, and why.
    paused: Mutex<BTreeMap<String, Pressure>>,
    /// When a WAL write last failed with ENOSPC (cleared by a successful store).
    disk_full_at: Mutex<Option<Instant>>,
}

impl Backpressure {
    /// Why `engine` cannot take more right now, if it cannot.
    pub fn reason(&self, engine: &Engine) -> Option<Pressure> {
        if self.disk_full_at().is_some() {
            return Some(Pressure::DiskFull);
        }
        engine.pressure()
    }

    /// Whether a source paused for `why` may consume again.
    pub fn relieved(&self, engine: &Engine, why: Pressure) -> bool {
        match self.disk_full_at() {
            // The held deliveries probe; one stored clears the state.
            Some(_) => false,
            None if why == Pressure::DiskFull => engine.pressure().is_none(),
            None => engine.relieved(),
        }
    }

    /// A WAL write failed with ENOSPC.
    pub fn disk_full(&self) {
        let mut at = self.disk_full_at.lock().unwrap_or_else(|e| e.into_inner());
        if at.is_none() {
            tracing::error!(
                "DISK FULL: the WAL cannot be written (ENOSPC); delayd stops consuming, \
                 messages wait in the broker, and it retries every {}s. Free space on the WAL volume.",
                DISK_PROBE.as_secs()
            );
        }
        *at = Some(Instant::now());
    }

    /// A store succeeded: the disk has room again.
    pub fn stored(&self) {
        let mut at = self.disk_full_at.lock().unwrap_or_else(|e| e.into_inner());
        if at.take().is_some() {
            tracing::warn!("WAL writes succeed again after a full disk");
        }
    }

    pub fn set_paused(&self, route: &str, why: Option<Pressure>) {
        let mut paused = self.paused.lock().unwrap_or_else(|e| e.into_inner());
        match why {
            Some(why) => paused.insert(route.to_owned(), why),
            None => paused.remove(route),
        };
        metrics::gauge!("delayd_backpressure", "route" => route.to_owned()).set(if why.is_some() {
            1.0
        } else {
            0.0
        });
    }

    /// Paused routes and why, for `/readyz`.
    pub fn paused(&self) -> BTreeMap<String, Pressure> {
        self.paused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn disk_full_at(&self) -> Option<Instant> {
        *self.disk_full_at.lock().unwrap_or_else(|e| e.into_inner())
    }
}
