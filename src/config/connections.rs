//! What each `[brokers.NAME]` section resolves to once its files are read
//! and its `${file:...}` / `${env:...}` values replaced: the settings the
//! adapters connect with.
//!
//! `delayd check` and `delayd run` both resolve every broker at load
//! ([`Config::connections`]), so a missing or unreadable file fails either
//! one with the key that names it and the path. Certificates and keys are
//! parsed here too (by building the TLS client), so a bad PEM fails at
//! start, not at the first connection. Secrets are held in memory only:
//! nothing here prints a value.

use std::collections::BTreeMap;

use delayd_adapters::amqp::{AmqpSettings, EndpointError, Endpoints, TlsError, TlsOptions};
use delayd_adapters::kafka::KafkaClientConfig;

use super::secrets::{self, SecretError};
use super::{AmqpAuth, AmqpBrokerConfig, BrokerConfig, Config, ConfigError, KafkaBrokerConfig};

/// One broker's resolved connection settings.
#[derive(Debug, Clone)]
pub enum BrokerConnection {
    Amqp(AmqpSettings),
    Kafka(KafkaClientConfig),
}

impl Config {
    /// Every broker's connection settings, files read and references
    /// resolved. Errors name the key and the file or variable.
    pub fn connections(&self) -> Result<BTreeMap<String, BrokerConnection>, ConfigError> {
        self.brokers
            .keys()
            .map(|name| Ok((name.clone(), self.connection(name)?)))
            .collect()
    }

    /// One broker's connection settings (see [`Config::connections`]).
    pub fn connection(&self, name: &str) -> Result<BrokerConnection, ConfigError> {
        let err = |key: String, message: String| ConfigError::Invalid {
            key: format!("brokers.{name}.{key}"),
            file: self.file.clone(),
            message,
        };
        match self.brokers.get(name) {
            Some(BrokerConfig::Amqp(amqp)) => amqp_settings(amqp)
                .map(BrokerConnection::Amqp)
                .map_err(|(key, message)| err(key, message)),
            Some(BrokerConfig::Kafka(kafka)) => kafka_client(kafka)
                .map(BrokerConnection::Kafka)
                .map_err(|(key, message)| err(key, message)),
            None => Err(ConfigError::Invalid {
                key: "brokers".into(),
                file: self.file.clone(),
                message: format!("no broker named {name:?}"),
            }),
        }
    }
}

/// (key under the broker, message).
type Failure = (String, String);

fn secret_failure(key: &str) -> impl Fn(SecretError) -> Failure + '_ {
    move |e| (key.to_owned(), e.to_string())
}

/// The broker's URLs, from whichever of `url`, `urls`, `url_file` is set
/// (validation made sure it is exactly one), with the key each came from.
fn urls(amqp: &AmqpBrokerConfig) -> Result<(Vec<String>, &'static str), Failure> {
    if let Some(url) = &amqp.url {
        let url = secrets::resolve(url).map_err(secret_failure("url"))?;
        return Ok((vec![url], "url"));
    }
    if let Some(path) = &amqp.url_file {
        let text = secrets::read_file(path).map_err(secret_failure("url_file"))?;
        let urls: Vec<String> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(str::to_owned)
            .collect();
        if urls.is_empty() {
            return Err((
                "url_file".into(),
                format!("{} holds no URL", path.display()),
            ));
        }
        return Ok((urls, "url_file"));
    }
    let urls = amqp
        .urls
        .iter()
        .map(|u| secrets::resolve(u))
        .collect::<Result<Vec<_>, _>>()
        .map_err(secret_failure("urls"))?;
    Ok((urls, "urls"))
}

fn amqp_settings(amqp: &AmqpBrokerConfig) -> Result<AmqpSettings, Failure> {
    let (urls, url_key) = urls(amqp)?;
    for url in &urls {
        if !(url.starts_with("amqp://") || url.starts_with("amqps://")) {
            return Err((
                url_key.into(),
                format!(
                    "{:?} is not an amqp:// or amqps:// URL",
                    delayd_adapters::amqp::redact_url(url)
                ),
            ));
        }
    }
    let password = match &amqp.password_file {
        Some(path) => {
            if let Some(url) = urls.iter().find(|u| url_has_password(u)) {
                return Err((
                    "password_file".into(),
                    format!(
                        "{} has a password too; give it once (leave it out of the URL)",
                        delayd_adapters::amqp::redact_url(url)
                    ),
                ));
            }
            Some(secrets::read_file(path).map_err(secret_failure("password_file"))?)
        }
        None => None,
    };
    let mut external_auth = false;
    let tls = match &amqp.tls {
        None => None,
        Some(t) => {
            let read = |key: &'static str, path: &Option<std::path::PathBuf>| {
                path.as_deref()
                    .map(secrets::read_bytes)
                    .transpose()
                    .map_err(secret_failure(key))
            };
            external_auth = t.auth == AmqpAuth::External;
            Some(TlsOptions {
                ca_pem: read("tls.ca_file", &t.ca_file)?,
                cert_pem: read("tls.cert_file", &t.cert_file)?,
                key_pem: read("tls.key_file", &t.key_file)?,
                server_name: t.server_name.clone(),
                verify_peer: t.verify_peer,
            })
        }
    };
    let settings = AmqpSettings {
        urls,
        password,
        tls,
        external_auth,
    };
    // Parse the URLs and build the TLS client now: a bad certificate or
    // key fails here, naming its key, rather than at the first connection.
    if let Err(e) = Endpoints::new(&settings) {
        return Err(endpoint_failure(e, url_key, amqp));
    }
    Ok(settings)
}

