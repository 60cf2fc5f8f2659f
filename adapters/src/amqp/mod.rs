//! RabbitMQ adapter (AMQP 0-9-1, via lapin).
//!
//! One job per file:
//!
//! * [`convert`]: lossless lapin ⇄ [`Message`](crate::Message) conversion,
//!   every field-table type and basic property.
//! * [`endpoints`]: [`AmqpSettings`] (URLs, password, TLS, login) parsed
//!   into [`Endpoints`], tried in order; URL passwords redacted.
//! * [`tls`]: delayd's rustls client for `amqps://`: a private CA, a client
//!   certificate, a server name, and failures that say what to fix.
//! * [`connection`]: [`Broker`], a lazily (re)connected connection with
//!   exponential back-off over a broker's endpoints, and
//!   [`BrokerConnections`], the separate consume and publish connections
//!   delayd keeps per broker.
//! * [`topology`]: declaring durable queues and a route's source exchange.
//! * [`source`]: [`AmqpSource`], a [`Source`](crate::Source) consuming one
//!   queue with manual acks, reconnecting transparently, pausable.
//! * [`stream`]: a stream ingress's offsets: the offset header, the
//!   checkpoint file delayd keeps, acks that resolve once it is written.
//! * [`state`]: the broker-kept store's lock and state streams.
//! * [`sink`]: [`AmqpSink`], a [`Sink`](crate::Sink) publishing with
//!   publisher confirms and `mandatory`, many publishes in flight at once.
//!
//! Typical wiring, per broker in the config:
//!
//! ```no_run
//! # async fn wire() -> Result<(), Box<dyn std::error::Error>> {
//! use delayd_adapters::amqp::{AmqpSink, AmqpSource, BrokerConnections, ExchangeType, SinkConfig, SourceConfig};
//! let rabbit = BrokerConnections::new("amqp://guest:guest@127.0.0.1:5672/%2f")?;
//! let source = AmqpSource::start(
//!     rabbit.consume.clone(),
//!     SourceConfig::new("delayd.orders").with_exchange("orders.delayed", ExchangeType::Topic),
//! )?;
//! let sink = AmqpSink::new(rabbit.publish.clone(), SinkConfig::default());
//! sink.declare_queue("delayd.invalid").await?;
//! # drop(source); Ok(()) }
//! ```

pub mod connection;
pub mod convert;
pub mod endpoints;
pub mod packed;
pub mod sink;
pub mod source;
pub mod state;
pub mod stream;
pub mod tls;
pub mod topology;

pub use connection::{AmqpError, Backoff, Broker, BrokerConnections, BrokerOptions};
pub use convert::ConvertError;
pub use endpoints::{redact_url, AmqpSettings, EndpointError, Endpoints};
pub use sink::{AmqpSink, SinkConfig};
pub use source::{AmqpSource, SourceConfig};
pub use tls::{TlsError, TlsOptions};
pub use topology::{ExchangeType, UnknownExchangeType};
