//! The end-to-end tests against the real brokers, compiled as one binary
//! (one link of the harness in `common` instead of one per file).
//!
//! Tests that must run alone stay binaries of their own: `broker_restart`
//! restarts RabbitMQ and `broker_alarm` raises a resource alarm, which would
//! disturb every test running beside them; `wal_crash` and `engine_crash`
//! re-run their own binary as the child they kill.

mod common;

mod amqp10;
mod bench;
mod broker_store;
mod clock;
mod deploy;
mod endpoints;
mod far_tier;
mod handoff;
mod kafka_security;
mod kafka_sidecar;
mod operations;
mod partitions;
mod rabbitmq_sidecar;
mod rabbitmq_ttl_retry;
mod secrets;
mod stream_ingress;
mod stream_store;
mod tls;
