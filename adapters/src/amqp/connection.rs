//! Connections to one RabbitMQ broker: lazily opened, reopened with
//! exponential back-off, handing out channels.
//!
//! delayd opens two connections per broker ([`BrokerConnections`]): one for
//! consumers and one for publishers. RabbitMQ applies flow control
//! (`connection.blocked`, credit flow) per connection to publishers; keeping
//! them apart means a publisher throttled by the broker never stalls the
//! consumers' acks and deliveries. Each connection carries a client-provided
//! name (`delayd-consume` / `delayd-publish`) shown in the management UI.
//!
//! A [`Broker`] holds at most one live connection. [`Broker::try_channel`]
//! makes a single attempt: it reuses the connection while it is up, reconnects
//! when it is down, and refuses at once (without touching the network) while
//! the back-off delay after a failed attempt has not elapsed, so hundreds of
//! callers cannot hammer a broker that is down. [`Broker::channel`] waits and
//! retries until it gets a channel. The back-off starts at 100 ms and doubles
//! up to 5 s; failures are logged at `warn`.
//!
//! lapin's own automatic recovery is not used: after a reconnect every user of
//! the broker re-creates its channel and re-declares what it needs, so a
//! delivery tag from a dead channel can never be confused with one of the new
//! channel.
//!
//! A broker may have several endpoints (a cluster's nodes, see
//! [`Endpoints`]): every connection attempt tries them in order and keeps
//! the first that answers, so after its node dies a connection moves to the
//! next one. It stays there while it lives: a node that comes back is used
//! again at the next reconnect, not sooner (moving a live connection would
//! cost redeliveries for nothing).
//! `amqps://` endpoints use delayd's own TLS client ([`super::tls`]).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use lapin::tcp::AsyncTcpStream;
use lapin::uri::AMQPUri;
use lapin::{Channel, Connection, ConnectionProperties, ConnectionStatus};
use tokio::sync::Mutex;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::endpoints::{AmqpSettings, Endpoint, EndpointError, Endpoints};
use super::tls::{describe_tls_failure, TlsConnector};

