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
    /// Validate a config file and print the effective routes.
    Check {
        #[arg(short, long, env = "DELAYD_CONFIG")]
        config: Option<PathBuf>,
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
        Command::Check { config } => check(config),
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

fn check(path: Option<PathBuf>) -> anyhow::Result<()> {
    let config = Config::load(path.as_deref())?;
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
    }
    Ok(())
}
