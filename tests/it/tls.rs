//! delayd over TLS to the TLS RabbitMQ node (`RABBITMQ=tls
//! scripts/rabbitmq.sh`: amqps://127.0.0.1:5671, `verify_peer` and
//! `fail_if_no_peer_cert`, the `rabbitmq_auth_mechanism_ssl` plugin), with
//! the example config `config/examples/rabbitmq-tls.toml` run as the docs
//! show it: a private CA, a client certificate, the password in a file; then
//! the same with the certificate as the login (EXTERNAL); then a wrong CA, a
//! wrong server name and no client certificate, each failing with an error
//! that says which.

use crate::common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use common::tls::{
    example_config, rabbitmq_password, rabbitmqctl, tls_client, wait_log_line, wait_readyz,
    TLS_NODE,
};
use common::{delayd_cli, now_ms, toml_string, Client, Delayd, Names, DEADLINE, LATE_MS};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

/// `config/examples/rabbitmq-tls.toml` with the names of `names`, and
/// `edit` applied to the text (to try other TLS settings).
fn tls_config(names: &Names, wal: &Path, http: SocketAddr, edit: &[(&str, &str)]) -> String {
    let mut replace = vec![
        (
            "name = \"orders\"",
            format!("name = {}", toml_string(&names.route)),
        ),
        ("\"delayd.orders\"", toml_string(&names.from_queue)),
        ("\"orders.delayed\"", toml_string(&names.from_exchange)),
        (
            "exchange = \"orders\"",
            format!("exchange = {}", toml_string(&names.to_exchange)),
        ),
    ];
    replace.extend(edit.iter().map(|(a, b)| (*a, b.to_string())));
    let replace: Vec<(&str, &str)> = replace.iter().map(|(a, b)| (*a, b.as_str())).collect();
    example_config("rabbitmq-tls.toml", wal, http, &replace)
}

/// Publishes `count` messages with `x-delay` 500..1500 ms to the source
/// exchange and checks each arrives on the target queue, none early.
async fn delayed_messages_arrive(client: &Client, names: &Names, count: u32) {
    let mut sent = Vec::new();
    for i in 0..count {
        let delay = 500 + u64::from(i % 5) * 250;
        let mut headers = FieldTable::default();
        headers.insert("x-delay".into(), AMQPValue::LongLongInt(delay as i64));
        let props = BasicProperties::default()
            .with_message_id(format!("m{i}").into())
            .with_headers(headers);
        let at = now_ms();
        client
            .publish(&names.from_exchange, "order.created", b"over TLS", props)
            .await;
        sent.push((format!("m{i}"), at, delay));
    }
    let mut receiver = client.consume(&names.target_queue).await;
    let ids: Vec<&str> = sent.iter().map(|(id, _, _)| id.as_str()).collect();
    let got = receiver.collect_by_message_id(&ids).await;
    for (id, at, delay) in &sent {
        let g = got
            .iter()
            .find(|g| g.message_id() == Some(id))
            .expect("collected");
        assert!(
            g.at_ms >= at + delay,
            "{id} early: sent {at}, delay {delay}, got {}",
            g.at_ms
        );
        assert!(
            g.at_ms < at + delay + LATE_MS,
            "{id} late: {} ms",
            g.at_ms - at - delay
        );
        assert_eq!(g.delivery.data, b"over TLS");
    }
    receiver.close().await;
}

/// delayd's connections to the TLS node: (name, ssl, user, auth mechanism).
fn tls_connections() -> Vec<(String, String, String, String)> {
    rabbitmqctl(
        TLS_NODE,
        &[
            "list_connections",
            "client_properties",
            "ssl",
            "user",
            "auth_mechanism",
            "-q",
            "--no-table-headers",
        ],
    )
    .lines()
    .filter_map(|line| {
        let name = ["delayd-consume", "delayd-publish"]
            .into_iter()
            .find(|n| line.contains(&format!("\"{n}\"")))?;
        let mut fields = line.rsplit('\t');
        let auth = fields.next()?.trim().to_owned();
        let user = fields.next()?.trim().to_owned();
        let ssl = fields.next()?.trim().to_owned();
        Some((name.to_owned(), ssl, user, auth))
    })
    .collect()
}

