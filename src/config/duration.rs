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

/// A list of durations, e.g. `["10s", "1m", 600000]`.
pub mod vec {
    use super::*;

    pub fn serialize<S: Serializer>(d: &[Duration], s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = s.serialize_seq(Some(d.len()))?;
        for item in d {
            seq.serialize_element(&humantime::format_duration(*item).to_string())?;
        }
        seq.end()
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Duration>, D::Error> {
        Vec::<Raw>::deserialize(d)?
            .into_iter()
            .map(|raw| parse(raw).map_err(de::Error::custom))
            .collect()
    }
}
