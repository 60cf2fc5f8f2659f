//! TLS for `amqps://` connections, with delayd's own rustls configuration.
//!
//! lapin's built-in TLS (amq-protocol-tcp) takes extra CA certificates and a
//! client identity, but always verifies against the URL's host and trusts the
//! platform's CAs as well. A broker behind a private CA, reached by an
//! address its certificate does not list, needs more: this module builds the
//! [`rustls::ClientConfig`] itself and hands lapin a stream whose handshake it
//! did ([`TlsConnector::handshake`]).
//!
//! * `ca_pem` replaces the system's CAs: a broker certificate must chain to
//!   one of them. Without it, the system's CAs (rustls-native-certs) are used.
//! * `cert_pem` + `key_pem`: the client certificate, presented to brokers
//!   that ask (`verify_peer`), and used to log in with `EXTERNAL`.
//! * `server_name`: the name the certificate must be valid for, and the SNI
//!   sent, instead of the URL's host.
//! * `verify_peer = false` accepts any certificate. It exists for a broker
//!   being set up; the caller logs a warning for it.
//!
//! Handshake failures are turned into sentences that say which of these to
//! look at ([`describe_tls_failure`]), instead of rustls's variant names.

use std::sync::Arc;

use lapin::tcp::RustlsConnector;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    AlertDescription, CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore,
};

/// What a TLS connection to a broker trusts and presents. PEM contents, not
/// paths: the caller reads the files (and names them in its errors).
#[derive(Clone)]
pub struct TlsOptions {
    /// CA certificates (PEM) that broker certificates must chain to, instead
    /// of the system's.
    pub ca_pem: Option<Vec<u8>>,
    /// Client certificate chain (PEM), leaf first.
    pub cert_pem: Option<Vec<u8>>,
    /// The client certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_pem: Option<Vec<u8>>,
    /// Name the broker's certificate must be valid for (and SNI), instead of
    /// the URL's host.
    pub server_name: Option<String>,
    /// Verify the broker's certificate (the default). `false` accepts any.
    pub verify_peer: bool,
}

impl Default for TlsOptions {
    /// The system's CAs, no client certificate, peer verification on (a
    /// default that verified nothing would be a trap).
    fn default() -> Self {
        Self {
            ca_pem: None,
            cert_pem: None,
            key_pem: None,
            server_name: None,
            verify_peer: true,
        }
    }
}

impl TlsOptions {
    /// The same as [`TlsOptions::default`].
    pub fn new() -> Self {
        Self::default()
    }
}

impl std::fmt::Debug for TlsOptions {
    // The key never goes to a log.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsOptions")
            .field("ca", &self.ca_pem.is_some())
            .field("client_cert", &self.cert_pem.is_some())
            .field("server_name", &self.server_name)
            .field("verify_peer", &self.verify_peer)
            .finish_non_exhaustive()
    }
}

/// Errors building a TLS configuration from [`TlsOptions`].
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("the CA file holds no PEM certificate")]
    NoCa,
    #[error("the CA file: {0}")]
    BadCa(String),
    #[error("the client certificate file holds no PEM certificate")]
    NoCert,
    #[error("the client certificate file: {0}")]
    BadCert(String),
    #[error("the client key file holds no PEM private key: {0}")]
    BadKey(String),
    #[error("a client certificate needs its key, and a key its certificate")]
    HalfIdentity,
    #[error("the client certificate and key do not go together: {0}")]
    Identity(String),
    #[error("the system's CA certificates cannot be read: {0}")]
    SystemCas(String),
    #[error("{0:?} is not a valid TLS server name")]
    ServerName(String),
    #[error("TLS set-up failed: {0}")]
    Other(String),
}

/// A ready TLS client configuration and the name to verify against.
pub struct TlsConnector {
    connector: RustlsConnector,
    server_name: Option<String>,
}

impl std::fmt::Debug for TlsConnector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConnector")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl TlsConnector {
    /// Builds the rustls configuration: everything in `options` is parsed
    /// here, so a bad file fails at start rather than at the first connect.
    pub fn new(options: &TlsOptions) -> Result<Self, TlsError> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        if let Some(name) = &options.server_name {
            ServerName::try_from(name.as_str()).map_err(|_| TlsError::ServerName(name.clone()))?;
        }
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Other(e.to_string()))?;
        let builder = if options.verify_peer {
            let roots = match &options.ca_pem {
                Some(pem) => ca_roots(pem)?,
                None => system_roots()?,
            };
            let verifier = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| TlsError::Other(e.to_string()))?;
            builder.with_webpki_verifier(verifier)
        } else {
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AcceptAnyCertificate(provider)))
        };
        let config = match (&options.cert_pem, &options.key_pem) {
            (Some(cert), Some(key)) => {
                let chain = certificates(cert).map_err(TlsError::BadCert)?;
                if chain.is_empty() {
                    return Err(TlsError::NoCert);
                }
                let key = PrivateKeyDer::from_pem_slice(key)
                    .map_err(|e| TlsError::BadKey(e.to_string()))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| TlsError::Identity(e.to_string()))?
            }
            (None, None) => builder.with_no_client_auth(),
            _ => return Err(TlsError::HalfIdentity),
        };
        Ok(Self {
            connector: RustlsConnector::from(Arc::new(config)),
            server_name: options.server_name.clone(),
        })
    }

    /// The name a broker reached at `host` must prove: `server_name` if set.
    pub fn name_for<'a>(&'a self, host: &'a str) -> &'a str {
        self.server_name.as_deref().unwrap_or(host)
    }

    pub(crate) fn connector(&self) -> &RustlsConnector {
        &self.connector
    }
}

