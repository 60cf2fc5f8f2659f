//! Secrets from files: a password given only in a file logs delayd in and
//! shows up nowhere (its whole log, `/readyz`, `delayd check`); a missing
//! file fails `delayd check` and `delayd run` with the key that names it
//! and the path.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::tls::wait_log_line;
use common::{
    amqp_url, config_toml, delayd_cli, must_replace, now_ms, run_until_exit, toml_string,
    unique_suffix, DelaydOptions, Names, Setup, DEADLINE,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;

fn rabbitmqctl(args: &[&str]) {
    let out = Command::new("rabbitmqctl")
        .args(args)
        .output()
        .expect("cannot run rabbitmqctl");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A RabbitMQ user of its own with a random password, deleted on drop.
struct User {
    name: String,
    password: String,
}

impl User {
    fn new() -> User {
        let suffix = unique_suffix().replace('.', "-");
        let user = User {
            name: format!("delayd-it-{suffix}"),
            // Long and unlike anything else in a log.
            password: format!("pw-{suffix}-{}", now_ms() * 7919),
        };
        rabbitmqctl(&["add_user", &user.name, &user.password]);
        rabbitmqctl(&["set_permissions", "-p", "/", &user.name, ".*", ".*", ".*"]);
        user
    }
}

impl Drop for User {
    fn drop(&mut self) {
        let _ = Command::new("rabbitmqctl")
            .args(["delete_user", &self.name])
            .output();
    }
}

/// The harness's URL for the test broker, as `user` without a password.
fn url_without_password(user: &str) -> String {
    let url = amqp_url();
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{user}@{host}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_only_in_a_file_logs_in_and_shows_nowhere() {
    let user = User::new();
    let dir = tempfile::tempdir().unwrap();
    let password_file = dir.path().join("amqp-password");
    // As a Kubernetes secret or `echo` leaves it: one trailing line break.
    std::fs::write(&password_file, format!("{}\n", user.password)).unwrap();

    let names = Names::new("secret-file");
    let url_line = format!("url = {}", toml_string(&amqp_url()));
    let with_file = format!(
        "url = {}\npassword_file = {}",
        toml_string(&url_without_password(&user.name)),
        toml_string(password_file.to_str().unwrap())
    );
    let mut s = Setup::start(names, &[], DelaydOptions::default()).await;
    // Restart the setup's delayd on the same WAL with the file-only config.
    s.delayd.sigterm_and_wait(DEADLINE).await;
    let config = std::fs::read_to_string(s.delayd.config_path()).unwrap();
    assert!(config.contains(&url_line));
    std::fs::write(
        s.delayd.config_path(),
        must_replace(&config, &url_line, &with_file),
    )
    .unwrap();
    assert!(!std::fs::read_to_string(s.delayd.config_path())
        .unwrap()
        .contains(&user.password));
    s.delayd.restart().await;
    wait_log_line(
        &s.delayd,
        &["AMQP connection open", "delayd-consume"],
        DEADLINE,
    )
    .await;

    let mut headers = FieldTable::default();
    headers.insert("x-delay".into(), AMQPValue::LongLongInt(300));
    let props = BasicProperties::default()
        .with_message_id("secret-1".into())
        .with_headers(headers);
    s.client
        .publish(&s.names.from_exchange, "k", b"hello", props)
        .await;
    let mut receiver = s.client.consume(&s.names.target_queue).await;
    receiver.collect_by_message_id(&["secret-1"]).await;
    receiver.close().await;

    let (_, readyz) = s.delayd.http_get("/readyz").expect("GET /readyz");
    let (ok, out, err) = delayd_cli(
        "check",
        &["--config", s.delayd.config_path().to_str().unwrap()],
    );
    assert!(ok, "delayd check: {err}");
    assert!(out.contains(password_file.to_str().unwrap()), "{out}");
    s.delayd.sigterm_and_wait(DEADLINE).await;
    for (what, text) in [
        ("the log", s.delayd.full_log()),
        ("/readyz", readyz),
        ("delayd check", format!("{out}{err}")),
    ] {
        assert!(
            !text.contains(&user.password),
            "the password shows in {what}"
        );
    }
}

/// `delayd check` and `delayd run` on `config` both fail, naming `key` and
/// `path`.
async fn both_fail_naming(config: &str, key: &str, path: &str) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("delayd.toml");
    std::fs::write(&file, config).unwrap();
    let (ok, out, err) = delayd_cli("check", &["--config", file.to_str().unwrap()]);
    assert!(!ok, "delayd check passed: {out}");
    assert!(err.contains(key) && err.contains(path), "check: {err}");
    let (ok, output) = run_until_exit(config, Duration::from_secs(30)).await;
    assert!(!ok, "delayd run started: {output}");
    assert!(
        output.contains(key) && output.contains(path),
        "run: {output}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_secret_file_fails_check_and_run_naming_the_key_and_the_path() {
    let names = Names::new("secret-missing");
    let dir = tempfile::tempdir().unwrap();
    let http = "127.0.0.1:0".parse().unwrap();
    let base = config_toml(
        &names,
        &dir.path().join("wal"),
        http,
        &DelaydOptions::default(),
    );
    let url_line = format!("url = {}", toml_string(&amqp_url()));
    let missing = "/nonexistent/delayd-it/secret";

    let amqp = must_replace(
        &base,
        &url_line,
        &format!(
            "url = {}\npassword_file = \"{missing}\"",
            toml_string(&url_without_password("delayd"))
        ),
    );
    both_fail_naming(&amqp, "brokers.rabbit.password_file", missing).await;

    let ca = must_replace(
        &base,
        &url_line,
        &format!(
            "url = \"amqps://delayd@127.0.0.1:5671/%2f\"\ntls = {{ ca_file = \"{missing}\" }}"
        ),
    );
    both_fail_naming(&ca, "brokers.rabbit.tls.ca_file", missing).await;

    let kafka = format!(
        "{base}\n[brokers.kafka]\nkind = \"kafka\"\nbootstrap = \"127.0.0.1:9092\"\n\
         properties = {{ \"sasl.password\" = \"${{file:{missing}}}\" }}\n"
    );
    both_fail_naming(
        &kafka,
        "brokers.kafka.properties.\"sasl.password\"",
        missing,
    )
    .await;
}
