//! delayd core: durable per-message delayed delivery.
//!
//! - [`wal`]: the write-ahead log, the only source of truth.
//! - [`wheel`]: the hierarchical timing wheel, an index rebuilt from the WAL.
//! - [`engine`]: owns both; schedules, cancels, fires due messages to a sink.
#![forbid(unsafe_code)]

pub mod config;
pub mod engine;
pub mod route;
pub mod wal;
pub mod wheel;