fn certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())
}

fn ca_roots(pem: &[u8]) -> Result<RootCertStore, TlsError> {
    let certs = certificates(pem).map_err(TlsError::BadCa)?;
    if certs.is_empty() {
        return Err(TlsError::NoCa);
    }
    let mut roots = RootCertStore::empty();
    for cert in certs {
        roots
            .add(cert)
            .map_err(|e| TlsError::BadCa(e.to_string()))?;
    }
    Ok(roots)
}

fn system_roots() -> Result<RootCertStore, TlsError> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .first()
            .map(ToString::to_string)
            .unwrap_or_else(|| "none found (install ca-certificates, or set tls.ca_file)".into());
        return Err(TlsError::SystemCas(why));
    }
    Ok(roots)
}

/// `verify_peer = false`: any certificate is taken, but handshake
/// signatures are still checked (the peer must hold the key it shows).
#[derive(Debug)]
struct AcceptAnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AcceptAnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// What a TLS failure means for the user, if `error` (or one of its
/// sources) is one: `server_name` is the name the certificate was checked
/// against.
pub fn describe_tls_failure(
    error: &(dyn std::error::Error + 'static),
    server_name: &str,
) -> Option<String> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(describe_rustls(tls, server_name));
        }
        // io::Error keeps its inner error out of `source()`.
        if let Some(inner) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(describe_rustls(inner, server_name));
        }
        current = e.source();
    }
    None
}

fn describe_rustls(error: &rustls::Error, server_name: &str) -> String {
    use rustls::Error as E;
    match error {
        E::InvalidCertificate(CertificateError::UnknownIssuer) => format!(
            "TLS: the broker's certificate was not issued by a CA delayd trusts \
             (tls.ca_file, or the system's CAs without it): {error}"
        ),
        E::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => format!(
            "TLS: the broker's certificate is not valid for the server name {server_name:?} \
             (set tls.server_name to a name it lists): {error}"
        ),
        E::InvalidCertificate(
            CertificateError::Expired
            | CertificateError::ExpiredContext { .. }
            | CertificateError::NotValidYet
            | CertificateError::NotValidYetContext { .. },
        ) => format!("TLS: the broker's certificate is outside its validity period: {error}"),
        E::InvalidCertificate(_) => format!("TLS: the broker's certificate is refused: {error}"),
        E::AlertReceived(AlertDescription::CertificateRequired) => {
            "TLS: the broker requires a client certificate (set tls.cert_file and tls.key_file)"
                .into()
        }
        E::AlertReceived(
            AlertDescription::BadCertificate
            | AlertDescription::UnknownCA
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateRevoked
            | AlertDescription::AccessDenied,
        ) => format!("TLS: the broker refused delayd's client certificate ({error})"),
        E::InvalidMessage(_) | E::InappropriateMessage { .. } => format!(
            "TLS: the handshake failed ({error}); is this port a TLS listener (amqps://, usually 5671)?"
        ),
        _ => format!("TLS: the handshake failed: {error}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_an_identity_is_refused() {
        let mut options = TlsOptions::new();
        options.ca_pem = None;
        options.verify_peer = false;
        options.key_pem =
            Some(b"-----BEGIN PRIVATE KEY-----\n-----END PRIVATE KEY-----\n".to_vec());
        assert!(matches!(
            TlsConnector::new(&options),
            Err(TlsError::HalfIdentity)
        ));
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused() {
        let mut options = TlsOptions::new();
        options.ca_pem = Some(b"not a certificate\n".to_vec());
        assert!(matches!(TlsConnector::new(&options), Err(TlsError::NoCa)));
    }

    #[test]
    fn a_bad_server_name_is_refused() {
        let mut options = TlsOptions::new();
        options.verify_peer = false;
        options.server_name = Some("not a name!".into());
        assert!(matches!(
            TlsConnector::new(&options),
            Err(TlsError::ServerName(_))
        ));
    }

    #[test]
    fn failures_say_what_to_look_at() {
        let unknown = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, unknown);
        let text = describe_tls_failure(&io, "rabbit").unwrap();
        assert!(text.contains("tls.ca_file"), "{text}");

        let name = rustls::Error::InvalidCertificate(CertificateError::NotValidForName);
        let text = describe_tls_failure(&name, "wrong.example").unwrap();
        assert!(
            text.contains("\"wrong.example\"") && text.contains("server_name"),
            "{text}"
        );

        let plain = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert!(describe_tls_failure(&plain, "x").is_none());
    }
}
