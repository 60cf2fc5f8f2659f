//! Where one RabbitMQ broker (or cluster) is reached: its URLs in order, the
//! password and login mechanism, and the TLS settings, parsed once.
//!
//! A [`Broker`](super::Broker) tries the endpoints in order on every
//! (re)connect and keeps the first that answers, so a cluster's nodes can be
//! listed and a dead node is skipped. Credentials never leave this module
//! in text: [`redact_url`] hides a URL's password in every message, and
//! [`Endpoint::label`] is `host:port/vhost`.

use std::str::FromStr;
use std::sync::Arc;

use lapin::uri::{AMQPScheme, AMQPUri, SASLMechanism};

use super::tls::{TlsConnector, TlsError, TlsOptions};

/// How to reach one broker, as configured. Build [`Endpoints`] from it.
#[derive(Clone, Default)]
pub struct AmqpSettings {
    /// `amqp://` or `amqps://` URLs, tried in this order.
    pub urls: Vec<String>,
    /// Replaces the password of every URL (read from a file by the caller).
    pub password: Option<String>,
    /// TLS settings for `amqps://` URLs (the system's CAs when `None`).
    pub tls: Option<TlsOptions>,
    /// Log in with `EXTERNAL` (the TLS client certificate names the user).
    pub external_auth: bool,
}

impl AmqpSettings {
    /// One URL, nothing else.
    pub fn url(url: impl Into<String>) -> Self {
        Self {
            urls: vec![url.into()],
            ..Self::default()
        }
    }
}

impl std::fmt::Debug for AmqpSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<String> = self.urls.iter().map(|u| redact_url(u)).collect();
        f.debug_struct("AmqpSettings")
            .field("urls", &urls)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("tls", &self.tls)
            .field("external_auth", &self.external_auth)
            .finish()
    }
}

/// Errors turning [`AmqpSettings`] into [`Endpoints`].
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("no AMQP URL")]
    Empty,
    /// The message never holds the password.
    #[error("invalid AMQP URL {url}: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("TLS settings are given but {url} is not amqps://")]
    TlsWithoutAmqps { url: String },
    #[error("EXTERNAL login needs amqps:// and a client certificate ({url})")]
    ExternalWithoutCertificate { url: String },
    #[error(transparent)]
    Tls(#[from] TlsError),
}

/// One URL of a broker, parsed.
#[derive(Clone)]
pub struct Endpoint {
    pub(crate) uri: AMQPUri,
    label: String,
}

impl Endpoint {
    /// `host:port/vhost`, for logs (never the credentials).
    pub fn label(&self) -> &str {
        &self.label
    }

    pub fn is_tls(&self) -> bool {
        self.uri.scheme == AMQPScheme::AMQPS
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label)
    }
}

/// A broker's endpoints in the order they are tried, and its TLS client.
#[derive(Debug)]
pub struct Endpoints {
    list: Vec<Endpoint>,
    tls: Option<Arc<TlsConnector>>,
    /// TLS peer verification is off (worth a warning at start).
    unverified: bool,
}

impl Endpoints {
    /// Parses every URL, applies the password and login mechanism, and
    /// builds the TLS client when a URL is `amqps://`.
    pub fn new(settings: &AmqpSettings) -> Result<Self, EndpointError> {
        if settings.urls.is_empty() {
            return Err(EndpointError::Empty);
        }
        let mut list = Vec::with_capacity(settings.urls.len());
        for url in &settings.urls {
            let mut uri = AMQPUri::from_str(url.trim()).map_err(|reason| {
                EndpointError::InvalidUrl {
                    url: redact_url(url),
                    // amq-protocol-uri quotes the whole URL in some errors.
                    reason: reason.replace(url.trim(), &redact_url(url)),
                }
            })?;
            if let Some(password) = &settings.password {
                uri.authority.userinfo.password = password.clone();
            }
            let tls = uri.scheme == AMQPScheme::AMQPS;
            if settings.tls.is_some() && !tls {
                return Err(EndpointError::TlsWithoutAmqps {
                    url: redact_url(url),
                });
            }
            if settings.external_auth {
                let has_cert = settings.tls.as_ref().is_some_and(|t| t.cert_pem.is_some());
                if !tls || !has_cert {
                    return Err(EndpointError::ExternalWithoutCertificate {
                        url: redact_url(url),
                    });
                }
                uri.query.auth_mechanism = Some(SASLMechanism::External);
            }
            let separator = if uri.vhost.starts_with('/') { "" } else { "/" };
            let label = format!(
                "{}:{}{separator}{}",
                uri.authority.host, uri.authority.port, uri.vhost
            );
            list.push(Endpoint { uri, label });
        }
        let tls = if list.iter().any(Endpoint::is_tls) {
            let options = settings.tls.clone().unwrap_or_default();
            Some(Arc::new(TlsConnector::new(&options)?))
        } else {
            None
        };
        Ok(Self {
            list,
            tls,
            unverified: settings.tls.as_ref().is_some_and(|t| !t.verify_peer),
        })
    }

