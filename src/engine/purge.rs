//! Purge: cancel every pending message of a route due within a window, each
//! as a cancel by id would (a durable Done; a tombstone in the broker-kept
//! store). The admin API's `DELETE /v1/messages?route=R` is this.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use futures_util::stream::{self, StreamExt};

use super::{Engine, EngineError, ListQuery, Location, PendingInfo, Retired};
use crate::far::FarRecord;

/// Messages listed per walk of a purge.
const PURGE_PAGE: usize = 10_000;
/// Cancels of a purge waiting for their Done at once (one group commit
/// makes many durable).
const PURGE_CONCURRENCY: usize = 256;

/// What a purge found and did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PurgeCount {
    /// Pending messages of the route within the window when it was walked.
    pub matched: u64,
    /// Cancelled (their Done records durable).
    pub purged: u64,
    /// Being published at the time: left to leave.
    pub in_flight: u64,
}

impl Engine {
    /// Cancel every pending message of `route` due within
    /// `due_from..=due_to`. Those being published are left (they are
    /// leaving anyway) and counted apart. `dry_run`: only count.
    ///
    /// A far message whose bucket loads between the listing and its cancel
    /// is armed under a new id: the walk is repeated until one misses
    /// nothing, so that it is cancelled too.
    pub async fn purge(
        &self,
        route: &str,
        due_from: Option<u64>,
        due_to: Option<u64>,
        dry_run: bool,
    ) -> Result<PurgeCount, EngineError> {
        // The far tier's view is the WAL's too before it is listed.
        super::tier::retire_spilled_now(&self.inner)
            .await
            .inspect_err(|e| self.inner.on_failure(e))?;
        let mut count = PurgeCount::default();
        let mut first = true;
        loop {
            let missed = self
                .purge_walk(route, (due_from, due_to), dry_run, first, &mut count)
                .await?;
            if missed == 0 {
                break;
            }
            first = false;
        }
        // A walk again may find what was stored meanwhile.
        count.matched = count.matched.max(count.purged + count.in_flight);
        Ok(count)
    }

    /// One walk over the route's pending messages in the window. Returns
    /// how many far messages had moved before their cancel.
    async fn purge_walk(
        &self,
        route: &str,
        (due_from, due_to): (Option<u64>, Option<u64>),
        dry_run: bool,
        first: bool,
        count: &mut PurgeCount,
    ) -> Result<u64, EngineError> {
        let mut after = None;
        let mut missed = 0;
        loop {
            let query = ListQuery {
                route: Some(route.to_owned()),
                due_from,
                due_to,
                after,
                limit: PURGE_PAGE,
            };
            let engine = self.clone();
            let page = tokio::task::spawn_blocking(move || engine.list(&query))
                .await
                .map_err(|_| EngineError::WriterGone)?;
            let Some(last) = page.last() else { break };
            after = Some((last.due_ms, last.id));
            let full = page.len() == PURGE_PAGE;
            if first {
                count.matched += page.len() as u64;
            }
            #[cfg(test)]
            if let Some(tier) = self.inner.far.as_ref() {
                if tier
                    .load_during_purge
                    .swap(false, std::sync::atomic::Ordering::AcqRel)
                {
                    super::tier::load_due(&self.inner).await?;
                }
            }
            if !dry_run {
                missed += self.purge_page(page, count).await?;
            }
            if !full {
                break;
            }
        }
        Ok(missed)
    }

    /// Cancel one page: near messages one by one (one group commit makes
    /// many Dones durable), far ones a bucket at a time.
    async fn purge_page(
        &self,
        page: Vec<PendingInfo>,
        count: &mut PurgeCount,
    ) -> Result<u64, EngineError> {
        let mut far: BTreeMap<u64, HashSet<u64>> = BTreeMap::new();
        let mut near = Vec::new();
        for info in page {
            match (&info.at, self.inner.far.as_ref()) {
                (Location::Far(record), Some(tier)) => {
                    let bucket = tier.store().bucket_of(record.due_ms);
                    far.entry(bucket).or_default().insert(info.id);
                }
                _ => near.push(info.id),
            }
        }
        let outcomes: Vec<Result<bool, EngineError>> = stream::iter(near)
            .map(|id| {
                let engine = self.clone();
                async move { engine.cancel(id).await }
            })
            .buffer_unordered(PURGE_CONCURRENCY)
            .collect()
            .await;
        for outcome in outcomes {
            match outcome {
                Ok(true) => count.purged += 1,
                // Fired meanwhile.
                Ok(false) => {}
                Err(EngineError::InFlight(_)) => count.in_flight += 1,
                Err(e) => return Err(e),
            }
        }
        let mut missed = 0;
        for (bucket, ids) in far {
            let cancelled = self.cancel_listed(bucket, &ids).await?;
            count.purged += cancelled;
            missed += ids.len() as u64 - cancelled;
        }
        Ok(missed)
    }

    /// Cancel those of `ids` still in far bucket `bucket`, as
    /// [`Engine::cancel`] would each. Returns how many.
    async fn cancel_listed(&self, bucket: u64, ids: &HashSet<u64>) -> Result<u64, EngineError> {
        let Some(tier) = self.inner.far.as_ref() else {
            return Ok(0);
        };
        let loading = tier.store().loading().is_some();
        let found = {
            let _op = tier.exclusive().await;
            let inner = self.inner.clone();
            let ids = ids.clone();
            tokio::task::spawn_blocking(move || {
                // Each cancel's mark durable before the bucket's cancels are
                // written, as a cancel by id does (seed 9398): marked after,
                // a purge that failed between the two left messages cancelled
                // without a mark, whose redelivery a restart stored again
                // and fired after the next purge was answered (seed 9171180).
                // Queued at once, so one group commit makes many durable.
                let marked = |found: &[FarRecord]| {
                    let mut marks = Vec::with_capacity(found.len());
                    for r in found {
                        marks.push(inner.mark_cancelled_now(r.id, r.uid)?);
                    }
                    for mark in marks {
                        mark.blocking_recv()
                            .map_err(|_| EngineError::WriterGone)??;
                    }
                    Ok(())
                };
                super::tier::cancel_listed(&inner, bucket, &ids, marked)
            })
            .await
            .map_err(|_| EngineError::WriterGone)?
            .inspect_err(|e| self.inner.on_failure(e))?
        };
        let n = found.len() as u64;
        for r in found {
            metrics::counter!("delayd_cancelled_total", "route" => r.route.clone()).increment(1);
            let (id, uid) = (r.id, r.uid);
            let retired = Retired {
                id,
                done: None,
                route: Arc::from(r.route.as_str()),
                message: Some(r.message),
                was: None,
                kept_marks: Vec::new(),
            };
            retired
                .settle(&self.inner, self.inner.cancel_hook.get())
                .await?;
            if loading {
                self.cancel_copies(id, uid).await?;
            }
        }
        Ok(n)
    }
}
