//! `delayd healthcheck`: asks a running delayd's admin listener whether it
//! is alive (`/healthz`) or ready (`/readyz`), for a container `HEALTHCHECK`
//! or an `exec` probe, so an image needs no curl.
//!
//! The address is `--http`, else `http.listen` of the config (`--config` /
//! `DELAYD_CONFIG`, then the `DELAYD_HTTP__LISTEN` environment, as for
//! `delayd run`). A wildcard listener (`0.0.0.0:9464`, `[::]:9464`) is
//! asked on loopback. Exit 0 when the answer is 200, 1 otherwise, with the
//! reason on stderr.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use crate::client::Client;
use crate::config::Config;

#[derive(Debug, Args)]
pub struct HealthcheckArgs {
    /// Admin listener (host:port). Default: http.listen of the config.
    #[arg(long)]
    pub http: Option<String>,
    /// Config file to take http.listen from.
    #[arg(short, long, env = "DELAYD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Ask `/readyz` (every route consuming) instead of `/healthz` (alive).
    #[arg(long)]
    pub ready: bool,
    /// Give up after this long (e.g. `2s`, `500ms`).
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

pub fn run(args: HealthcheckArgs) -> anyhow::Result<()> {
    let addr = match &args.http {
        Some(a) => a.clone(),
        None => {
            let config = Config::load(args.config.as_deref())?;
            anyhow::ensure!(
                !config.http.listen.is_empty(),
                "http.listen is empty: the admin listener is off, nothing to ask"
            );
            config.http.listen
        }
    };
    let addr = loopback_for(&addr);
    let path = if args.ready { "/readyz" } else { "/healthz" };
    let mut client = Client::new(addr.clone(), None);
    client.timeout = args.timeout;
    let response = client
        .request("GET", path)
        .map_err(|e| anyhow::anyhow!(e.detail()))
        .with_context(|| format!("GET {path} on {addr}"))?;
    let body = String::from_utf8_lossy(&response.body);
    anyhow::ensure!(
        response.status == 200,
        "GET {path} on {addr}: {} {}",
        response.status,
        body.trim()
    );
    println!("{path} on {addr}: {}", body.trim());
    Ok(())
}

/// A wildcard listen address is asked on loopback.
fn loopback_for(addr: &str) -> String {
    match addr.parse::<SocketAddr>() {
        Ok(SocketAddr::V4(a)) if a.ip().is_unspecified() => format!("127.0.0.1:{}", a.port()),
        Ok(SocketAddr::V6(a)) if a.ip().is_unspecified() => format!("[::1]:{}", a.port()),
        _ => addr.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wildcard_listener_is_asked_on_loopback() {
        assert_eq!(loopback_for("0.0.0.0:9464"), "127.0.0.1:9464");
        assert_eq!(loopback_for("[::]:9464"), "[::1]:9464");
        assert_eq!(loopback_for("10.0.0.7:9464"), "10.0.0.7:9464");
        assert_eq!(loopback_for("delayd:9464"), "delayd:9464");
    }
}