    /// In the order they are tried.
    pub fn list(&self) -> &[Endpoint] {
        &self.list
    }

    pub(crate) fn tls(&self) -> Option<&Arc<TlsConnector>> {
        self.tls.as_ref()
    }

    /// Whether TLS peer verification is turned off.
    pub fn unverified(&self) -> bool {
        self.unverified
    }

    /// Every endpoint's label, comma-separated.
    pub fn labels(&self) -> String {
        self.list
            .iter()
            .map(Endpoint::label)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `url` with its password replaced by `***` (the user name is kept).
/// Anything that does not look like a URL with credentials is returned as is.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        // Not a URL delayd can take apart: hide all of it if it might hold
        // credentials.
        return if url.contains('@') {
            "***".into()
        } else {
            url.to_owned()
        };
    };
    let rest_start = scheme_end + 3;
    let rest = &url[rest_start..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &authority[..at];
    let Some(colon) = userinfo.find(':') else {
        return url.to_owned();
    };
    format!(
        "{}{}:***{}",
        &url[..rest_start],
        &userinfo[..colon],
        &url[rest_start + at..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redaction_hides_only_the_password() {
        assert_eq!(
            redact_url("amqp://user:s3cret@rabbit:5672/%2f"),
            "amqp://user:***@rabbit:5672/%2f"
        );
        assert_eq!(
            redact_url("amqps://u:p@ss:w@rd@h/v"),
            "amqps://u:***@h/v",
            "the last @ ends the credentials"
        );
        assert_eq!(redact_url("amqp://user@rabbit/"), "amqp://user@rabbit/");
        assert_eq!(redact_url("amqp://rabbit/x@y"), "amqp://rabbit/x@y");
        assert_eq!(redact_url("not a url"), "not a url");
        assert_eq!(redact_url("amqp:user:s3cret@rabbit"), "***");
    }

    #[test]
    fn a_bad_url_error_never_shows_the_password() {
        let settings = AmqpSettings::url("amqp://user:s3cret@[::1:5672/%2f");
        let error = Endpoints::new(&settings).unwrap_err().to_string();
        assert!(!error.contains("s3cret"), "{error}");
        assert!(error.contains("user:***"), "{error}");
    }

    #[test]
    fn password_and_external_apply_to_every_url() {
        let settings = AmqpSettings {
            urls: vec![
                "amqp://delayd@a:5672/%2f".into(),
                "amqp://delayd:old@b:5673/v".into(),
            ],
            password: Some("from-file".into()),
            ..AmqpSettings::default()
        };
        let endpoints = Endpoints::new(&settings).unwrap();
        let passwords: Vec<_> = endpoints
            .list()
            .iter()
            .map(|e| e.uri.authority.userinfo.password.as_str())
            .collect();
        assert_eq!(passwords, ["from-file", "from-file"]);
        assert_eq!(endpoints.labels(), "a:5672/, b:5673/v");
        assert!(endpoints.tls().is_none());
        assert!(!format!("{settings:?}").contains("from-file"));

        let external = AmqpSettings {
            urls: vec!["amqp://a/%2f".into()],
            external_auth: true,
            ..AmqpSettings::default()
        };
        assert!(matches!(
            Endpoints::new(&external),
            Err(EndpointError::ExternalWithoutCertificate { .. })
        ));
    }

    #[test]
    fn tls_settings_need_amqps() {
        let settings = AmqpSettings {
            urls: vec!["amqp://a/%2f".into()],
            tls: Some(TlsOptions::new()),
            ..AmqpSettings::default()
        };
        assert!(matches!(
            Endpoints::new(&settings),
            Err(EndpointError::TlsWithoutAmqps { .. })
        ));
    }
}
