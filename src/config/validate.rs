//! Semantic checks on a parsed config, with errors that name the key and file.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use super::{BrokerConfig, Config, DestinationConfig, Mode};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {0} does not exist")]
    Missing(PathBuf),
    #[error("{}", render(.errors))]
    Parse { errors: Vec<String> },
    #[error("config error in {}: `{key}`: {message}", where_(.file))]
    Invalid {
        key: String,
        file: Option<PathBuf>,
        message: String,
    },
}

fn render(errors: &[String]) -> String {
    errors.join("\n")
}

fn where_(file: &Option<PathBuf>) -> String {
    file.as_ref()
        .map(|f| f.display().to_string())
        .unwrap_or_else(|| "config".into())
}

impl ConfigError {
    pub fn from_figment(err: figment::Error, file: Option<&Path>) -> Self {
        let errors = err
            .into_iter()
            .map(|e| {
                let key = e.path.join(".");
                let source = e
                    .metadata
                    .as_ref()
                    .and_then(|m| m.source.as_ref().map(|s| s.to_string()))
                    .or_else(|| e.metadata.as_ref().map(|m| m.name.to_string()))
                    .or_else(|| file.map(|f| f.display().to_string()))
                    .unwrap_or_else(|| "config".into());
                if key.is_empty() {
                    format!("config error in {source}: {}", e.kind)
                } else {
                    format!("config error in {source}: `{key}`: {}", e.kind)
                }
            })
            .collect();
        ConfigError::Parse { errors }
    }
}

impl Config {
    pub(super) fn validate(&self, file: Option<&Path>) -> Result<(), ConfigError> {
        let err = |key: String, message: String| ConfigError::Invalid {
            key,
            file: file.map(Path::to_path_buf),
            message,
        };
        if self.wal.segment_bytes < 4096 || self.wal.segment_bytes > (1 << 31) {
            return Err(err(
                "wal.segment_bytes".into(),
                "must be between 4096 and 2 GiB".into(),
            ));
        }
        if !(0.0..=1.0).contains(&self.wal.compact_below) {
            return Err(err(
                "wal.compact_below".into(),
                "must be between 0 and 1".into(),
            ));
        }
        if self.engine.max_in_flight == 0 {
            return Err(err(
                "engine.max_in_flight".into(),
                "must be at least 1".into(),
            ));
        }
        if !self.http.listen.is_empty() {
            let addr: SocketAddr = self.http.listen.parse().map_err(|e| {
                err(
                    "http.listen".into(),
                    format!("{:?} is not an address:port ({e})", self.http.listen),
                )
            })?;
            if !addr.ip().is_loopback()
                && self.http.token.is_none()
                && self.http.token_file.is_none()
            {
                return Err(err(
                    "http.listen".into(),
                    format!(
                        "{addr} is reachable from other hosts, so the admin API needs a bearer token: \
                         set http.token_file or DELAYD_HTTP__TOKEN, or listen on 127.0.0.1"
                    ),
                ));
            }
        }
        for (name, broker) in &self.brokers {
            match broker {
                BrokerConfig::Amqp { url }
                    if !(url.starts_with("amqp://") || url.starts_with("amqps://")) =>
                {
                    return Err(err(
                        format!("brokers.{name}.url"),
                        format!("{url:?} is not an amqp:// URL"),
                    ));
                }
                BrokerConfig::Kafka { bootstrap } if bootstrap.trim().is_empty() => {
                    return Err(err(format!("brokers.{name}.bootstrap"), "is empty".into()));
                }
                BrokerConfig::Kafka { .. } => {
                    return Err(err(
                        format!("brokers.{name}.kind"),
                        "Kafka brokers are not supported by this build yet".into(),
                    ));
                }
                _ => {}
            }
        }
        let mut names = HashSet::new();
        for (i, route) in self.routes.iter().enumerate() {
            let key = |field: &str| format!("routes[{i}].{field}");
            if route.name.trim().is_empty() {
                return Err(err(key("name"), "must not be empty".into()));
            }
            if !names.insert(route.name.as_str()) {
                return Err(err(
                    key("name"),
                    format!("route name {:?} is used twice", route.name),
                ));
            }
            if route.mode != Mode::Delay {
                return Err(err(
                    key("mode"),
                    format!("mode {:?} is not supported yet; use \"delay\"", route.mode),
                ));
            }
            let from = self.broker(&route.from.broker).ok_or_else(|| {
                err(
                    key("from.broker"),
                    format!("no broker named {:?} under [brokers]", route.from.broker),
                )
            })?;
            let to = self.broker(&route.to.broker).ok_or_else(|| {
                err(
                    key("to.broker"),
                    format!("no broker named {:?} under [brokers]", route.to.broker),
                )
            })?;
            if let BrokerConfig::Amqp { .. } = from {
                if route.from.queue.as_deref().is_none_or(str::is_empty) {
                    return Err(err(
                        key("from.queue"),
                        "an AMQP route needs the queue delayd consumes".into(),
                    ));
                }
                if let Some(kind) = &route.from.exchange_type {
                    if !["direct", "topic", "fanout", "headers"].contains(&kind.as_str()) {
                        return Err(err(
                            key("from.exchange_type"),
                            format!("{kind:?} is not one of direct, topic, fanout, headers"),
                        ));
                    }
                }
                if route.from.prefetch == Some(0) {
                    return Err(err(key("from.prefetch"), "must be at least 1".into()));
                }
            }
            if let BrokerConfig::Amqp { .. } = to {
                if route.to.exchange.is_none() {
                    return Err(err(
                        key("to.exchange"),
                        "an AMQP target needs an exchange (\"\" for the default exchange)".into(),
                    ));
                }
            }
            for (field, dest) in [
                ("invalid", &route.invalid),
                ("unroutable", &route.unroutable),
            ] {
                if let Some(d) = dest {
                    self.check_destination(d).map_err(|m| err(key(field), m))?;
                }
            }
        }
        Ok(())
    }

    pub fn broker(&self, name: &str) -> Option<&BrokerConfig> {
        self.brokers.get(name)
    }

    fn check_destination(&self, d: &DestinationConfig) -> Result<(), String> {
        if let Some(b) = &d.broker {
            if self.broker(b).is_none() {
                return Err(format!("no broker named {b:?} under [brokers]"));
            }
        }
        let set = [d.queue.is_some(), d.exchange.is_some(), d.topic.is_some()];
        if set.iter().filter(|&&x| x).count() != 1 {
            return Err("set exactly one of queue, exchange or topic".into());
        }
        Ok(())
    }
}
