//! Purge: cancel every pending message of a route due within a window, each
//! as a cancel by id would (a durable Done; a tombstone in the broker-kept
//! store). The admin API's `DELETE /v1/messages?route=R` is this.

use futures_util::stream::{self, StreamExt};

use super::{Engine, EngineError, ListQuery};

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
    pub async fn purge(
        &self,
        route: &str,
        due_from: Option<u64>,
        due_to: Option<u64>,
        dry_run: bool,
    ) -> Result<PurgeCount, EngineError> {
        let mut count = PurgeCount::default();
        let mut after = None;
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
            count.matched += page.len() as u64;
            if !dry_run {
                let outcomes: Vec<Result<bool, EngineError>> = stream::iter(page)
                    .map(|info| {
                        let engine = self.clone();
                        async move { engine.cancel(info.id).await }
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
            }
            if !full {
                break;
            }
        }
        Ok(count)
    }
}