/// Errors of the AMQP adapter's connection and topology layer.
#[derive(Debug, thiserror::Error)]
pub enum AmqpError {
    /// The broker's URLs or TLS settings are unusable.
    #[error(transparent)]
    Settings(#[from] EndpointError),
    /// Connecting (TCP, TLS or the AMQP handshake) failed.
    #[error("cannot connect to {endpoint}: {source}")]
    Connect {
        endpoint: String,
        #[source]
        source: lapin::Error,
    },
    /// The TLS handshake failed; `reason` says what to look at.
    #[error("cannot connect to {endpoint}: {reason}")]
    Tls { endpoint: String, reason: String },
    /// Every endpoint of a broker with several failed (each one's error).
    #[error("cannot connect to any of {count} endpoints: {errors}")]
    AllEndpoints { count: usize, errors: String },
    /// Connecting did not finish within the connect timeout.
    #[error("connecting to {endpoint} timed out after {timeout:?}")]
    ConnectTimeout { endpoint: String, timeout: Duration },
    /// A previous attempt failed and the back-off delay has not elapsed.
    #[error("not connected to {endpoint}; next attempt in {retry_in:?}")]
    BackingOff {
        endpoint: String,
        retry_in: Duration,
    },
    /// Opening a channel (or putting it in the needed mode) failed.
    #[error("cannot open a channel on {endpoint}: {source}")]
    Channel {
        endpoint: String,
        #[source]
        source: lapin::Error,
    },
    /// A stream could not be read as expected.
    #[error("stream {0}")]
    Stream(String),
    /// A stream ingress's checkpoint cannot be read.
    #[error(transparent)]
    Checkpoint(#[from] super::stream::CheckpointError),
    /// Declaring or binding a queue or exchange failed.
    #[error("{what} failed: {source}")]
    Topology {
        what: String,
        #[source]
        source: lapin::Error,
    },
    /// A name does not fit an AMQP short string.
    #[error(transparent)]
    Convert(#[from] super::convert::ConvertError),
}

/// How long [`Broker::close`] waits for the broker's close-ok.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// How often a channel being opened looks at its connection's state.
const LIVENESS_POLL: Duration = Duration::from_millis(20);

/// How an [`open_while_connected`] wait ended.
#[derive(Debug)]
enum Opening<T> {
    Done(T),
    /// The connection left the connected state first.
    Lost,
    TimedOut,
}

/// Waits for `open` (a channel.open) while `connected()` holds, at most
/// `timeout`. lapin marks a connection failed a moment after its I/O loop
/// stops; a channel asked for in between is never answered nor failed, so
/// waiting for it alone took the whole connect timeout (10 s) after a
/// node's death: every publish of that connection 10 s late.
async fn open_while_connected<T>(
    open: impl std::future::Future<Output = T>,
    connected: impl Fn() -> bool,
    timeout: Duration,
) -> Opening<T> {
    let lost = async {
        while connected() {
            tokio::time::sleep(LIVENESS_POLL).await;
        }
    };
    tokio::select! {
        done = open => Opening::Done(done),
        () = lost => Opening::Lost,
        () = tokio::time::sleep(timeout) => Opening::TimedOut,
    }
}

/// Exponential back-off: `initial`, doubling, capped at `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    /// Starts at `initial` and doubles up to `max`.
    pub fn new(initial: Duration, max: Duration) -> Self {
        // A zero delay would never grow: retry in a tight loop.
        let initial = initial.max(Duration::from_millis(1));
        Self {
            initial,
            max: max.max(initial),
            next: initial,
        }
    }

    /// The delay to wait now; the following one will be twice as long (capped).
    pub fn next_delay(&mut self) -> Duration {
        let delay = self.next;
        self.next = (self.next * 2).min(self.max);
        delay
    }

    /// Back to the initial delay, after a success.
    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

impl Default for Backoff {
    /// 100 ms doubling to 5 s.
    fn default() -> Self {
        Self::new(Duration::from_millis(100), Duration::from_secs(5))
    }
}

/// Settings of one [`Broker`] connection.
#[derive(Debug, Clone)]
pub struct BrokerOptions {
    /// Client-provided connection name (`connection_name` client property),
    /// shown in the RabbitMQ management UI and by `rabbitmqctl list_connections`.
    pub connection_name: String,
    /// First delay after a failed connection attempt; it doubles on each
    /// further failure. Default 100 ms.
    pub backoff_initial: Duration,
    /// Cap of the delay between connection attempts. Default 5 s.
    pub backoff_max: Duration,
    /// Give up a connection attempt (TCP + TLS + AMQP handshake) after this
    /// long. Default 10 s.
    pub connect_timeout: Duration,
}

impl BrokerOptions {
    /// Default options with the given connection name.
    pub fn named(connection_name: impl Into<String>) -> Self {
        Self {
            connection_name: connection_name.into(),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
        }
    }
}

struct State {
    connection: Option<Connection>,
    backoff: Backoff,
    /// No new attempt before this instant (set after a failure).
    next_attempt: Option<Instant>,
}

/// One lazily (re)connected AMQP connection to a broker.
pub struct Broker {
    endpoints: Arc<Endpoints>,
    /// Index of the endpoint last connected to (for logs).
    current: StdMutex<usize>,
    options: BrokerOptions,
    state: Mutex<State>,
    /// Status of the current connection, readable without waiting.
    status: StdMutex<Option<ConnectionStatus>>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker")
            .field("endpoints", &self.endpoints.labels())
            .field("connection_name", &self.options.connection_name)
            .finish_non_exhaustive()
    }
}

impl Broker {
    /// A broker reached at `url` (`amqp://user:pass@host:port/vhost`, or
    /// `amqps://` with the system's CAs). Nothing is connected until a
    /// channel is asked for.
    pub fn new(url: &str, options: BrokerOptions) -> Result<Self, AmqpError> {
        let endpoints = Endpoints::new(&AmqpSettings::url(url))?;
        Ok(Self::with_endpoints(Arc::new(endpoints), options))
    }

    /// A broker reached at any of `endpoints` (tried in order).
    pub fn with_endpoints(endpoints: Arc<Endpoints>, options: BrokerOptions) -> Self {
        let backoff = Backoff::new(options.backoff_initial, options.backoff_max);
        Self {
            endpoints,
            current: StdMutex::new(0),
            options,
            state: Mutex::new(State {
                connection: None,
                backoff,
                next_attempt: None,
            }),
            status: StdMutex::new(None),
        }
    }

    /// `host:port/vhost` of the endpoint connected to last (the first one
    /// before any connection), for logs: never the credentials.
    pub fn endpoint(&self) -> String {
        let index = *self.current.lock().unwrap_or_else(|e| e.into_inner());
        self.endpoints.list()[index].label().to_owned()
    }

    /// Every endpoint of the broker, in the order they are tried.
    pub fn endpoints(&self) -> &Arc<Endpoints> {
        &self.endpoints
    }

    /// The connection name sent to the broker.
    pub fn connection_name(&self) -> &str {
        &self.options.connection_name
    }

    /// Whether the connection is currently open (for readiness checks).
    pub fn is_connected(&self) -> bool {
        self.status
            .lock()
            .map(|s| s.as_ref().is_some_and(ConnectionStatus::connected))
            .unwrap_or(false)
    }

    /// Whether the broker has blocked this connection (`connection.blocked`:
    /// a memory or disk alarm). It then reads nothing more from it, so a
    /// publish would hang until the alarm clears.
    pub fn is_blocked(&self) -> bool {
        self.status
            .lock()
            .map(|s| s.as_ref().is_some_and(|s| s.connected() && s.blocked()))
            .unwrap_or(false)
    }

    /// Opens a channel with a single attempt: on the current connection if it
    /// is up, else on a new one. Refuses with [`AmqpError::BackingOff`] while
    /// the delay after a failed attempt runs.
    pub async fn try_channel(&self) -> Result<Channel, AmqpError> {
        let mut state = self.state.lock().await;
        let mut replace = false;
        if let Some(connection) = &state.connection {
            if connection.status().connected() {
                // Bounded: on a connection that died without lapin noticing
                // yet, channel.open may never be answered.
                let opened = open_while_connected(
                    connection.create_channel(),
                    || connection.status().connected(),
                    self.options.connect_timeout,
                )
                .await;
                match opened {
                    Opening::Done(Ok(channel)) => return Ok(channel),
                    Opening::Done(Err(error)) if connection.status().connected() => {
                        // lapin 4 never frees the id of a channel the broker
                        // closed (a publish to a missing exchange, say), so
                        // after channel_max of those a live connection opens
                        // no more channels. A new connection starts afresh;
                        // channels still open on the old one fail and retry.
                        warn!(endpoint = %self.endpoint(), name = %self.options.connection_name,
                              %error, "cannot open a channel on a live connection; replacing the connection");
                        replace = true;
                    }
                    Opening::Done(Err(error)) => {
                        warn!(endpoint = %self.endpoint(), name = %self.options.connection_name,
                              %error, "AMQP connection lost");
                    }
                    Opening::Lost => {
                        warn!(endpoint = %self.endpoint(), name = %self.options.connection_name,
                              "AMQP connection lost while opening a channel; reconnecting");
                    }
                    Opening::TimedOut => {
                        warn!(endpoint = %self.endpoint(), name = %self.options.connection_name,
                              "opening a channel timed out; replacing the connection");
                        replace = true;
                    }
                }
            } else {
                warn!(endpoint = %self.endpoint(), name = %self.options.connection_name,
                      "AMQP connection lost; reconnecting");
            }
        }
        if let Some(old) = state.connection.take().filter(|_| replace) {
            tokio::spawn(async move {
                if let Err(error) = old.close(200, "replaced".into()).await {
                    debug!(%error, "closing the replaced AMQP connection");
                }
            });
        }

        if let Some(at) = state.next_attempt {
            let now = Instant::now();
            if now < at {
                return Err(AmqpError::BackingOff {
                    endpoint: self.endpoint(),
                    retry_in: at - now,
                });
            }
        }

        match self.connect().await {
            Ok(connection) => {
                let channel = match open_while_connected(
                    connection.create_channel(),
                    || connection.status().connected(),
                    self.options.connect_timeout,
                )
                .await
                {
                    Opening::Done(channel) => channel,
                    Opening::Lost | Opening::TimedOut => {
                        // Lost again before its first channel: the caller
                        // retries, and the next attempt reconnects.
                        Err(
                            lapin::ErrorKind::InvalidConnectionState(lapin::ConnectionState::Error)
                                .into(),
                        )
                    }
                };
                state.backoff.reset();
                state.next_attempt = None;
                if let Ok(mut status) = self.status.lock() {
                    *status = Some(connection.status().clone());
                }
                state.connection = Some(connection);
                channel.map_err(|source| AmqpError::Channel {
                    endpoint: self.endpoint(),
                    source,
                })
            }
            Err(error) => {
                let delay = state.backoff.next_delay();
                state.next_attempt = Some(Instant::now() + delay);
                warn!(name = %self.options.connection_name, %error, retry_in = ?delay,
                      "AMQP connection attempt failed");
                Err(error)
            }
        }
    }

    /// Opens a channel, waiting through the back-off and retrying until it
    /// succeeds. Cancel-safe: dropping the future abandons the attempt.
    pub async fn channel(&self) -> Channel {
        loop {
            match self.try_channel().await {
                Ok(channel) => return channel,
                Err(AmqpError::BackingOff { retry_in, .. }) => tokio::time::sleep(retry_in).await,
                Err(error) => {
                    // Connection failures already armed the back-off; anything
                    // else (channel creation on a live connection) waits a beat.
                    debug!(%error, "retrying channel creation");
                    let delay = {
                        let mut state = self.state.lock().await;
                        match state.next_attempt {
                            Some(at) => at.saturating_duration_since(Instant::now()),
                            None => state.backoff.next_delay(),
                        }
                    };
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// Closes the connection (if any); the next channel request reconnects.
    /// Waits at most [`CLOSE_WAIT`] for the broker: a blocked connection is
    /// never read, so its close would never be answered.
    pub async fn close(&self) {
        let mut state = self.state.lock().await;
        if let Some(connection) = state.connection.take() {
            if connection.status().connected() {
                let close = connection.close(200, "delayd shutting down".into());
                match tokio::time::timeout(CLOSE_WAIT, close).await {
                    Ok(Ok(())) => {}
                    Ok(Err(error)) => debug!(%error, "closing AMQP connection"),
                    Err(_) => {
                        warn!(endpoint = %self.endpoint(), name = %self.options.connection_name,
                                    "the broker did not answer connection.close in time; dropping the connection")
                    }
                }
            }
            info!(endpoint = %self.endpoint(), name = %self.options.connection_name,
                  "AMQP connection closed");
        }
    }

    /// A new connection of its own, outside the shared one (the
    /// broker-kept store's lock lives and dies with its connection).
    pub async fn open_dedicated(&self) -> Result<Connection, AmqpError> {
        self.connect().await
    }

    /// [`Broker::open_dedicated`], trying the endpoints from the `first`th
    /// on (modulo their number, wrapping around), so that a caller can move
    /// off a node that answers connections but not requests. Returns the
    /// connection and the index of the endpoint it reached.
    pub async fn open_dedicated_from(
        &self,
        first: usize,
    ) -> Result<(Connection, usize), AmqpError> {
        self.connect_from(first).await
    }

    /// Tries every endpoint in order; the first that answers wins.
    async fn connect(&self) -> Result<Connection, AmqpError> {
        Ok(self.connect_from(0).await?.0)
    }

    async fn connect_from(&self, first: usize) -> Result<(Connection, usize), AmqpError> {
        let all = self.endpoints.list();
        let first = first % all.len().max(1);
        let list: Vec<(usize, &Endpoint)> = all
            .iter()
            .enumerate()
            .cycle()
            .skip(first)
            .take(all.len())
            .collect();
        let mut failures = Vec::new();
        for (at, &(index, endpoint)) in list.iter().enumerate() {
            match self.connect_to(endpoint).await {
                Ok(connection) => {
                    *self.current.lock().unwrap_or_else(|e| e.into_inner()) = index;
                    info!(endpoint = %endpoint.label(), name = %self.options.connection_name,
                          "AMQP connection open");
                    return Ok((connection, index));
                }
                Err(error) if list.len() == 1 => return Err(error),
                Err(error) => {
                    if let Some((_, next)) = list.get(at + 1) {
                        warn!(name = %self.options.connection_name, %error,
                              next = %next.label(), "AMQP endpoint failed; trying the next");
                    }
                    failures.push(error.to_string());
                }
            }
        }
        Err(AmqpError::AllEndpoints {
            count: list.len(),
            errors: failures.join("; "),
        })
    }

    async fn connect_to(&self, endpoint: &Endpoint) -> Result<Connection, AmqpError> {
        let name = self.options.connection_name.clone();
        let properties = ConnectionProperties::default().with_connection_name(name.into());
        let uri = endpoint.uri.clone();
        let tls = self.endpoints.tls().filter(|_| endpoint.is_tls()).cloned();
        let server_name = tls
            .as_ref()
            .map(|t| t.name_for(&uri.authority.host).to_owned());
        // The handshake's own failure, kept aside: lapin wraps it.
        let handshake_failure = Arc::new(StdMutex::new(None::<String>));
        let attempt = async {
            match tls {
                Some(tls) => connect_tls(uri, properties, tls, handshake_failure.clone()).await,
                None => Connection::connect_uri(uri, properties).await,
            }
        };
        let label = endpoint.label().to_owned();
        match tokio::time::timeout(self.options.connect_timeout, attempt).await {
            Ok(Ok(connection)) => Ok(connection),
            Ok(Err(source)) => {
                let recorded = handshake_failure
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take();
                // A TLS 1.3 broker refuses a client certificate after the
                // handshake: its alert comes with the first AMQP read.
                let reason = recorded.or_else(|| {
                    server_name
                        .as_deref()
                        .and_then(|name| describe_tls_failure(&source, name))
                });
                match reason {
                    Some(reason) => Err(AmqpError::Tls {
                        endpoint: label,
                        reason,
                    }),
                    None => Err(AmqpError::Connect {
                        endpoint: label,
                        source,
                    }),
                }
            }
            Err(_) => Err(AmqpError::ConnectTimeout {
                endpoint: label,
                timeout: self.options.connect_timeout,
            }),
        }
    }
}

/// An `amqps://` connection through delayd's TLS client: TCP to the URL's
/// host, the handshake against the configured server name, then lapin's
/// AMQP handshake on that stream. A failed TLS handshake is described in
/// `failure`.
async fn connect_tls(
    uri: AMQPUri,
    properties: ConnectionProperties,
    tls: Arc<TlsConnector>,
    failure: Arc<StdMutex<Option<String>>>,
) -> Result<Connection, lapin::Error> {
    let runtime = lapin::runtime::default_runtime()?;
    Connection::connector(
        uri,
        runtime,
        async move |uri: AMQPUri, runtime| {
            let host = uri.authority.host.as_str();
            let addresses: Vec<SocketAddr> = tokio::net::lookup_host((host, uri.authority.port))
                .await?
                .collect();
            let stream = AsyncTcpStream::connect(&runtime, addresses).await?;
            let name = tls.name_for(host);
            match stream.into_rustls(tls.connector(), name).await {
                Ok(stream) => Ok(stream),
                Err(error) => {
                    if let Some(reason) = describe_tls_failure(&error, name) {
                        *failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(reason);
                    }
                    Err(error.into())
                }
            }
        },
        properties,
    )
    .await
}

/// The two connections delayd keeps to one broker: consumers and publishers
/// apart, so publisher flow control never blocks consuming and acking.
#[derive(Debug, Clone)]
pub struct BrokerConnections {
    /// Shared by every [`AmqpSource`](super::AmqpSource) of this broker
    /// (connection name `delayd-consume`).
    pub consume: Arc<Broker>,
    /// Shared by the [`AmqpSink`](super::AmqpSink) of this broker
    /// (connection name `delayd-publish`).
    pub publish: Arc<Broker>,
}

impl BrokerConnections {
    /// Connection name of the consuming connection.
    pub const CONSUME_NAME: &'static str = "delayd-consume";
    /// Connection name of the publishing connection.
    pub const PUBLISH_NAME: &'static str = "delayd-publish";

    /// Both connections to the broker at `url`, with default options. Nothing
    /// connects until first used.
    pub fn new(url: &str) -> Result<Self, AmqpError> {
        let endpoints = Endpoints::new(&AmqpSettings::url(url))?;
        Ok(Self::with_endpoints(Arc::new(endpoints)))
    }

    /// Both connections to a broker reached at any of `endpoints`.
    pub fn with_endpoints(endpoints: Arc<Endpoints>) -> Self {
        Self {
            consume: Arc::new(Broker::with_endpoints(
                endpoints.clone(),
                BrokerOptions::named(Self::CONSUME_NAME),
            )),
            publish: Arc::new(Broker::with_endpoints(
                endpoints,
                BrokerOptions::named(Self::PUBLISH_NAME),
            )),
        }
    }

    /// Whether both connections are open.
    pub fn is_connected(&self) -> bool {
        self.consume.is_connected() && self.publish.is_connected()
    }

    /// Closes both connections.
    pub async fn close(&self) {
        self.consume.close().await;
        self.publish.close().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A channel.open its connection never answers ends as soon as the
    /// connection is seen failed, not at the timeout (a node's death made
    /// every publish 10 s late).
    #[tokio::test(start_paused = true)]
    async fn a_channel_open_ends_when_its_connection_fails() {
        let connected = std::sync::atomic::AtomicBool::new(true);
        let started = Instant::now();
        let never = std::future::pending::<()>();
        let open = open_while_connected(
            never,
            || connected.load(std::sync::atomic::Ordering::SeqCst),
            Duration::from_secs(10),
        );
        let fail = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            connected.store(false, std::sync::atomic::Ordering::SeqCst);
        };
        let (opening, ()) = tokio::join!(open, fail);
        assert!(matches!(opening, Opening::Lost), "{opening:?}");
        assert!(
            started.elapsed() < Duration::from_millis(200),
            "{:?}",
            started.elapsed()
        );

        // Still bounded on a connection that stays up but never answers.
        let opening = open_while_connected(
            std::future::pending::<()>(),
            || true,
            Duration::from_secs(10),
        )
        .await;
        assert!(matches!(opening, Opening::TimedOut));
        // And an answer is passed on.
        let opening = open_while_connected(async { 7 }, || true, Duration::from_secs(10)).await;
        assert!(matches!(opening, Opening::Done(7)));
    }

    #[test]
    fn backoff_doubles_to_the_cap_and_resets() {
        let mut b = Backoff::default();
        let delays: Vec<_> = (0..8).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
    }

    #[test]
    fn bad_url_is_refused_and_endpoint_hides_credentials() {
        assert!(matches!(
            Broker::new("not a url", BrokerOptions::named("x")),
            Err(AmqpError::Settings(EndpointError::InvalidUrl { .. }))
        ));
        let b = Broker::new(
            "amqp://user:secret@rabbit:5673/%2f",
            BrokerOptions::named("x"),
        )
        .unwrap();
        assert_eq!(b.endpoint(), "rabbit:5673/");
        assert!(!b.is_connected());
    }

    #[tokio::test]
    async fn unreachable_broker_backs_off_without_reconnecting() {
        let mut options = BrokerOptions::named("test");
        options.backoff_initial = Duration::from_secs(60);
        // Port 1 on localhost: connection refused at once.
        let b = Broker::new("amqp://guest:guest@127.0.0.1:1/%2f", options).unwrap();
        assert!(!matches!(
            b.try_channel().await,
            Err(AmqpError::BackingOff { .. }) | Ok(_)
        ));
        assert!(matches!(
            b.try_channel().await,
            Err(AmqpError::BackingOff { .. })
        ));
    }
}
