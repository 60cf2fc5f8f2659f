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

#[test]
fn backpressure_limits_parse_and_max_disk_below_two_segments_is_refused() {
    let c = Config::from_toml_str(&format!(
        "[engine]\nmax_pending = 5\nmax_disk = 1073741824\n{GOOD}"
    ))
    .unwrap();
    assert_eq!((c.engine.max_pending, c.engine.max_disk), (5, 1 << 30));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("delayd.toml");
    std::fs::write(&path, format!("[engine]\nmax_disk = 1000\n{GOOD}")).unwrap();
    let e = Config::load(Some(&path)).unwrap_err().to_string();
    assert!(e.contains("engine.max_disk"), "{e}");
    assert!(e.contains("delayd.toml"), "{e}");
}

const TTL: &str = r#"
[brokers.rabbit]
kind = "amqp"
url = "amqp://guest:guest@127.0.0.1:5672/%2f"

[[routes]]
name = "wait"
mode = "ttl"
from = { broker = "rabbit", queue = "orders.wait" }
to = { broker = "rabbit", exchange = "orders" }
"#;

#[test]
fn ttl_and_retry_routes_parse() {
    let c = Config::from_toml_str(&format!(
        "{TTL}message_ttl = \"30s\"\ndead_letter_queue = \"orders.wait.old\"\n"
    ))
    .unwrap();
    assert_eq!(c.routes[0].mode, Mode::Ttl);
    assert_eq!(c.routes[0].message_ttl, Some(Duration::from_secs(30)));
    let c = Config::from_toml_str(&format!(
        "{}park = {{ queue = \"orders.parked\" }}\n[routes.retry]\ndelays = [\"10s\", \"1m\", 600000]\nmax_attempts = 3\nwork_queue = \"orders.work\"\n",
        TTL.replace("\"ttl\"", "\"retry\"")
    ))
    .unwrap();
    let retry = c.routes[0].retry.as_ref().unwrap();
    assert_eq!(
        retry.delays,
        [10, 60, 600].map(Duration::from_secs).to_vec()
    );
    assert_eq!(retry.max_attempts, Some(3));
    Config::from_toml_str(&format!(
        "{}[routes.retry]\nbackoff = {{ initial = \"1s\", multiplier = 3.0, max = \"10m\", jitter = 0.1 }}\nmax_attempts = 5\n",
        TTL.replace("\"ttl\"", "\"retry\"")
    ))
    .unwrap();
}

#[test]
fn mode_keys_are_checked_with_their_names() {
    let bad = |extra: &str, key: &str| {
        let text = format!("{TTL}{extra}");
        let e = Config::from_toml_str(&text).unwrap_err().to_string();
        assert!(e.contains(key), "{key}: {e}");
    };
    let retry = TTL.replace("\"ttl\"", "\"retry\"");
    let bad_retry = |extra: &str, key: &str| {
        let e = Config::from_toml_str(&format!("{retry}{extra}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains(key), "{key}: {e}");
    };
    bad("park = { queue = \"p\" }\n", "routes[0].park");
    bad("[routes.retry]\ndelays = [\"1s\"]\n", "routes[0].retry");
    bad("message_ttl = \"soon\"\n", "message_ttl");
    bad_retry("", "routes[0].retry");
    bad_retry("message_ttl = \"1s\"\n", "routes[0].message_ttl");
    bad_retry(
        "[routes.retry]\nmax_attempts = 3\n",
        "routes[0].retry.delays",
    );
    bad_retry(
        "[routes.retry]\ndelays = [\"1s\"]\nbackoff = { initial = \"1s\", max = \"1m\" }\n",
        "routes[0].retry.delays",
    );
    bad_retry(
        "[routes.retry]\nbackoff = { initial = \"1s\", max = \"1m\" }\n",
        "routes[0].retry.max_attempts",
    );
    bad_retry(
        "[routes.retry]\nbackoff = { initial = \"1s\", max = \"1m\", jitter = 2.0 }\nmax_attempts = 2\n",
        "routes[0].retry.backoff.jitter",
    );
    bad_retry(
        "[routes.retry]\nbackoff = { initial = \"1m\", max = \"1s\" }\nmax_attempts = 2\n",
        "routes[0].retry.backoff.max",
    );
    bad_retry(
        "[routes.retry]\ndelays = [\"1s\"]\nmax_attempts = 0\n",
        "routes[0].retry.max_attempts",
    );
    bad_retry(
        "park = { queue = \"p\", exchange = \"x\" }\n[routes.retry]\ndelays = [\"1s\"]\n",
        "routes[0].park",
    );
}

#[test]
fn shipped_config_and_examples_are_valid() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut files = vec![root.join("delayd.toml")];
    for entry in std::fs::read_dir(root.join("examples")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            files.push(path);
        }
    }
    assert!(files.len() >= 4, "{files:?}");
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        if let Err(e) = Config::from_toml_str(&text) {
            panic!("{}: {e}", file.display());
        }
    }
}

