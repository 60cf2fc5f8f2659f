//! The HTTP client for delayd's own admin API: `delayd messages` (blocking,
//! no runtime of its own), `delayd bench --metrics` (async, scrapes
//! `/metrics`) and the integration-test harness all talk to a delayd over
//! plain HTTP/1.1 on a local or cluster address.
//!
//! It is a thin layer over hyper-util's client (hyper is in the tree anyway
//! through axum), so framing, chunked bodies and the `Host` header are
//! hyper's; this module only adds the bearer token, one deadline for the
//! whole exchange and errors that name the address. One request per
//! connection: nothing is pooled, so a blocking caller can drop its
//! short-lived runtime after each request.

use std::error::Error as StdError;
use std::io;
use std::time::Duration;

use http_body_util::{BodyExt, Empty};
use hyper::body::Bytes;
use hyper::header::{ACCEPT, AUTHORIZATION};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// The cause of `Connect` and `Io` is their `source` (shown by `{:#}` of
/// anyhow, or [`ClientError::detail`]), not part of their `Display`.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the admin API at {addr}")]
    Connect {
        addr: String,
        #[source]
        source: io::Error,
    },
    /// A failure after connecting, or no complete answer within the timeout
    /// (kind `TimedOut`).
    #[error("admin API at {addr}")]
    Io {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("admin API at {addr} sent a malformed response: {reason}")]
    Malformed { addr: String, reason: String },
}

impl ClientError {
    /// The error and its causes on one line.
    pub fn detail(&self) -> String {
        chain(self)
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
            .join(": ")
    }
}

/// An HTTP response: status and body.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

/// Admin API client for `addr` (host:port), with an optional bearer token.
pub struct Client {
    pub addr: String,
    pub token: Option<String>,
    /// Deadline for connecting, and for the whole exchange.
    pub timeout: Duration,
}

impl Client {
    pub fn new(addr: impl Into<String>, token: Option<String>) -> Self {
        Self {
            addr: addr.into(),
            token,
            timeout: Duration::from_secs(10),
        }
    }

    /// Send `method path` (path includes the query string) and wait for the
    /// whole answer, blocking the calling thread. Inside a tokio runtime
    /// (where a nested `block_on` would panic) the request runs on a thread
    /// of its own.
    pub fn request(&self, method: &str, path: &str) -> Result<Response, ClientError> {
        let run = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|source| ClientError::Io {
                    addr: self.addr.clone(),
                    source,
                })?
                .block_on(self.send(method, path))
        };
        if tokio::runtime::Handle::try_current().is_err() {
            return run();
        }
        std::thread::scope(|s| {
            s.spawn(run)
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
        })
    }

    /// Send `method path` (path includes the query string) from async code.
    pub async fn send(&self, method: &str, path: &str) -> Result<Response, ClientError> {
        match tokio::time::timeout(self.timeout, self.exchange(method, path)).await {
            Ok(result) => result,
            Err(_) => Err(ClientError::Io {
                addr: self.addr.clone(),
                source: io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no complete answer within {:?}", self.timeout),
                ),
            }),
        }
    }

    async fn exchange(&self, method: &str, path: &str) -> Result<Response, ClientError> {
        let mut request = hyper::Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr))
            .header(ACCEPT, "application/json");
        if let Some(token) = &self.token {
            request = request.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request
            .body(Empty::<Bytes>::new())
            .map_err(|e| ClientError::Connect {
                addr: self.addr.clone(),
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("cannot make a request of {method} {path}: {e}"),
                ),
            })?;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(self.timeout));
        let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .build::<_, Empty<Bytes>>(connector);
        let response = client.request(request).await.map_err(|e| {
            if e.is_connect() {
                let kind = io_kind(&e).unwrap_or(io::ErrorKind::Other);
                ClientError::Connect {
                    addr: self.addr.clone(),
                    source: io::Error::new(kind, causes(&e)),
                }
            } else {
                self.failed(&e)
            }
        })?;
        let status = response.status().as_u16();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| self.failed(&e))?
            .to_bytes()
            .to_vec();
        Ok(Response { status, body })
    }

    /// A failure after connecting: the peer's fault (Malformed) or the
    /// connection's (Io).
    fn failed(&self, e: &(dyn StdError + 'static)) -> ClientError {
        let addr = self.addr.clone();
        let parse = chain(e)
            .filter_map(|e| e.downcast_ref::<hyper::Error>())
            .any(|e| e.is_parse() || e.is_parse_status() || e.is_parse_too_large());
        if parse {
            return ClientError::Malformed {
                addr,
                reason: causes(e),
            };
        }
        let kind = io_kind(e).unwrap_or(io::ErrorKind::Other);
        ClientError::Io {
            addr,
            source: io::Error::new(kind, causes(e)),
        }
    }
}

