//! Secrets kept out of the config file: values that name a file or an
//! environment variable, and files read at start.
//!
//! A Kafka property value (or an AMQP URL) that is exactly `${file:PATH}` is
//! replaced by the file's content, and `${env:NAME}` by the variable's value.
//! The whole value, not a part of it: a password may contain any text, and
//! no escaping rules are needed. A file's trailing line break is dropped
//! (`echo secret > file` and Kubernetes secrets both work).
//!
//! Errors name the key and the file or variable, never the value.

use std::path::Path;

/// Why a secret could not be had. The caller adds the key.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot read {path}: {reason}")]
    File { path: String, reason: String },
    #[error("{path} is empty")]
    EmptyFile { path: String },
    #[error("environment variable {name} is not set")]
    MissingEnv { name: String },
    #[error("environment variable {name} is not valid UTF-8")]
    NotUnicode { name: String },
    #[error("{0:?} is not a reference delayd knows: use ${{file:PATH}} or ${{env:NAME}}")]
    Unknown(String),
}

/// What a value refers to, if it is a reference.
#[derive(Debug, PartialEq, Eq)]
enum Reference<'a> {
    File(&'a str),
    Env(&'a str),
}

fn reference(value: &str) -> Result<Option<Reference<'_>>, SecretError> {
    let Some(inner) = value
        .strip_prefix("${")
        .and_then(|rest| rest.strip_suffix('}'))
    else {
        return Ok(None);
    };
    if let Some(path) = inner.strip_prefix("file:") {
        return Ok(Some(Reference::File(path)));
    }
    if let Some(name) = inner.strip_prefix("env:") {
        return Ok(Some(Reference::Env(name)));
    }
    // `${...}` that is neither: most likely a typo, which would otherwise
    // go to the broker as a password.
    Err(SecretError::Unknown(value.to_owned()))
}

/// Whether `value` is a `${file:...}` or `${env:...}` reference.
pub fn is_reference(value: &str) -> bool {
    !matches!(reference(value), Ok(None))
}

/// `value`, or what it refers to.
pub fn resolve(value: &str) -> Result<String, SecretError> {
    match reference(value)? {
        None => Ok(value.to_owned()),
        Some(Reference::File(path)) => read_file(Path::new(path)),
        Some(Reference::Env(name)) => match std::env::var(name) {
            Ok(v) => Ok(v),
            Err(std::env::VarError::NotPresent) => Err(SecretError::MissingEnv {
                name: name.to_owned(),
            }),
            Err(std::env::VarError::NotUnicode(_)) => Err(SecretError::NotUnicode {
                name: name.to_owned(),
            }),
        },
    }
}

/// A whole file, without its trailing line break; an empty one is an error
/// (an unfilled secret mount would otherwise become an empty password).
pub fn read_file(path: &Path) -> Result<String, SecretError> {
    let text = std::fs::read_to_string(path).map_err(|e| SecretError::File {
        path: path.display().to_string(),
        reason: io_reason(&e),
    })?;
    let trimmed = text.strip_suffix('\n').unwrap_or(&text);
    let trimmed = trimmed.strip_suffix('\r').unwrap_or(trimmed);
    if trimmed.is_empty() {
        return Err(SecretError::EmptyFile {
            path: path.display().to_string(),
        });
    }
    Ok(trimmed.to_owned())
}

/// A file's bytes as they are (certificates, keys).
pub fn read_bytes(path: &Path) -> Result<Vec<u8>, SecretError> {
    std::fs::read(path).map_err(|e| SecretError::File {
        path: path.display().to_string(),
        reason: io_reason(&e),
    })
}

/// The OS's words, without Rust's "(os error 2)".
fn io_reason(e: &std::io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error") {
        Some(at) => text[..at].to_owned(),
        None => text,
    }
}

/// Whether a librdkafka property holds a secret (never printed).
pub fn is_secret_property(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    ["password", "secret", "jaas", ".pem", "oauthbearer.config"]
        .iter()
        .any(|part| key.contains(part))
        && !key.ends_with(".location")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_values_stay() {
        assert_eq!(resolve("SCRAM-SHA-512").unwrap(), "SCRAM-SHA-512");
        assert_eq!(resolve("a ${file:x} b").unwrap(), "a ${file:x} b");
        assert!(!is_reference("plain"));
    }

    #[test]
    fn files_lose_one_trailing_line_break() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "p4ss word\r\n").unwrap();
        let value = format!("${{file:{}}}", path.display());
        assert!(is_reference(&value));
        assert_eq!(resolve(&value).unwrap(), "p4ss word");
        std::fs::write(&path, "\n").unwrap();
        assert!(matches!(
            resolve(&value),
            Err(SecretError::EmptyFile { .. })
        ));
    }

    #[test]
    fn a_missing_file_is_named() {
        let e = resolve("${file:/nonexistent/delayd-secret}").unwrap_err();
        assert_eq!(
            e.to_string(),
            "cannot read /nonexistent/delayd-secret: No such file or directory"
        );
    }

    #[test]
    fn environment_variables() {
        // A name no test environment sets.
        let e = resolve("${env:DELAYD_TEST_SURELY_UNSET_42}").unwrap_err();
        assert!(e.to_string().contains("DELAYD_TEST_SURELY_UNSET_42"), "{e}");
        let path = std::env::var("PATH").unwrap();
        assert_eq!(resolve("${env:PATH}").unwrap(), path);
    }

    #[test]
    fn unknown_references_are_refused() {
        assert!(matches!(
            resolve("${vault:kv/x}"),
            Err(SecretError::Unknown(_))
        ));
    }

    #[test]
    fn secret_properties() {
        for key in [
            "sasl.password",
            "ssl.key.password",
            "ssl.keystore.password",
            "sasl.oauthbearer.client.secret",
            "ssl.key.pem",
            "sasl.oauthbearer.config",
        ] {
            assert!(is_secret_property(key), "{key}");
        }
        for key in ["sasl.username", "ssl.key.location", "security.protocol"] {
            assert!(!is_secret_property(key), "{key}");
        }
    }
}
