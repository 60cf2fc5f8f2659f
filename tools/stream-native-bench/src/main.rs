//! Stream intake, AMQP 0-9-1 against the native stream protocol.
//!
//! Publishes `--count` messages of `--body-bytes` into a stream (AMQP,
//! with confirms), then reads all of them back from the first offset, in
//! turn over AMQP 0-9-1 (basic.consume with `x-stream-offset`, prefetch
//! 1000; `amqp-each` acks every delivery for credit, as delayd's stream
//! ingress does, `amqp-batch` one `multiple` ack per 250, the protocol's
//! best case) and over the native protocol (`rabbitmq-stream-client`, its
//! default credits), `--runs` times each, interleaved. Prints, per read,
//! the rate and this process's CPU per message: what the protocol costs a
//! consumer that does nothing else.
//!
//!   stream-native-bench [--count 200000] [--body-bytes 256] [--runs 2]
//!                       [--amqp amqp://127.0.0.1:5672/%2f] [--stream-port 5552]
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use rabbitmq_stream_client::types::OffsetSpecification;
use rabbitmq_stream_client::Environment;

const STREAM: &str = "delayd.bench.native";
const PREFETCH: u16 = 1000;

struct Args {
    count: usize,
    body_bytes: usize,
    runs: usize,
    amqp: String,
    stream_port: u16,
}

fn args() -> Result<Args> {
    let mut a = Args {
        count: 200_000,
        body_bytes: 256,
        runs: 2,
        amqp: "amqp://127.0.0.1:5672/%2f".into(),
        stream_port: 5552,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--count" => a.count = value.parse()?,
            "--body-bytes" => a.body_bytes = value.parse()?,
            "--runs" => a.runs = value.parse()?,
            "--amqp" => a.amqp = value,
            "--stream-port" => a.stream_port = value.parse()?,
            _ => bail!("unknown flag {flag}"),
        }
    }
    Ok(a)
}

/// This process's CPU time so far (user + system), from /proc/self/stat.
fn cpu() -> Result<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = &stat[stat.rfind(')').context("/proc/self/stat")? + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    // utime and stime are fields 14 and 15, the 12th and 13th after the name.
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    // USER_HZ is 100 on Linux.
    Ok(Duration::from_millis(ticks * 10))
}

async fn amqp(uri: &str) -> Result<Connection> {
    Connection::connect(uri, ConnectionProperties::default())
        .await
        .with_context(|| format!("connecting to {uri}"))
}

/// A fresh stream holding `count` messages of `body_bytes`.
async fn fill(uri: &str, count: usize, body_bytes: usize) -> Result<()> {
    let conn = amqp(uri).await?;
    let ch = conn.create_channel().await?;
    ch.queue_delete(STREAM.into(), QueueDeleteOptions::default())
        .await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("stream".into()),
    );
    ch.queue_declare(
        STREAM.into(),
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        args,
    )
    .await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let body = vec![b'x'; body_bytes];
    let start = Instant::now();
    let mut pending = Vec::with_capacity(1000);
    for _ in 0..count {
        pending.push(
            ch.basic_publish(
                "".into(),
                STREAM.into(),
                BasicPublishOptions::default(),
                &body,
                BasicProperties::default().with_delivery_mode(2),
            )
            .await?,
        );
        if pending.len() == 1000 {
            for c in pending.drain(..) {
                c.await?;
            }
        }
    }
    for c in pending {
        c.await?;
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "fill       {count} messages of {body_bytes} B in {secs:.1} s ({:.0} msg/s)",
        count as f64 / secs
    );
    conn.close(200, "done".into()).await?;
    Ok(())
}

/// Read `count` messages from the first offset over AMQP 0-9-1, acking
/// every `ack_every`th delivery with `multiple` (1: each on its own).
async fn read_amqp(uri: &str, count: usize, ack_every: usize) -> Result<()> {
    let conn = amqp(uri).await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-stream-offset".into(),
        AMQPValue::LongString("first".into()),
    );
    let mut consumer = ch
        .basic_consume(
            STREAM.into(),
            "".into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await?;
    let (t0, c0) = (Instant::now(), cpu()?);
    let mut seen = 0;
    while seen < count {
        let delivery = consumer.next().await.context("consumer ended")??;
        seen += 1;
        if seen % ack_every == 0 || seen == count {
            delivery
                .acker
                .ack(BasicAckOptions {
                    multiple: ack_every > 1,
                })
                .await?;
        }
    }
    let name = if ack_every > 1 {
        "amqp-batch"
    } else {
        "amqp-each"
    };
    report(name, count, t0, c0)?;
    conn.close(200, "done".into()).await?;
    Ok(())
}

/// Read `count` messages from the first offset over the native protocol.
async fn read_native(port: u16, count: usize) -> Result<()> {
    let env = Environment::builder()
        .host("127.0.0.1")
        .port(port)
        .build()
        .await
        .context("connecting to the stream port")?;
    let mut consumer = env
        .consumer()
        .offset(OffsetSpecification::First)
        .build(STREAM)
        .await?;
    let (t0, c0) = (Instant::now(), cpu()?);
    let mut seen = 0;
    while seen < count {
        let delivery = consumer.next().await.context("consumer ended")??;
        std::hint::black_box(delivery.message().data());
        seen += 1;
    }
    report("native", count, t0, c0)?;
    consumer.handle().close().await?;
    Ok(())
}

fn report(protocol: &str, count: usize, t0: Instant, c0: Duration) -> Result<()> {
    let secs = t0.elapsed().as_secs_f64();
    let cpu = (cpu()? - c0).as_secs_f64();
    println!(
        "{protocol:<10} {count} messages in {secs:.2} s: {:.0} msg/s, {:.1} µs CPU per message",
        count as f64 / secs,
        cpu * 1e6 / count as f64
    );
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = args()?;
    fill(&a.amqp, a.count, a.body_bytes).await?;
    for _ in 0..a.runs {
        read_amqp(&a.amqp, a.count, 1).await?;
        read_amqp(&a.amqp, a.count, 250).await?;
        read_native(a.stream_port, a.count).await?;
    }
    let conn = amqp(&a.amqp).await?;
    let ch = conn.create_channel().await?;
    ch.queue_delete(STREAM.into(), QueueDeleteOptions::default())
        .await?;
    Ok(())
}
