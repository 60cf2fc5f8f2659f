use super::*;

const GOOD: &str = r#"
[wal]
dir = "/tmp/x"

[brokers.rabbit]
kind = "amqp"
url = "amqp://guest:guest@127.0.0.1:5672/%2f"

[[routes]]
name = "orders"
from = { broker = "rabbit", queue = "delayd.orders", exchange = "orders.delayed", exchange_type = "topic" }
to = { broker = "rabbit", exchange = "orders" }
"#;

#[test]
fn design_example_parses() {
    let c = Config::from_toml_str(GOOD).unwrap();
    assert_eq!(c.routes[0].from.queue.as_deref(), Some("delayd.orders"));
    assert_eq!(c.http.listen, "127.0.0.1:9464");
    assert_eq!(c.routes[0].mode, Mode::Delay);
}

#[test]
fn type_error_names_key_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("delayd.toml");
    std::fs::write(
        &path,
        GOOD.replace("[wal]\n", "[wal]\nsegment_bytes = \"big\"\n"),
    )
    .unwrap();
    let e = Config::load(Some(&path)).unwrap_err().to_string();
    assert!(e.contains("wal.segment_bytes"), "{e}");
    assert!(e.contains("delayd.toml"), "{e}");
}

#[test]
fn unknown_broker_names_route_key_and_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("routes.toml");
    std::fs::write(
        &path,
        GOOD.replace("to = { broker = \"rabbit\"", "to = { broker = \"nope\""),
    )
    .unwrap();
    let e = Config::load(Some(&path)).unwrap_err().to_string();
    assert!(e.contains("routes[0].to.broker"), "{e}");
    assert!(e.contains("routes.toml"), "{e}");
}

#[test]
fn unknown_key_is_rejected() {
    let e = Config::from_toml_str(&GOOD.replace("[wal]\n", "[wal]\ndri = 1\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("dri"), "{e}");
}

#[test]
fn durations_accept_text_and_millis() {
    let c = Config::from_toml_str(&format!(
        "[engine]\nmax_delay = \"2d\"\nretry_initial = 50\n{GOOD}"
    ))
    .unwrap();
    assert_eq!(c.engine.max_delay, Duration::from_secs(2 * 86400));
    assert_eq!(c.engine.retry_initial, Duration::from_millis(50));
    assert!(Config::from_toml_str(&format!("[engine]\nmax_delay = \"soon\"\n{GOOD}")).is_err());
}

#[test]
fn public_listener_needs_a_token() {
    let e = Config::from_toml_str(&format!("[http]\nlisten = \"0.0.0.0:9464\"\n{GOOD}"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("http.listen") && e.contains("token"), "{e}");
    Config::from_toml_str(&format!(
        "[http]\nlisten = \"0.0.0.0:9464\"\ntoken = \"s3cret\"\n{GOOD}"
    ))
    .unwrap();
}

#[test]
#[allow(clippy::result_large_err)] // figment::Jail's closure signature
fn environment_overrides_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("d.toml");
    std::fs::write(&path, GOOD).unwrap();
    figment::Jail::expect_with(|jail| {
        jail.set_env("DELAYD_WAL__DIR", "/var/lib/delayd");
        jail.set_env("DELAYD_CONFIG", "/etc/delayd.toml"); // the CLI's, not a key
        let c = Config::load(Some(&path)).map_err(|e| e.to_string())?;
        assert_eq!(c.wal.dir, PathBuf::from("/var/lib/delayd"));
        Ok(())
    });
}
