//! Broker-neutral message model and the Source/Sink traits that delayd's core
//! drives, with the RabbitMQ (`amqp`, lapin) and Kafka (`kafka`, rdkafka)
//! adapters behind cargo features.
//!
//! This crate knows nothing about the write-ahead log or the timing wheel: a
//! source hands out [`Delivery`]s and is told when to acknowledge them, a sink
//! publishes a [`Message`] to a [`Target`] and says whether the broker took it.
#![forbid(unsafe_code)]

pub mod codec;
pub mod log_burst;
pub mod message;
pub mod offsets;
pub mod split_mix;
pub mod traits;

#[cfg(feature = "amqp")]
pub mod amqp;

#[cfg(feature = "kafka")]
pub mod kafka;

#[cfg(feature = "amqp")]
pub use amqp::{
    AmqpError, AmqpSink, AmqpSource, Broker, BrokerConnections, BrokerOptions, ExchangeType,
    SinkConfig as AmqpSinkConfig, SourceConfig as AmqpSourceConfig,
};
pub use codec::{check_nesting, decode, encode, lookup_key, CodecError};
pub use message::{FieldTable, Message, Properties, Value};
pub use traits::{
    AckHandle, BoxFuture, Consuming, Delivery, Fence, PublishOutcome, Sink, SinkError, Source,
    SourceError, Target, FENCED,
};