fn chain<'a>(
    e: &'a (dyn StdError + 'static),
) -> impl Iterator<Item = &'a (dyn StdError + 'static)> {
    std::iter::successors(Some(e), |&e| e.source())
}

fn io_kind(e: &(dyn StdError + 'static)) -> Option<io::ErrorKind> {
    chain(e).find_map(|e| e.downcast_ref::<io::Error>().map(io::Error::kind))
}

/// The causes of `e` as one line, without hyper-util's generic outer
/// "client error (...)" when it has a more precise cause.
fn causes(e: &(dyn StdError + 'static)) -> String {
    let skip = usize::from(e.is::<hyper_util::client::legacy::Error>() && e.source().is_some());
    let mut parts: Vec<String> = Vec::new();
    for text in chain(e).skip(skip).map(|e| e.to_string()) {
        if parts.last() != Some(&text) {
            parts.push(text);
        }
    }
    parts.join(": ")
}

/// Percent-encode a query-string value (everything but unreserved characters).
pub fn encode_query_value(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::thread::JoinHandle;

    use super::*;

    /// A one-shot server: answers the first connection with `answer`
    /// (raw bytes) and returns the request head it read.
    fn serve(answer: &'static [u8]) -> (String, JoinHandle<String>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap() == 1 {
                head.push(byte[0]);
            }
            stream.write_all(answer).unwrap();
            String::from_utf8(head).unwrap()
        });
        (addr, server)
    }

    #[test]
    fn sends_the_token_and_reads_fixed_and_chunked_bodies() {
        let (addr, server) = serve(b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}");
        let client = Client::new(&addr, Some("s3cret".into()));
        let r = client.request("GET", "/v1/messages?route=a%20b").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (404, b"{}".as_slice()));
        let head = server.join().unwrap().to_ascii_lowercase();
        assert!(
            head.starts_with("get /v1/messages?route=a%20b http/1.1\r\n"),
            "{head}"
        );
        assert!(head.contains("authorization: bearer s3cret\r\n"), "{head}");
        assert!(head.contains(&format!("host: {addr}\r\n")), "{head}");

        let (addr, server) = serve(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
        );
        let r = Client::new(addr, None).request("DELETE", "/x").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, b"abcde".as_slice()));
        let head = server.join().unwrap().to_ascii_lowercase();
        assert!(head.starts_with("delete /x http/1.1\r\n"), "{head}");
        assert!(!head.contains("authorization"), "{head}");
    }

    #[tokio::test]
    async fn works_blocking_inside_a_runtime_and_async() {
        let (addr, server) = serve(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
        let r = Client::new(addr, None).request("GET", "/").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, b"ok".as_slice()));
        server.join().unwrap();
        let (addr, server) = serve(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
        let r = Client::new(addr, None).send("GET", "/").await.unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, b"ok".as_slice()));
        server.join().unwrap();
    }

    #[test]
    fn errors_name_the_address() {
        // Nothing listens on a port just given back.
        let addr = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .to_string();
        let err = Client::new(&addr, None).request("GET", "/").unwrap_err();
        assert!(
            matches!(&err, ClientError::Connect { source, .. }
                if source.kind() == io::ErrorKind::ConnectionRefused),
            "{err:?}"
        );
        assert!(err.to_string().contains(&addr), "{err}");
        let detail = err.detail();
        assert!(
            detail.starts_with(&err.to_string()) && detail.contains("refused"),
            "{detail}"
        );

        let (addr, server) = serve(b"garbage\r\n\r\n");
        let err = Client::new(&addr, None).request("GET", "/").unwrap_err();
        assert!(matches!(err, ClientError::Malformed { .. }), "{err:?}");
        assert!(err.to_string().contains(&addr), "{err}");
        server.join().unwrap();

        // Accepts (the backlog does) but never answers.
        let silent = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = silent.local_addr().unwrap().to_string();
        let mut client = Client::new(&addr, None);
        client.timeout = Duration::from_millis(200);
        let err = client.request("GET", "/").unwrap_err();
        assert!(
            matches!(&err, ClientError::Io { source, .. }
                if source.kind() == io::ErrorKind::TimedOut),
            "{err:?}"
        );
        assert!(err.to_string().contains(&addr), "{err}");
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(encode_query_value("a b/&=é"), "a%20b%2F%26%3D%C3%A9");
        assert_eq!(encode_query_value("order-1.x_y~"), "order-1.x_y~");
    }
}
