//! The bench over Kafka: publish to a delay topic, consume the target topic
//! in a consumer group of the run's own.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use delayd_adapters::kafka::{KafkaClientConfig, KafkaSink, KafkaSource, KafkaSourceConfig};
use delayd_adapters::Target;

use super::{BenchArgs, Endpoints};

pub(super) async fn endpoints(
    args: &BenchArgs,
    bootstrap: &str,
    run_id: &str,
) -> anyhow::Result<Endpoints> {
    let (Some(topic), Some(target_topic)) = (&args.topic, &args.target_topic) else {
        anyhow::bail!("--kafka needs --topic and --target-topic");
    };
    let mut client = KafkaClientConfig::new(bootstrap);
    for property in &args.kafka_properties {
        let (key, value) = property
            .split_once('=')
            .with_context(|| format!("--kafka-property {property:?} is not KEY=VALUE"))?;
        client.properties.insert(key.to_owned(), value.to_owned());
    }
    let sink = KafkaSink::new(&client).context("creating the Kafka producer")?;
    if let Some(partitions) = args.create_topics {
        for name in [topic, target_topic] {
            sink.ensure_topic_with(name, partitions)
                .await
                .with_context(|| format!("creating topic {name}"))?;
        }
    }
    for name in [topic, target_topic] {
        anyhow::ensure!(
            sink.topic_exists(name).await?,
            "Kafka topic {name:?} does not exist (--create-topics N creates it)"
        );
    }
    // Read only what is produced from now on: the target topic may hold
    // millions of records of earlier runs.
    let mut reader =
        KafkaSourceConfig::new(vec![target_topic.clone()], format!("delayd-bench-{run_id}"));
    reader.start_at_end = true;
    let source = KafkaSource::start(&client, reader).context("starting the Kafka consumer")?;
    let flushing = sink.clone();
    Ok(Endpoints {
        sink: Arc::new(sink),
        target: Target::exchange(topic.clone()),
        source: Box::new(source),
        close: Box::pin(async move {
            let _ =
                tokio::task::spawn_blocking(move || flushing.flush(Duration::from_secs(10))).await;
        }),
    })
}
