//! delayd core: durable per-message delayed delivery.
//!
//! - [`wal`]: the write-ahead log, the only source of truth.
//! - [`wheel`]: the hierarchical timing wheel, an index rebuilt from the WAL.
//! - [`engine`]: owns both; schedules, cancels, fires due messages to a sink.
//! - [`id`]: a message's identity (`x-delayd-id`).
//! - [`route`]: delay headers and egress rewrites (pure logic).
//! - [`config`]: figment defaults < file < environment.
//! - [`runtime`]: `delayd run`, wiring the above to broker adapters.
//! - [`admin`]: health, metrics and the `/v1/messages` API; [`messages`]
//!   and [`client`]: the same API from the command line; [`healthcheck`]:
//!   the probes from the command line.
//! - [`partition_leftovers`]: partitions a route had before and no longer
//!   has, refused or removed at start and by `delayd check`.
#![forbid(unsafe_code)]

pub mod admin;
pub mod api;
pub mod bench;
pub mod client;
pub mod config;
pub mod engine;
pub mod far;
pub mod finisher;
pub mod healthcheck;
pub mod id;
pub mod inspect;
pub mod messages;
pub mod partition_leftovers;
pub mod route;
pub mod runtime;
#[cfg(test)]
mod sim;
pub mod status;
pub mod store_inspect;
pub mod telemetry;
pub mod wal;
pub mod wheel;
