//! A tiny blocking HTTP/1.1 client for the admin API, used by
//! `delayd messages`. The admin API is plain HTTP on a local or cluster
//! address, so a full HTTP stack is not worth a dependency: one request per
//! connection (`Connection: close`), with a fixed or chunked body.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach the admin API at {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("admin API at {addr}: {source}")]
    Io {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("admin API at {addr} sent a malformed response: {reason}")]
    Malformed { addr: String, reason: String },
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

    /// Send `method path` (path includes the query string).
    pub fn request(&self, method: &str, path: &str) -> Result<Response, ClientError> {
        let io = |source| ClientError::Io {
            addr: self.addr.clone(),
            source,
        };
        let connect = |source| ClientError::Connect {
            addr: self.addr.clone(),
            source,
        };
        let sockaddr = self
            .addr
            .to_socket_addrs()
            .map_err(connect)?
            .next()
            .ok_or_else(|| {
                connect(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "address resolves to nothing",
                ))
            })?;
        let mut stream = TcpStream::connect_timeout(&sockaddr, self.timeout).map_err(connect)?;
        stream.set_read_timeout(Some(self.timeout)).map_err(io)?;
        stream.set_write_timeout(Some(self.timeout)).map_err(io)?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nAccept: application/json\r\nConnection: close\r\n",
            self.addr
        );
        if let Some(token) = &self.token {
            head.push_str(&format!("Authorization: Bearer {token}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes()).map_err(io)?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).map_err(io)?;
        parse(&raw).map_err(|reason| ClientError::Malformed {
            addr: self.addr.clone(),
            reason,
        })
    }
}

fn parse(raw: &[u8]) -> Result<Response, String> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers")?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|_| "headers are not UTF-8")?;
    let body = &raw[split + 4..];
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .ok_or("no status line")?;
    let chunked = lines.any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.trim().eq_ignore_ascii_case("transfer-encoding")
                && v.trim().eq_ignore_ascii_case("chunked")
        })
    });
    let body = if chunked {
        dechunk(body)?
    } else {
        body.to_vec()
    };
    Ok(Response { status, body })
}

fn dechunk(mut buf: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let end = buf
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("chunk size line not terminated")?;
        let size_text = std::str::from_utf8(&buf[..end]).map_err(|_| "bad chunk size")?;
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16).map_err(|_| "bad chunk size")?;
        buf = &buf[end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if buf.len() < size + 2 {
            return Err("chunk ends early".into());
        }
        out.extend_from_slice(&buf[..size]);
        buf = &buf[size + 2..];
    }
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
    use super::*;

    #[test]
    fn parses_fixed_and_chunked_bodies() {
        let r = parse(b"HTTP/1.1 404 Not Found\r\ncontent-length: 2\r\n\r\n{}").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (404, b"{}".as_slice()));
        let r = parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n")
            .unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, b"abcde".as_slice()));
        assert!(parse(b"garbage").is_err());
        assert!(parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n").is_err());
    }

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(encode_query_value("a b/&=é"), "a%20b%2F%26%3D%C3%A9");
        assert_eq!(encode_query_value("order-1.x_y~"), "order-1.x_y~");
    }
}
