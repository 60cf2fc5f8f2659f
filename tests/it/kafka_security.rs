//! delayd against the test Kafka's TLS listeners (`scripts/kafka.sh`): SSL on
//! 127.0.0.1:9094 with a client certificate, SASL_SSL on 127.0.0.1:9095 with
//! SCRAM-SHA-512 (the example `config/examples/kafka-sasl-ssl.toml` run as
//! the docs show it, the password in a file that shows up nowhere) and with
//! OAUTHBEARER tokens from an OIDC endpoint (librdkafka's `oidc` method,
//! rdkafka's `curl` feature), a zstd-compressed source topic, the default
//! `client.id`, and a state topic replication factor the cluster cannot meet.

use crate::common;

use std::time::Duration;

use common::kafka::{
    self, assert_none_early, collect_unique, create_topic, topic, wait_assigned, KafkaRoute,
    Producer, Reader, Record,
};
use common::tls::{example_config, kafka_password, tls_file, wait_readyz};
use common::{
    delayd_cli, must_replace, now_ms, run_until_exit, toml_string, unique_suffix, Delayd, DEADLINE,
};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};

/// Sends `count` records with `x-delay` 300..1500 ms through the plain
/// listener; returns (sent at, delay) per value.
async fn send_delayed(producer: &Producer, topic: &str, count: u32) -> Vec<(u64, u64)> {
    let mut sent = Vec::new();
    for i in 0..count {
        let delay = 300 + u64::from(i % 5) * 300;
        let record = Record::new(&format!("k{i}"), i.to_string().as_bytes())
            .header("x-delay", Some(delay.to_string().as_bytes()));
        let at = now_ms();
        producer.send(topic, &record).await;
        sent.push((at, delay));
    }
    sent
}