async fn delete_names(client: &Client, names: &Names) {
    use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
    for q in [&names.from_queue, &names.target_queue] {
        let _ = client
            .channel
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    for e in [&names.from_exchange, &names.to_exchange] {
        let _ = client
            .channel
            .exchange_delete(e.as_str().into(), ExchangeDeleteOptions::default())
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tls_example_delivers_with_a_private_ca_a_client_certificate_and_a_password_file() {
    let names = Names::new("tls");
    let client = tls_client("delayd-it-tls").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    let mut delayd = Delayd::start_with(|wal, http| tls_config(&names, wal, http, &[])).await;
    wait_readyz(&delayd).await;

    delayed_messages_arrive(&client, &names, 10).await;

    let connections = tls_connections();
    let ours: Vec<_> = connections
        .iter()
        .filter(|(_, ssl, user, auth)| ssl == "true" && user == "delayd" && auth == "PLAIN")
        .collect();
    assert!(
        ours.len() >= 2,
        "delayd's consume and publish connections over TLS, user delayd, PLAIN: {connections:?}"
    );

    // The password is in a file only: not in the log, /readyz, or check.
    let password = rabbitmq_password();
    let (_, readyz) = delayd.http_get("/readyz").expect("GET /readyz");
    let (ok, out, err) = delayd_cli(
        "check",
        &["--config", delayd.config_path().to_str().unwrap()],
    );
    assert!(ok, "delayd check: {err}");
    assert!(out.contains("password from"), "check names the file: {out}");
    delayd.sigterm_and_wait(DEADLINE).await;
    for (what, text) in [
        ("the log", delayd.full_log()),
        ("/readyz", readyz),
        ("delayd check", format!("{out}{err}")),
    ] {
        assert!(!text.contains(&password), "the password shows in {what}");
    }
    delete_names(&client, &names).await;
    client.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_certificate_logs_in_with_external() {
    let names = Names::new("tls-external");
    let client = tls_client("delayd-it-tls-external").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    // The docs' one-line change: no password_file, auth = "external".
    let edit = [
        (
            "password_file = \"/var/tmp/delayd-tls/rabbitmq-password\"\n",
            "",
        ),
        (
            "[brokers.rabbit.tls]\n",
            "[brokers.rabbit.tls]\nauth = \"external\"\n",
        ),
    ];
    let delayd = Delayd::start_with(|wal, http| {
        let text = tls_config(&names, wal, http, &[]);
        let dir = common::tls::tls_dir().display().to_string();
        let mut text = text;
        for (a, b) in &edit {
            let a = a.replace("/var/tmp/delayd-tls", &dir);
            assert!(text.contains(&a), "the example changed: {a}");
            text = text.replace(&a, b);
        }
        text
    })
    .await;
    wait_readyz(&delayd).await;
    delayed_messages_arrive(&client, &names, 3).await;
    let connections = tls_connections();
    let external: Vec<_> = connections
        .iter()
        .filter(|(_, ssl, user, auth)| ssl == "true" && user == "delayd" && auth == "EXTERNAL")
        .collect();
    assert!(
        external.len() >= 2,
        "delayd's connections log in as the certificate's CN with EXTERNAL: {connections:?}"
    );
    drop(delayd);
    delete_names(&client, &names).await;
    client.close().await;
}

/// Starts delayd with the example config edited by `edit`, waits for a log
/// line with all of `expect`, and returns it.
async fn fails_saying(test: &str, edit: &[(&str, &str)], expect: &[&str]) -> String {
    let names = Names::new(test);
    let dir = common::tls::tls_dir().display().to_string();
    let delayd = Delayd::start_with(|wal, http| {
        let mut text = tls_config(&names, wal, http, &[]);
        for (a, b) in edit {
            let (a, b) = (
                a.replace("/var/tmp/delayd-tls", &dir),
                b.replace("/var/tmp/delayd-tls", &dir),
            );
            assert!(text.contains(&a), "the example changed: {a}");
            text = text.replace(&a, &b);
        }
        text
    })
    .await;
    let line = wait_log_line(&delayd, expect, DEADLINE).await;
    let (status, _) = delayd.http_get("/readyz").expect("GET /readyz");
    assert_eq!(status, 503, "not ready while it cannot connect");
    line
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_a_wrong_server_name_or_no_client_certificate_fail_saying_which() {
    let started = Instant::now();
    let line = fails_saying(
        "tls-wrong-ca",
        &[(
            "ca_file = \"/var/tmp/delayd-tls/ca.crt\"",
            "ca_file = \"/var/tmp/delayd-tls/other-ca.crt\"",
        )],
        &[
            "127.0.0.1:5671",
            "not issued by a CA delayd trusts",
            "tls.ca_file",
        ],
    )
    .await;
    println!("wrong CA: {line}");

    let line = fails_saying(
        "tls-wrong-name",
        &[(
            "server_name = \"localhost\"",
            "server_name = \"rabbit.wrong.example\"",
        )],
        &[
            "not valid for the server name \"rabbit.wrong.example\"",
            "tls.server_name",
        ],
    )
    .await;
    println!("wrong server name: {line}");

    let line = fails_saying(
        "tls-no-cert",
        &[
            (
                "cert_file = \"/var/tmp/delayd-tls/client.crt\"",
                "# no client certificate",
            ),
            ("key_file = \"/var/tmp/delayd-tls/client.key\"", "# no key"),
        ],
        &["requires a client certificate", "tls.cert_file"],
    )
    .await;
    println!("no client certificate: {line}");
    assert!(started.elapsed() < Duration::from_secs(120));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turning_peer_verification_off_takes_a_key_and_is_logged() {
    let names = Names::new("tls-unverified");
    let client = tls_client("delayd-it-tls-unverified").await;
    client
        .declare_target(&names.to_exchange, &names.target_queue)
        .await;
    let dir = common::tls::tls_dir().display().to_string();
    // A CA that did not sign the broker's certificate: only a delayd that
    // verifies nothing connects.
    let edit = [(
        format!("ca_file = \"{dir}/ca.crt\""),
        format!("ca_file = \"{dir}/other-ca.crt\"\nverify_peer = false"),
    )];
    let delayd = Delayd::start_with(|wal, http| {
        let text = tls_config(&names, wal, http, &[]);
        common::must_replace(&text, &edit[0].0, &edit[0].1)
    })
    .await;
    wait_log_line(
        &delayd,
        &["WARN", "tls.verify_peer = false", "not verified"],
        DEADLINE,
    )
    .await;
    wait_readyz(&delayd).await;
    delayed_messages_arrive(&client, &names, 2).await;
    let (ok, out, err) = delayd_cli(
        "check",
        &["--config", delayd.config_path().to_str().unwrap()],
    );
    assert!(ok, "{err}");
    assert!(out.contains("PEER NOT VERIFIED"), "{out}");
    drop(delayd);
    delete_names(&client, &names).await;
    client.close().await;
}
