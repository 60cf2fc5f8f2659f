//! Durations in config: a humantime string ("10s", "1m 30s", "250ms") or a
//! plain integer of milliseconds.

use std::time::Duration;

use serde::{de, Deserialize, Deserializer, Serializer};

#[derive(Deserialize)]
#[serde(untagged)]
enum Raw {
    Millis(u64),
    Text(String),
}

fn parse(raw: Raw) -> Result<Duration, String> {
    match raw {
        Raw::Millis(ms) => Ok(Duration::from_millis(ms)),
        Raw::Text(s) => humantime::parse_duration(s.trim()).map_err(|e| {
            format!("invalid duration {s:?} ({e}); use e.g. \"10s\", \"5m\" or milliseconds")
        }),
    }
}

pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&humantime::format_duration(*d).to_string())
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    parse(Raw::deserialize(d)?).map_err(de::Error::custom)
}

pub mod option {
    use super::*;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => super::serialize(d, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        match Option::<Raw>::deserialize(d)? {
            Some(raw) => parse(raw).map(Some).map_err(de::Error::custom),
            None => Ok(None),
        }
    }
}
