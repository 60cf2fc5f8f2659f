//! Many short futures polled in one task instead of a task each.
//!
//! The WAL writer makes a whole batch of records durable at once, and a
//! broker confirms publishes in bursts. With a task per message, each
//! waiter is scheduled on its own, and each can wake an idle worker thread:
//! hand-offs between threads are most of delayd's CPU per message. Polled
//! together, a burst wakes one task.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;

use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use tokio::sync::mpsc;

type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

pub struct Finisher {
    tx: mpsc::UnboundedSender<BoxFuture>,
}

impl Finisher {
    /// Start the task; it ends once the `Finisher` is dropped and every
    /// future handed to it has finished.
    pub fn start() -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(drive(rx));
        Self { tx }
    }

    /// Run `future` to completion in the shared task.
    pub fn run(&self, future: impl Future<Output = ()> + Send + 'static) {
        if let Err(refused) = self.tx.send(Box::pin(future)) {
            // The task is gone (the runtime is shutting down): a task of its own.
            tokio::spawn(refused.0);
        }
    }
}

async fn drive(mut rx: mpsc::UnboundedReceiver<BoxFuture>) {
    let mut running = FuturesUnordered::new();
    loop {
        tokio::select! {
            next = rx.recv() => match next {
                // A panic ends only its own future, as it would its own task.
                Some(future) => running.push(AssertUnwindSafe(future).catch_unwind()),
                None => break,
            },
            Some(result) = running.next(), if !running.is_empty() => report(result),
        }
    }
    while let Some(result) = running.next().await {
        report(result);
    }
}

fn report(result: Result<(), Box<dyn std::any::Any + Send>>) {
    if let Err(panic) = result {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        tracing::error!(panic = %what, "a task panicked");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn every_future_runs_to_the_end_despite_a_panic_and_a_dropped_finisher() {
        let finisher = Finisher::start();
        let (done, panicked) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let (release, released) = tokio::sync::watch::channel(false);
        {
            let panicked = panicked.clone();
            finisher.run(async move {
                panicked.store(true, Ordering::SeqCst);
                panic!("one future fails");
            });
        }
        for _ in 0..100 {
            let (done, mut released) = (done.clone(), released.clone());
            finisher.run(async move {
                let _ = released.wait_for(|go| *go).await;
                done.fetch_add(1, Ordering::SeqCst);
            });
        }
        drop(finisher);
        drop(released);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        // The others are released only once the panic has happened: it
        // must have taken none of them with it.
        while !panicked.load(Ordering::SeqCst) {
            assert!(std::time::Instant::now() < deadline, "never polled");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        // Err: no receiver is left, every waiting future was dropped.
        assert!(
            release.send(true).is_ok(),
            "futures were dropped with the panic"
        );
        while done.load(Ordering::SeqCst) < 100 {
            assert!(std::time::Instant::now() < deadline, "futures were dropped");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }
}
