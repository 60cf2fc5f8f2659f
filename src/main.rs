//! The `delayd` command line.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use delayd::config::Config;

#[derive(Parser)]
#[command(
    name = "delayd",
    version,
    about = "Durable per-message delayed delivery for RabbitMQ and Kafka"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the sidecar.
    Run {
        /// TOML config file (defaults < file < DELAYD_* environment).
        #[arg(short, long, env = "DELAYD_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Validate a config file and print the effective routes; with
    /// partitioned RabbitMQ routes, also look on the broker for partitions
    /// they had before and no longer have (unless --offline).
    Check {
        #[arg(short, long, env = "DELAYD_CONFIG")]
        config: Option<PathBuf>,
        /// Do not connect to any broker: check the file alone.
        #[arg(long)]
        offline: bool,
    },
    /// Inspect the write-ahead log.
    Wal {
        #[command(subcommand)]
        command: WalCommand,
    },
    /// Inspect the broker-kept store (`store.kind = "broker"`).
    Store {
        #[command(subcommand)]
        command: StoreCommand,
    },
    /// Load generator: publish delayed messages and measure their arrival.
    Bench(Box<delayd::bench::BenchArgs>),
    /// List, show, cancel and purge pending messages through the admin API.
    Messages(delayd::messages::MessagesArgs),
    /// Ask a running delayd whether it is alive (exit 0) or not (exit 1):
    /// a container HEALTHCHECK or exec probe without curl.
    Healthcheck(delayd::healthcheck::HealthcheckArgs),
}

#[derive(Subcommand)]
enum WalCommand {
    /// Segments, live and dead records, due-time range, corruption.
    Inspect {
        /// WAL directory (e.g. data/wal).
        dir: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum StoreCommand {
    /// Pending messages in each route's state topic, per partition.
    Inspect {
        #[arg(short, long, env = "DELAYD_CONFIG")]
        config: Option<PathBuf>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run { config } => run(config),
        Command::Check { config, offline } => check(config, offline),
        Command::Wal {
            command: WalCommand::Inspect { dir, json },
        } => delayd::inspect::run(&dir, json),
        Command::Store {
            command: StoreCommand::Inspect { config, json },
        } => Config::load(config.as_deref())
            .map_err(anyhow::Error::from)
            .and_then(|c| delayd::store_inspect::run(&c, json)),
        Command::Bench(args) => {
            // Warnings only (the report is the output); RUST_LOG overrides.
            // lapin logs every channel the broker closes at ERROR, the
            // expected NOT_FOUND of checking whether an exchange exists
            // included; the bench reports its own failures.
            delayd::telemetry::init_logging(&delayd::config::LogSection {
                level: "warn,lapin::channel=off".into(),
                ..Default::default()
            });
            runtime().and_then(|rt| rt.block_on(delayd::bench::run(*args)))
        }
        Command::Messages(args) => delayd::messages::run(args),
        Command::Healthcheck(args) => delayd::healthcheck::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("delayd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn run(config: Option<PathBuf>) -> anyhow::Result<()> {
    let config = Config::load(config.as_deref())?;
    delayd::telemetry::init_logging(&config.log);
    delayd::telemetry::init_metrics()?;
    runtime()?.block_on(delayd::runtime::run(config))
}

fn check(path: Option<PathBuf>, offline: bool) -> anyhow::Result<()> {
    let config = Config::load(path.as_deref())?;
    if !offline {
        check_leftover_partitions(&config)?;
    }
    let file = path
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "defaults".into());
    println!(
        "{file}: OK ({} brokers, {} routes)",
        config.brokers.len(),
        config.routes.len()
    );
    for (name, broker) in &config.brokers {
        println!(
            "  broker {name}: {}",
            delayd::config::describe_broker(broker)
        );
    }
    for r in &config.routes {
        let from = r
            .from
            .queue
            .clone()
            .map(|q| format!("queue {q}"))
            .unwrap_or_else(|| format!("topics {:?}", r.from.topics));
        let to =
            r.to.exchange
                .clone()
                .map(|e| format!("exchange {e:?}"))
                .or_else(|| r.to.topic.clone().map(|t| format!("topic {t}")))
                .unwrap_or_default();
        println!(
            "  route {} ({:?}): {}/{} -> {}/{}",
            r.name, r.mode, r.from.broker, from, r.to.broker, to
        );
        if r.from.queue_type == Some(delayd::config::QueueKind::Stream) {
            let retention = delayd::config::stream::Retention::of(&r.from);
            let position = if config.store.kind == delayd::config::StoreKind::Broker {
                "the route's state streams".to_owned()
            } else {
                delayd::runtime::stream_checkpoint(&config.wal.dir, &r.name)
                    .display()
                    .to_string()
            };
            println!(
                "    stream ingress: kept {} or {} bytes, whichever ends first; read position in {position}",
                retention.max_age, retention.max_length_bytes,
            );
            if let Some(warning) = retention.warning() {
                eprintln!("delayd: warning: route {}: {warning}", r.name);
            }
        }
    }
    Ok(())
}

/// Partitions that partitioned routes had before and no longer have: an
/// error if the start would refuse them, a note if it would remove them
/// (empty), a warning if the broker cannot be reached (the start looks
/// again).
fn check_leftover_partitions(config: &Config) -> anyhow::Result<()> {
    use delayd::partition_leftovers::{inspect, Shrunk};
    if delayd::partition_leftovers::groups(config).is_empty() {
        return Ok(());
    }
    // lapin logs the broker's NOT_FOUND answers to the passive declares.
    delayd::telemetry::init_logging(&delayd::config::LogSection {
        level: "warn,lapin=off".into(),
        ..Default::default()
    });
    let found = match runtime()?.block_on(inspect(config)) {
        Ok(found) => found,
        Err(e) => {
            eprintln!("delayd: warning: cannot look on the broker for partitions the routes had before ({e}); the start looks again");
            return Ok(());
        }
    };
    for (group, found) in found {
        if found.is_empty() {
            continue;
        }
        if found.iter().any(|f| f.not_empty().is_some()) {
            let shrunk = Shrunk {
                key: group.key,
                route: group.route,
                exchange: group.exchange,
                configured: group.count,
                found,
            };
            return Err(anyhow::Error::msg(shrunk.to_string()));
        }
        let queues: Vec<&str> = found.iter().map(|f| f.names.queue.as_str()).collect();
        eprintln!(
            "delayd: note: route {}: partitions it had before ({}) are empty; the start removes them",
            group.route,
            queues.join(", ")
        );
    }
    Ok(())
}
