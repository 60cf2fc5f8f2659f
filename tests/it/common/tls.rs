//! The TLS side of the harness: the test certificates and passwords of
//! `scripts/tls.sh` (`DELAYD_TLS_DIR`, default /var/tmp/delayd-tls), the
//! TLS RabbitMQ node of `RABBITMQ=tls scripts/rabbitmq.sh`
//! (amqps://127.0.0.1:5671, every client shows a certificate), and the
//! example config files the docs show, run as they are.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use lapin::options::ConfirmSelectOptions;
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::{Connection, ConnectionProperties};

use super::{toml_string, wait_for, Client, Delayd, DEADLINE};

/// Where `scripts/tls.sh` put the certificates and passwords.
pub fn tls_dir() -> PathBuf {
    std::env::var_os("DELAYD_TLS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/delayd-tls"))
}

/// The path the example configs name for the test certificates.
pub const EXAMPLE_TLS_DIR: &str = "/var/tmp/delayd-tls";

pub fn tls_file(name: &str) -> PathBuf {
    tls_dir().join(name)
}

fn read_secret(name: &str) -> String {
    let path = tls_file(name);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/tls.sh)", path.display()))
        .trim_end()
        .to_owned()
}

/// Password of user `delayd` on the TLS node.
pub fn rabbitmq_password() -> String {
    read_secret("rabbitmq-password")
}

/// SCRAM-SHA-512 password of Kafka user `delayd`.
pub fn kafka_password() -> String {
    read_secret("kafka-password")
}

pub const TLS_NODE: &str = "delayd-tls@localhost";

/// A lapin client of the TLS node as user `delayd`, with lapin's own TLS
/// (not delayd's): the test CA and the client certificate.
pub async fn tls_client(name: &str) -> Client {
    let url = format!("amqps://delayd:{}@localhost:5671/%2f", rabbitmq_password());
    let read = |f: &str| std::fs::read(tls_file(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
    let tls = OwnedTLSConfig {
        identity: Some(OwnedIdentity::PKCS8 {
            pem: read("client.crt"),
            key: read("client.key"),
        }),
        cert_chain: Some(String::from_utf8(read("ca.crt")).expect("PEM is text")),
    };
    let props = ConnectionProperties::default().with_connection_name(name.into());
    let runtime = lapin::runtime::default_runtime().expect("a runtime");
    let connection = Connection::connect_with_config(&url, props, tls, runtime)
        .await
        .unwrap_or_else(|e| {
            panic!("cannot connect to the TLS node (RABBITMQ=tls scripts/rabbitmq.sh): {e}")
        });
    let channel = connection.create_channel().await.expect("channel");
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    Client {
        connection,
        channel,
    }
}

/// `rabbitmqctl -n NODE ARGS...`'s standard output; panics on failure.
pub fn rabbitmqctl(node: &str, args: &[&str]) -> String {
    let out = Command::new("rabbitmqctl")
        .arg("-n")
        .arg(node)
        .args(args)
        .output()
        .expect("cannot run rabbitmqctl");
    assert!(
        out.status.success(),
        "rabbitmqctl -n {node} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An example config file of `config/examples`, as a test runs it: its WAL
/// directory, admin address and test certificate paths replaced, then each
/// `(from, to)` of `replace` (queue, exchange and topic names) applied.
pub fn example_config(
    file: &str,
    wal: &Path,
    http: SocketAddr,
    replace: &[(&str, &str)],
) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("config/examples")
        .join(file);
    let mut text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let wal = toml_string(wal.to_str().expect("UTF-8 temp path"));
    for (from, to) in [
        ("dir = \"data/wal\"", format!("dir = {wal}")),
        (
            "listen = \"127.0.0.1:9464\"",
            format!("listen = \"{http}\""),
        ),
        (EXAMPLE_TLS_DIR, tls_dir().display().to_string()),
    ] {
        assert!(text.contains(from), "{file} no longer has {from}");
        text = text.replace(from, &to);
    }
    for (from, to) in replace {
        assert!(text.contains(from), "{file} has no {from}");
        text = text.replace(from, to);
    }
    text
}

/// Waits until `/readyz` answers 200: every route consumes.
pub async fn wait_readyz(delayd: &Delayd) {
    wait_for("/readyz to answer 200", DEADLINE, || async {
        matches!(delayd.http_get("/readyz"), Ok((200, _))).then_some(())
    })
    .await;
}

/// Waits until delayd's log has a line containing every one of `parts`,
/// and returns it.
pub async fn wait_log_line(delayd: &Delayd, parts: &[&str], within: Duration) -> String {
    let what = format!("a log line with {parts:?}");
    wait_for(&what, within, || async {
        delayd
            .log_tail(2000)
            .lines()
            .find(|l| parts.iter().all(|p| l.contains(p)))
            .map(str::to_owned)
    })
    .await
}