/// Which key an [`EndpointError`] is about, with its message.
fn endpoint_failure(e: EndpointError, url_key: &str, amqp: &AmqpBrokerConfig) -> Failure {
    let with_path = |key: &str, path: &Option<std::path::PathBuf>, message: String| {
        let message = match path {
            Some(p) => format!("{}: {message}", p.display()),
            None => message,
        };
        (key.to_owned(), message)
    };
    let tls = amqp.tls.clone().unwrap_or_default();
    match e {
        EndpointError::Tls(tls_error) => {
            let message = tls_error.to_string();
            match tls_error {
                TlsError::NoCa | TlsError::BadCa(_) => {
                    with_path("tls.ca_file", &tls.ca_file, message)
                }
                TlsError::NoCert | TlsError::BadCert(_) | TlsError::HalfIdentity => {
                    with_path("tls.cert_file", &tls.cert_file, message)
                }
                TlsError::BadKey(_) | TlsError::Identity(_) => {
                    with_path("tls.key_file", &tls.key_file, message)
                }
                TlsError::ServerName(_) => ("tls.server_name".into(), message),
                TlsError::SystemCas(_) | TlsError::Other(_) => ("tls".into(), message),
            }
        }
        EndpointError::TlsWithoutAmqps { .. } => ("tls".into(), e.to_string()),
        EndpointError::ExternalWithoutCertificate { .. } => ("tls.auth".into(), e.to_string()),
        EndpointError::Empty | EndpointError::InvalidUrl { .. } => (url_key.into(), e.to_string()),
    }
}

/// Whether an AMQP URL carries a password (`user:password@`).
fn url_has_password(url: &str) -> bool {
    let Some(rest) = url.split_once("://").map(|(_, rest)| rest) else {
        return false;
    };
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    authority
        .rsplit_once('@')
        .is_some_and(|(userinfo, _)| userinfo.contains(':'))
}

fn kafka_client(kafka: &KafkaBrokerConfig) -> Result<KafkaClientConfig, Failure> {
    let resolve_all = |section: &str, map: &BTreeMap<String, String>| {
        map.iter()
            .map(|(k, v)| {
                let value = secrets::resolve(v)
                    .map_err(|e| (format!("{section}.{}", quote_key(k)), e.to_string()))?;
                Ok((k.clone(), value))
            })
            .collect::<Result<BTreeMap<_, _>, Failure>>()
    };
    let bootstrap = secrets::resolve(&kafka.bootstrap).map_err(secret_failure("bootstrap"))?;
    let mut client = KafkaClientConfig::new(bootstrap);
    client.client_id = kafka.client_id.clone();
    client.properties = resolve_all("properties", &kafka.properties)?;
    client.consumer = resolve_all("consumer_properties", &kafka.consumer_properties)?;
    client.producer = resolve_all("producer_properties", &kafka.producer_properties)?;
    Ok(client)
}

/// One line about a broker for `delayd check`: where it is and how delayd
/// logs in, with passwords and secret values shown as `***` (references
/// such as `${file:PATH}` are shown: they name a file, not its content).
pub fn describe_broker(broker: &BrokerConfig) -> String {
    use delayd_adapters::amqp::redact_url;
    match broker {
        BrokerConfig::Amqp(amqp) => {
            let mut parts = Vec::new();
            if let Some(url) = &amqp.url {
                parts.push(redact_url(url));
            }
            if !amqp.urls.is_empty() {
                let urls: Vec<String> = amqp.urls.iter().map(|u| redact_url(u)).collect();
                parts.push(format!("[{}]", urls.join(", ")));
            }
            if let Some(path) = &amqp.url_file {
                parts.push(format!("URLs from {}", path.display()));
            }
            if let Some(path) = &amqp.password_file {
                parts.push(format!("password from {}", path.display()));
            }
            if let Some(tls) = &amqp.tls {
                let mut t = Vec::new();
                if let Some(p) = &tls.ca_file {
                    t.push(format!("CA {}", p.display()));
                }
                if let Some(p) = &tls.cert_file {
                    t.push(format!("client certificate {}", p.display()));
                }
                if let Some(n) = &tls.server_name {
                    t.push(format!("server name {n}"));
                }
                if tls.auth == AmqpAuth::External {
                    t.push("EXTERNAL login".into());
                }
                if !tls.verify_peer {
                    t.push("PEER NOT VERIFIED".into());
                }
                parts.push(format!("TLS ({})", t.join(", ")));
            }
            format!("amqp {}", parts.join(", "))
        }
        BrokerConfig::Kafka(kafka) => {
            let shown = |k: &String, v: &String| {
                if secrets::is_secret_property(k) && !secrets::is_reference(v) {
                    format!("{k}=***")
                } else {
                    format!("{k}={v}")
                }
            };
            let properties: Vec<String> = kafka
                .properties
                .iter()
                .chain(&kafka.consumer_properties)
                .chain(&kafka.producer_properties)
                .map(|(k, v)| shown(k, v))
                .collect();
            let mut line = format!("kafka {}", kafka.bootstrap);
            if let Some(id) = &kafka.client_id {
                line.push_str(&format!(", client.id {id}"));
            }
            if !properties.is_empty() {
                line.push_str(&format!(" ({})", properties.join(", ")));
            }
            line
        }
    }
}

/// A property name as a TOML key (`"sasl.password"`).
fn quote_key(key: &str) -> String {
    if key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        key.to_owned()
    } else {
        format!("{key:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_in_urls_are_seen() {
        assert!(url_has_password("amqp://u:p@h/v"));
        assert!(!url_has_password("amqp://u@h/v"));
        assert!(!url_has_password("amqp://h/v@x"));
        assert!(!url_has_password("amqp://h:5672/%2f"));
    }
}