#[test]
fn an_empty_token_counts_as_no_token() {
    for token in ["\"\"", "\"   \""] {
        let e = Config::from_toml_str(&format!(
            "[http]\nlisten = \"0.0.0.0:9464\"\ntoken = {token}\n{GOOD}"
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("http.listen") && e.contains("token"), "{e}");
    }
}

#[test]
fn durations_too_large_to_compute_with_are_refused_by_name() {
    // u64::MAX seconds: beyond what a millisecond clock or f64 seconds hold.
    const HUGE: &str = "\"18446744073709551615s\"";
    let e = Config::from_toml_str(&format!("[engine]\nmax_delay = {HUGE}\n{GOOD}"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("engine.max_delay"), "{e}");
    let e = Config::from_toml_str(&format!("[engine]\nretry_max = {HUGE}\n{GOOD}"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("engine.retry_max"), "{e}");
    let e = Config::from_toml_str(&format!("{GOOD}max_delay = {HUGE}\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("routes[0].max_delay"), "{e}");
    // A retry back-off is bounded by max_delay, so a huge one is refused too.
    let e = Config::from_toml_str(&format!(
        "[engine]\nmax_delay = {HUGE}\n{}[routes.retry]\nbackoff = {{ initial = \"1s\", max = {HUGE} }}\nmax_attempts = 3\n",
        TTL.replace("\"ttl\"", "\"retry\"")
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("max_delay"), "{e}");
}

#[test]
fn the_wal_directory_is_not_created_by_default() {
    assert!(!Config::from_toml_str(GOOD).unwrap().wal.create_dir);
    let c = Config::from_toml_str(&GOOD.replace("[wal]\n", "[wal]\ncreate_dir = true\n")).unwrap();
    assert!(c.wal.create_dir);
}

#[test]
fn queue_type_and_arguments_parse_and_are_checked() {
    let quorum = GOOD.replace(
        "exchange_type = \"topic\" }",
        "exchange_type = \"topic\", queue_type = \"quorum\", queue_arguments = { \"x-delivery-limit\" = 5, \"x-single-active-consumer\" = true } }",
    );
    let c = Config::from_toml_str(&quorum).unwrap();
    assert_eq!(c.routes[0].from.queue_type, Some(QueueKind::Quorum));
    assert_eq!(
        c.routes[0].from.queue_arguments["x-delivery-limit"],
        QueueArgument::Int(5)
    );
    assert_eq!(
        c.routes[0].from.queue_arguments["x-single-active-consumer"],
        QueueArgument::Bool(true)
    );
    let e = Config::from_toml_str(&quorum.replace("\"quorum\"", "\"lazy\""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("routes.0.from.queue_type"), "{e}");
    // Spelled as AMQP spells them, as in the validation of old: not "TOPIC".
    for bad in ["\"TOPIC\"", "\"x-delayed-message\""] {
        let e = Config::from_toml_str(&GOOD.replace("\"topic\"", bad))
            .unwrap_err()
            .to_string();
        assert!(e.contains("exchange_type"), "{e}");
    }
    let e = Config::from_toml_str(&quorum.replace("x-delivery-limit", "x-queue-type"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("routes[0].from.queue_arguments"), "{e}");
}

#[test]
fn a_stream_ingress_is_refused_where_its_offset_cannot_live() {
    let stream = GOOD.replace(
        "exchange_type = \"topic\" }",
        "exchange_type = \"topic\", queue_type = \"stream\" }",
    );
    let c = Config::from_toml_str(&stream).unwrap();
    assert_eq!(c.routes[0].from.queue_type, Some(QueueKind::Stream));
    // The broker-kept store keeps the offset in the state stream, with
    // partitions too (one owner per partition's stream).
    let partitioned = stream.replace("name = \"orders\"", "name = \"orders\"\npartitions = 4");
    Config::from_toml_str(&format!("[store]\nkind = \"broker\"\n{stream}"))
        .expect("a stream ingress on the broker-kept store");
    Config::from_toml_str(&format!("[store]\nkind = \"broker\"\n{partitioned}"))
        .expect("stream partitions on the broker-kept store");
    let e = Config::from_toml_str(&partitioned).unwrap_err().to_string();
    assert!(e.contains("routes[0].partitions"), "{e}");
    assert!(e.contains("store.kind"), "{e}");
    let e = Config::from_toml_str(
        &stream.replace("name = \"orders\"", "name = \"orders\"\nmode = \"ttl\""),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("routes[0].mode"), "{e}");
    let e = Config::from_toml_str(&stream.replace("[wal]\n", "[engine]\nhandoff = true\n[wal]\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("engine.handoff"), "{e}");
    for bad in [
        "\"x-max-age\" = \"7 days\"",
        "\"x-max-age\" = 7",
        "\"x-max-length-bytes\" = \"10GB\"",
    ] {
        let e = Config::from_toml_str(&stream.replace(
            "queue_type = \"stream\" }",
            &format!("queue_type = \"stream\", queue_arguments = {{ {bad} }} }}"),
        ))
        .unwrap_err()
        .to_string();
        assert!(e.contains("routes[0].from.queue_arguments"), "{bad}: {e}");
    }
}

const KAFKA: &str = r#"
[brokers.kafka]
kind = "kafka"
bootstrap = "127.0.0.1:9092"

[[routes]]
name = "kafka-delays"
from = { broker = "kafka", topics = ["orders.delay"], group = "delayd" }
to = { broker = "kafka", topic = "orders" }
"#;

#[test]
fn the_store_is_local_by_default_and_broker_turns_hand_off_on() {
    let c = Config::from_toml_str(KAFKA).unwrap();
    assert_eq!(c.store.kind, StoreKind::Local);
    assert!(!c.handoff());
    let c = Config::from_toml_str(&format!("[store]\nkind = \"broker\"\n{KAFKA}")).unwrap();
    assert_eq!(c.store.kind, StoreKind::Broker);
    assert_eq!(c.store.topic("kafka-delays"), "delayd.state.kafka-delays");
    assert!(c.handoff(), "hand-off defaults to on with the broker store");
    let c = Config::from_toml_str(&format!(
        "[store]\nkind = \"broker\"\n[engine]\nhandoff = false\n{KAFKA}"
    ))
    .unwrap();
    assert!(!c.handoff(), "an explicit handoff = false wins");
}

#[test]
fn the_lock_lease_is_5s_by_default_and_kept_within_1s_to_60s() {
    let c = Config::from_toml_str(GOOD).unwrap();
    assert_eq!(c.store.lease, std::time::Duration::from_secs(5));
    let c = Config::from_toml_str(&format!("[store]\nlease = \"1s\"\n{GOOD}")).unwrap();
    assert_eq!(c.store.lease, std::time::Duration::from_secs(1));
    for bad in ["500ms", "61s"] {
        let e = Config::from_toml_str(&format!("[store]\nlease = \"{bad}\"\n{GOOD}"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("store.lease"), "{e}");
    }
}

#[test]
fn a_tiny_checkpoint_floor_is_refused_naming_the_key() {
    let e = Config::from_toml_str(&format!(
        "[store]\nkind = \"broker\"\ncheckpoint_records = 5\n{GOOD}"
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("store.checkpoint_records"), "{e}");
}

#[test]
fn the_broker_store_takes_rabbitmq_routes_with_their_stream_names() {
    let c = Config::from_toml_str(&format!("[store]\nkind = \"broker\"\n{GOOD}")).unwrap();
    assert_eq!(c.store.kind, StoreKind::Broker);
    assert_eq!(c.store.topic("orders"), "delayd.state.orders");
}

#[test]
fn the_broker_store_needs_a_valid_state_topic_name() {
    let e = Config::from_toml_str(&format!(
        "[store]\nkind = \"broker\"\ntopic_prefix = \"state/\"\n{KAFKA}"
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("store.topic_prefix"), "{e}");
    let e = Config::from_toml_str(&format!(
        "[store]\nkind = \"broker\"\n{}",
        KAFKA.replace("name = \"kafka-delays\"", "name = \"kafka delays\"")
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("store.topic_prefix") && e.contains("kafka delays"),
        "{e}"
    );
    let e = Config::from_toml_str(&format!("[store]\nkind = \"somewhere\"\n{KAFKA}"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("store.kind"), "{e}");
}

// ------------------------------------------------------- connections, secrets

/// GOOD with its broker section replaced by `broker` (TOML lines).
fn with_broker(broker: &str) -> String {
    GOOD.replace(
        "kind = \"amqp\"\nurl = \"amqp://guest:guest@127.0.0.1:5672/%2f\"\n",
        &format!("kind = \"amqp\"\n{broker}\n"),
    )
}

/// Writes `text` to a config file in `dir` and loads it (files read).
fn load_in(dir: &std::path::Path, text: &str) -> Result<Config, ConfigError> {
    let path = dir.join("delayd.toml");
    std::fs::write(&path, text).unwrap();
    Config::load(Some(&path))
}

#[test]
fn exactly_one_of_url_urls_and_url_file() {
    let e = Config::from_toml_str(&with_broker(
        "url = \"amqp://a/%2f\"\nurls = [\"amqp://b/%2f\"]",
    ))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("brokers.rabbit.url") && e.contains("only one"),
        "{e}"
    );
    let e = Config::from_toml_str(&with_broker(""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("set url, urls or url_file"), "{e}");
    let c = Config::from_toml_str(&with_broker(
        "urls = [\"amqp://guest:guest@a:5672/%2f\", \"amqp://guest:guest@b:5672/%2f\"]",
    ))
    .unwrap();
    match c.connection("rabbit").unwrap() {
        BrokerConnection::Amqp(settings) => assert_eq!(settings.urls.len(), 2),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_password_file_replaces_the_urls_password_and_never_prints() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("password");
    std::fs::write(&secret, "s3cret-from-file\n").unwrap();
    let text = with_broker(&format!(
        "urls = [\"amqp://delayd@a:5672/%2f\"]\npassword_file = {:?}",
        secret.to_str().unwrap()
    ));
    let c = load_in(dir.path(), &text).unwrap();
    let BrokerConnection::Amqp(settings) = c.connection("rabbit").unwrap() else {
        panic!("amqp")
    };
    assert_eq!(settings.password.as_deref(), Some("s3cret-from-file"));
    assert!(!format!("{settings:?} {c:?}").contains("s3cret"));
    let line = describe_broker(&c.brokers["rabbit"]);
    assert!(
        line.contains("password from") && !line.contains("s3cret"),
        "{line}"
    );

    // A password in the URL too is ambiguous.
    let text = with_broker(&format!(
        "url = \"amqp://delayd:other@a:5672/%2f\"\npassword_file = {:?}",
        secret.to_str().unwrap()
    ));
    let e = load_in(dir.path(), &text).unwrap_err().to_string();
    assert!(
        e.contains("brokers.rabbit.password_file") && e.contains("give it once"),
        "{e}"
    );
    assert!(!e.contains("other@"), "the URL's password shows: {e}");
}

#[test]
fn a_missing_file_names_its_key_and_path() {
    let dir = tempfile::tempdir().unwrap();
    for (broker, key) in [
        (
            "url = \"amqp://delayd@a/%2f\"\npassword_file = \"/nonexistent/pw\"",
            "brokers.rabbit.password_file",
        ),
        ("url_file = \"/nonexistent/pw\"", "brokers.rabbit.url_file"),
        (
            "url = \"amqps://a/%2f\"\ntls = { ca_file = \"/nonexistent/pw\" }",
            "brokers.rabbit.tls.ca_file",
        ),
        (
            "url = \"amqps://a/%2f\"\ntls = { cert_file = \"/nonexistent/pw\", key_file = \"/nonexistent/k\" }",
            "brokers.rabbit.tls.cert_file",
        ),
    ] {
        let e = load_in(dir.path(), &with_broker(broker)).unwrap_err().to_string();
        assert!(e.contains(key), "{key}: {e}");
        assert!(e.contains("cannot read /nonexistent/pw"), "{key}: {e}");
        assert!(e.contains("delayd.toml"), "the config file: {e}");
    }
}

#[test]
fn tls_settings_are_checked() {
    for (tls, key) in [
        ("{ cert_file = \"/c\" }", "brokers.rabbit.tls.cert_file"),
        ("{ auth = \"external\" }", "brokers.rabbit.tls.auth"),
        ("{ server_name = \"\" }", "brokers.rabbit.tls.server_name"),
    ] {
        let e = Config::from_toml_str(&with_broker(&format!(
            "url = \"amqps://a/%2f\"\ntls = {tls}"
        )))
        .unwrap_err()
        .to_string();
        assert!(e.contains(key), "{tls}: {e}");
    }
    // TLS settings with an amqp:// URL are a mistake, found when resolved.
    let dir = tempfile::tempdir().unwrap();
    let e = load_in(
        dir.path(),
        &with_broker("url = \"amqp://a/%2f\"\ntls = { verify_peer = false }"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("brokers.rabbit.tls") && e.contains("not amqps://"),
        "{e}"
    );
    // A file that holds no certificate is named.
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let e = load_in(
        dir.path(),
        &with_broker(&format!(
            "url = \"amqps://a/%2f\"\ntls = {{ ca_file = {:?} }}",
            junk.to_str().unwrap()
        )),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("brokers.rabbit.tls.ca_file") && e.contains("junk.pem"),
        "{e}"
    );
}

const KAFKA_SECRETS: &str = r#"
[brokers.kafka]
kind = "kafka"
bootstrap = "127.0.0.1:9092"
client_id = "billing-delayd"

[brokers.kafka.properties]
"security.protocol" = "SASL_SSL"
"sasl.password" = "PASSWORD"

[[routes]]
name = "k"
from = { broker = "kafka", topics = ["a"], group = "g" }
to = { broker = "kafka", topic = "b" }
"#;

#[test]
fn kafka_properties_come_from_files_and_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("kafka-password");
    std::fs::write(&secret, "kafka-s3cret\n").unwrap();
    let text = KAFKA_SECRETS.replace(
        "PASSWORD",
        &format!("${{file:{}}}", secret.to_str().unwrap()),
    );
    let c = load_in(dir.path(), &text).unwrap();
    let BrokerConnection::Kafka(client) = c.connection("kafka").unwrap() else {
        panic!("kafka")
    };
    assert_eq!(client.properties["sasl.password"], "kafka-s3cret");
    assert_eq!(client.client_id.as_deref(), Some("billing-delayd"));
    assert!(!format!("{client:?} {c:?}").contains("kafka-s3cret"));
    let line = describe_broker(&c.brokers["kafka"]);
    assert!(line.contains("sasl.password=${file:"), "{line}");

    // A literal secret is shown as ***.
    let c = Config::from_toml_str(&KAFKA_SECRETS.replace("PASSWORD", "literal-s3cret")).unwrap();
    let line = describe_broker(&c.brokers["kafka"]);
    assert!(
        line.contains("sasl.password=***") && !line.contains("literal-s3cret"),
        "{line}"
    );

    // A variable that is not set is named, with the key.
    let e = load_in(
        dir.path(),
        &KAFKA_SECRETS.replace("PASSWORD", "${env:DELAYD_TEST_UNSET_VARIABLE_27}"),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("brokers.kafka.properties.\"sasl.password\"")
            && e.contains("DELAYD_TEST_UNSET_VARIABLE_27"),
        "{e}"
    );
}

#[test]
fn a_zero_replication_factor_is_refused() {
    let e = Config::from_toml_str(&format!("[store]\nreplication_factor = 0\n{GOOD}"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("store.replication_factor"), "{e}");
}

/// The worked examples in the docs are the files the broker tests run
/// (tests/it/tls.rs, tests/it/kafka_security.rs), from `[brokers` on.
#[test]
fn the_docs_show_the_tested_examples_as_they_are() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for (example, doc) in [
        ("rabbitmq-tls.toml", "docs/configuration.md"),
        ("kafka-sasl-ssl.toml", "docs/kafka.md"),
    ] {
        let text = std::fs::read_to_string(root.join("config/examples").join(example)).unwrap();
        let body = &text[text.find("\n[brokers").expect("a [brokers section") + 1..];
        let shown = std::fs::read_to_string(root.join(doc)).unwrap();
        assert!(
            shown.contains(&format!("```toml\n{body}```")),
            "{doc} does not show {example} from [brokers on as it is"
        );
    }
}

#[test]
fn a_type_error_under_brokers_never_shows_the_value() {
    for (broker, secret) in [
        ("urls = \"amqp://u:s3cret-url@h/%2f\"", "s3cret-url"),
        ("url = [\"amqp://u:s3cret-list@h/%2f\"]", "s3cret-list"),
    ] {
        let e = Config::from_toml_str(&with_broker(broker))
            .unwrap_err()
            .to_string();
        assert!(!e.contains(secret), "{e}");
        assert!(e.contains("brokers.rabbit"), "{e}");
    }
    let e = Config::from_toml_str(&KAFKA_SECRETS.replace("\"PASSWORD\"", "123456789"))
        .unwrap_err()
        .to_string();
    assert!(!e.contains("123456789"), "{e}");
}

#[test]
fn a_horizon_under_a_second_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("delayd.toml");
    std::fs::write(&path, format!("[engine]\nhorizon = \"500ms\"\n{GOOD}")).unwrap();
    let e = Config::load(Some(&path)).unwrap_err().to_string();
    assert!(e.contains("engine.horizon") && e.contains("500ms"), "{e}");
    std::fs::write(&path, format!("[engine]\nhorizon = \"0\"\n{GOOD}")).unwrap();
    assert!(Config::load(Some(&path)).unwrap().engine.horizon.is_zero());
}

#[test]
fn a_route_weight_is_one_to_a_thousand() {
    let with = |w: &str| {
        GOOD.replace(
            "name = \"orders\"",
            &format!("name = \"orders\"\nweight = {w}"),
        )
    };
    assert_eq!(
        Config::from_toml_str(&with("3")).unwrap().routes[0].weight,
        Some(3)
    );
    for bad in ["0", "1001"] {
        let e = Config::from_toml_str(&with(bad)).unwrap_err().to_string();
        assert!(e.contains("routes[0].weight"), "{e}");
    }
}

/// With the broker-kept store, route `orders.3`'s pointer stream is route
/// `orders`' generation 3: each would delete and refill the other's state.
#[test]
fn routes_whose_state_streams_would_share_a_name_are_refused() {
    let route = |name: &str, extra: &str| {
        format!(
            "[[routes]]\nname = \"{name}\"\n{extra}from = {{ broker = \"rabbit\", queue = \"q.{name}\", exchange = \"x.{name}\", exchange_type = \"topic\" }}\nto = {{ broker = \"rabbit\", exchange = \"orders\" }}\n"
        )
    };
    let config = |store: &str, routes: &[String]| {
        let head = &GOOD[..GOOD.find("[[routes]]").unwrap()];
        format!("[store]\nkind = \"{store}\"\n{head}{}", routes.concat())
    };
    for (a, b) in [
        (route("orders", ""), route("orders.3", "")),
        (route("orders.lock", ""), route("orders", "")),
        (route("orders", ""), route("orders.pointer", "")),
        // Partition 1 of `orders` is `orders.1`: its generation 2 is `orders.1.2`.
        (route("orders", "partitions = 2\n"), route("orders.1.2", "")),
        (
            route("orders", "partitions = 2\n"),
            route("orders.members", ""),
        ),
    ] {
        let e = Config::from_toml_str(&config("broker", &[a.clone(), b.clone()]))
            .unwrap_err()
            .to_string();
        assert!(e.contains(".name") && e.contains("rename"), "{e}");
        // The local store keeps no streams: nothing to share.
        Config::from_toml_str(&config("local", &[a, b])).unwrap();
    }
    // A name that only begins like another's is fine.
    Config::from_toml_str(&config(
        "broker",
        &[route("orders", ""), route("orders.eu", "")],
    ))
    .unwrap();
}