/// The client ids of group `group`'s members, as the broker reports them.
fn member_client_ids(group: &str) -> Vec<String> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", kafka::bootstrap())
        .create()
        .expect("Kafka client");
    let list = consumer
        .fetch_group_list(Some(group), Duration::from_secs(5))
        .expect("describe group");
    list.groups()
        .iter()
        .filter(|g| g.name() == group)
        .flat_map(|g| g.members().iter().map(|m| m.client_id().to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_go_through_the_ssl_listener_with_a_client_certificate() {
    let r = KafkaRoute::new("kafka-ssl", 2).await;
    let path = |f: &str| toml_string(tls_file(f).to_str().unwrap());
    let delayd = Delayd::start_with(|wal, http| {
        let text = kafka::config(wal, http, &r.route, &r.from, &r.group, &r.to, "");
        let text = must_replace(
            &text,
            &format!("bootstrap = {}", toml_string(&kafka::bootstrap())),
            "bootstrap = \"127.0.0.1:9094\"",
        );
        must_replace(
            &text,
            "properties = { ",
            &format!(
                "properties = {{ \"security.protocol\" = \"SSL\", \"ssl.ca.location\" = {}, \
                 \"ssl.certificate.location\" = {}, \"ssl.key.location\" = {}, ",
                path("ca.crt"),
                path("client.crt"),
                path("client.key")
            ),
        )
    })
    .await;
    wait_assigned(&delayd).await;
    let reader = Reader::new(&r.to);
    let sent = send_delayed(&Producer::new(), &r.from, 20).await;
    let got = collect_unique(&reader, 20, Duration::from_secs(60));
    assert_none_early(&got, &sent);
    // The consumer is named after the route unless configured otherwise.
    let ids = member_client_ids(&r.group);
    assert_eq!(
        ids,
        [format!("delayd-{}", r.route)],
        "client.id of the group's member"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sasl_ssl_scram_example_delivers_and_its_password_shows_nowhere() {
    let test = "kafka-scram";
    let from = topic(test, "in");
    let to = topic(test, "out");
    create_topic(&from, 2).await;
    create_topic(&to, 2).await;
    let group = format!("delayd-it.{test}.{}", unique_suffix());
    let route = format!("it-{test}");
    let mut delayd = Delayd::start_with(|wal, http| {
        example_config(
            "kafka-sasl-ssl.toml",
            wal,
            http,
            &[
                (
                    "name = \"orders-kafka\"",
                    &format!("name = {}", toml_string(&route)),
                ),
                ("[\"orders.delay\"]", &format!("[{}]", toml_string(&from))),
                (
                    "group = \"delayd\"",
                    &format!("group = {}", toml_string(&group)),
                ),
                (
                    "topic = \"orders\"",
                    &format!("topic = {}", toml_string(&to)),
                ),
            ],
        )
    })
    .await;
    wait_assigned(&delayd).await;
    wait_readyz(&delayd).await;
    let reader = Reader::new(&to);
    let sent = send_delayed(&Producer::new(), &from, 20).await;
    let got = collect_unique(&reader, 20, Duration::from_secs(60));
    assert_none_early(&got, &sent);

    let password = kafka_password();
    let (_, readyz) = delayd.http_get("/readyz").expect("GET /readyz");
    let (ok, out, err) = delayd_cli(
        "check",
        &["--config", delayd.config_path().to_str().unwrap()],
    );
    assert!(ok, "delayd check: {err}");
    assert!(
        out.contains("sasl.password=${file:"),
        "check shows the reference: {out}"
    );
    delayd.sigterm_and_wait(DEADLINE).await;
    for (what, text) in [
        ("the log", delayd.full_log()),
        ("/readyz", readyz),
        ("delayd check", format!("{out}{err}")),
    ] {
        assert!(!text.contains(&password), "the password shows in {what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zstd_compressed_source_topic_is_read() {
    let r = KafkaRoute::new("zstd", 1).await;
    let delayd = r.start("").await;
    wait_assigned(&delayd).await;
    let reader = Reader::new(&r.to);
    // Batches compressed with zstd by the producer, as the broker keeps them.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", kafka::bootstrap())
        .set("compression.type", "zstd")
        .set("linger.ms", "50")
        .create()
        .expect("a zstd producer");
    let mut sent = Vec::new();
    let mut deliveries = Vec::new();
    for i in 0..30u32 {
        let value = i.to_string();
        let key = format!("k{i}");
        let at = now_ms();
        let record = FutureRecord::to(&r.from).key(&key).payload(&value).headers(
            rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
                key: "x-delay",
                value: Some("500"),
            }),
        );
        deliveries.push(producer.send_result(record).expect("queued"));
        sent.push((at, 500));
    }
    for d in deliveries {
        d.await.expect("delivered").expect("acknowledged");
    }
    let got = collect_unique(&reader, 30, Duration::from_secs(60));
    assert_none_early(&got, &sent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_topic_replication_factor_the_cluster_cannot_meet_stops_delayd_saying_so() {
    let r = KafkaRoute::new("replication", 1).await;
    let dir = tempfile::tempdir().unwrap();
    let config = kafka::config(
        &dir.path().join("wal"),
        "127.0.0.1:0".parse().unwrap(),
        &r.route,
        &r.from,
        &r.group,
        &r.to,
        "",
    );
    let config = format!("[store]\nkind = \"broker\"\nreplication_factor = 3\n\n{config}");
    let (ok, output) = run_until_exit(&config, Duration::from_secs(60)).await;
    assert!(!ok, "delayd started: {output}");
    assert!(
        output
            .contains("store.replication_factor asks for 3 replicas but the cluster has 1 broker"),
        "{output}"
    );
    assert!(!kafka::topic_exists(&format!("delayd.state.{}", r.route)).await);
}

/// base64 of `bytes` with `alphabet`'s last two characters (`+/` or `-_`),
/// without padding when `pad` is false.
fn base64(bytes: &[u8], last_two: &str, pad: bool) -> String {
    let alphabet: Vec<char> =
        format!("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789{last_two}")
            .chars()
            .collect();
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = (u32::from(chunk[0]) << 16)
            | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
            | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..=chunk.len() {
            out.push(alphabet[((n >> (18 - 6 * i)) & 63) as usize]);
        }
        if pad {
            out.push_str(&"=".repeat(3 - chunk.len()));
        }
    }
    out
}

/// An OIDC token endpoint for the test: answers a client-credentials
/// request that carries `client_id:secret` with an unsigned JWT for
/// principal `delayd` (what the test broker's OAUTHBEARER validator takes),
/// and anything else with 401. Returns its URL and how many tokens it gave.
async fn token_endpoint(
    client_id: &str,
    secret: &str,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicU32>) {
    use axum::http::{header, HeaderMap, StatusCode};
    const JSON: [(header::HeaderName, &str); 1] = [(header::CONTENT_TYPE, "application/json")];
    use axum::routing::post;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    let expected = format!(
        "Basic {}",
        base64(format!("{client_id}:{secret}").as_bytes(), "+/", true)
    );
    let issued = Arc::new(AtomicU32::new(0));
    let counter = issued.clone();
    let app = axum::Router::new().route(
        "/token",
        post(move |headers: HeaderMap, body: String| {
            let (expected, counter) = (expected.clone(), counter.clone());
            async move {
                let auth = headers
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default();
                if auth != expected || !body.contains("grant_type=client_credentials") {
                    return (StatusCode::UNAUTHORIZED, JSON, "{}".to_owned());
                }
                let now = now_ms() / 1000;
                let header = base64(br#"{"alg":"none"}"#, "-_", false);
                let claims = format!(r#"{{"sub":"delayd","iat":{now},"exp":{}}}"#, now + 3600);
                let claims = base64(claims.as_bytes(), "-_", false);
                counter.fetch_add(1, Ordering::Relaxed);
                let token = format!("{header}.{claims}.");
                (
                    StatusCode::OK,
                    JSON,
                    format!(
                        r#"{{"access_token":"{token}","token_type":"Bearer","expires_in":3600}}"#
                    ),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the token endpoint");
    let url = format!("http://{}/token", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, issued)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oauthbearer_with_an_oidc_token_endpoint_and_a_client_secret_from_a_file() {
    use std::sync::atomic::Ordering;
    let secret = format!("oidc-secret-{}", unique_suffix());
    let (url, issued) = token_endpoint("delayd", &secret).await;
    let r = KafkaRoute::new("kafka-oidc", 1).await;
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("oidc-secret");
    std::fs::write(&secret_file, &secret).unwrap();
    let properties = format!(
        "\"security.protocol\" = \"SASL_SSL\", \"ssl.ca.location\" = {ca}, \
         \"sasl.mechanisms\" = \"OAUTHBEARER\", \"sasl.oauthbearer.method\" = \"oidc\", \
         \"sasl.oauthbearer.client.id\" = \"delayd\", \
         \"sasl.oauthbearer.client.secret\" = \"${{file:{file}}}\", \
         \"sasl.oauthbearer.token.endpoint.url\" = {url}, ",
        ca = toml_string(tls_file("ca.crt").to_str().unwrap()),
        file = secret_file.display(),
        url = toml_string(&url),
    );
    let mut delayd = Delayd::start_with(|wal, http| {
        let text = kafka::config(wal, http, &r.route, &r.from, &r.group, &r.to, "");
        let text = must_replace(
            &text,
            &format!("bootstrap = {}", toml_string(&kafka::bootstrap())),
            "bootstrap = \"127.0.0.1:9095\"",
        );
        must_replace(
            &text,
            "properties = { ",
            &format!("properties = {{ {properties}"),
        )
    })
    .await;
    wait_assigned(&delayd).await;
    let reader = Reader::new(&r.to);
    let sent = send_delayed(&Producer::new(), &r.from, 10).await;
    let got = collect_unique(&reader, 10, Duration::from_secs(60));
    assert_none_early(&got, &sent);
    assert!(
        issued.load(Ordering::Relaxed) >= 1,
        "delayd's clients got their tokens from the endpoint"
    );
    delayd.sigterm_and_wait(DEADLINE).await;
    assert!(
        !delayd.full_log().contains(&secret),
        "the client secret shows in the log"
    );
}
