//! When is a message due? The ingress header contract:
//!
//! - `x-deliver-at`: absolute due time, epoch milliseconds (any integer type
//!   or a numeric string), an RFC 3339 timestamp, or an AMQP `timestamp`,
//!   which is epoch *seconds* (Java's `Date` and Python's `datetime` headers
//!   become one). It wins over `x-delay`.
//! - `x-delay`: milliseconds relative to arrival, converted as the
//!   delayed-message-exchange plugin does: every AMQP integer type, numeric
//!   strings, floats truncated. Missing, 0 or negative: publish at once.
//!   Unlike the plugin, delays above 2^32-1 ms are honoured up to `max_delay`.
//!
//! - `x-opt-delivery-time` and `x-opt-delivery-delay`: the same two from an
//!   AMQP 1.0 producer, as message annotations (Tanzu RabbitMQ's delayed
//!   queues take them so), which RabbitMQ 4 hands to an AMQP 0-9-1 consumer
//!   as headers. `x-opt-delivery-time` arrives as an AMQP 0-9-1 `timestamp`
//!   in whole seconds (the conversion drops the milliseconds), so it counts
//!   as the *end* of that second: never early, at most 999 ms late. A time
//!   wins over a delay, and of two times or two delays the 0-9-1 name wins.
//!
//! Anything else (text that is not a number, NaN, a boolean, a table, a
//! timestamp in `x-delay`, a delay beyond `max_delay`) is an [`InvalidDelay`],
//! and the message goes to the route's invalid destination with the reason.

use std::time::Duration;

use delayd_adapters::{FieldTable, Value};

pub const X_DELAY: &str = "x-delay";
pub const X_DELIVER_AT: &str = "x-deliver-at";
/// AMQP 1.0 message annotations (see the module doc).
pub const X_OPT_DELIVERY_TIME: &str = "x-opt-delivery-time";
pub const X_OPT_DELIVERY_DELAY: &str = "x-opt-delivery-delay";

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidDelay {
    #[error("{header} header has unusable type {kind}")]
    Type {
        header: &'static str,
        kind: &'static str,
    },
    #[error("{header} header {text:?} is not a number{}", if *.header == X_DELIVER_AT || *.header == X_OPT_DELIVERY_TIME { " or RFC 3339 time" } else { "" })]
    Unparseable { header: &'static str, text: String },
    #[error("delay of {delay_ms} ms is over the route's max_delay of {max_ms} ms")]
    TooLong { delay_ms: u128, max_ms: u128 },
    #[error("{header} header is {text}, not a finite number")]
    NotFinite { header: &'static str, text: String },
}

/// A number from a header: whole milliseconds, or a float to truncate.
enum Number {
    Int(i128),
    Float(f64),
}

fn number(header: &'static str, value: &Value) -> Result<Number, InvalidDelay> {
    let n = match value {
        Value::I8(x) => Number::Int(*x as i128),
        Value::U8(x) => Number::Int(*x as i128),
        Value::I16(x) => Number::Int(*x as i128),
        Value::U16(x) => Number::Int(*x as i128),
        Value::I32(x) => Number::Int(*x as i128),
        Value::U32(x) => Number::Int(*x as i128),
        Value::I64(x) => Number::Int(*x as i128),
        Value::U64(x) => Number::Int(*x as i128),
        Value::F32(x) => Number::Float(*x as f64),
        Value::F64(x) => Number::Float(*x),
        Value::Decimal { scale, value } => Number::Float(*value as f64 / 10f64.powi(*scale as i32)),
        Value::ShortString(_) | Value::LongString(_) | Value::ByteArray(_) => {
            let text = value.as_text().ok_or(InvalidDelay::Type {
                header,
                kind: "non-UTF-8 bytes",
            })?;
            return parse_text(header, text);
        }
        Value::Bool(_) => {
            return Err(InvalidDelay::Type {
                header,
                kind: "boolean",
            })
        }
        Value::Array(_) => {
            return Err(InvalidDelay::Type {
                header,
                kind: "array",
            })
        }
        Value::Table(_) => {
            return Err(InvalidDelay::Type {
                header,
                kind: "table",
            })
        }
        Value::Void => {
            return Err(InvalidDelay::Type {
                header,
                kind: "void",
            })
        }
        // A point in time, not a number of ms: only `x-deliver-at` takes one.
        Value::Timestamp(_) => {
            return Err(InvalidDelay::Type {
                header,
                kind: "timestamp (a point in time; use x-deliver-at)",
            })
        }
    };
    Ok(n)
}

fn parse_text(header: &'static str, text: &str) -> Result<Number, InvalidDelay> {
    let t = text.trim();
    if let Ok(i) = t.parse::<i128>() {
        return Ok(Number::Int(i));
    }
    match t.parse::<f64>() {
        Ok(f) if t.chars().any(|c| c.is_ascii_digit()) => Ok(Number::Float(f)),
        _ => Err(InvalidDelay::Unparseable {
            header,
            text: text.to_owned(),
        }),
    }
}

fn whole_ms(header: &'static str, n: Number) -> Result<i128, InvalidDelay> {
    match n {
        Number::Int(i) => Ok(i),
        Number::Float(f) if f.is_finite() => Ok(f.trunc() as i128),
        Number::Float(f) => Err(InvalidDelay::NotFinite {
            header,
            text: f.to_string(),
        }),
    }
}

/// The whole milliseconds of an `x-delay` value, if it is a usable number.
pub fn delay_ms(value: &Value) -> Option<i128> {
    whole_ms(X_DELAY, number(X_DELAY, value).ok()?).ok()
}

/// The due time (epoch ms) of a message whose delay counts from `now_ms`
/// (its arrival: see `super::clock`).
pub fn due_from_headers(
    headers: &FieldTable,
    now_ms: u64,
    max_delay: Duration,
) -> Result<u64, InvalidDelay> {
    let max_ms = max_delay.as_millis();
    let check = |delay: i128| -> Result<u64, InvalidDelay> {
        if delay <= 0 {
            return Ok(now_ms);
        }
        let too_long = InvalidDelay::TooLong {
            delay_ms: delay as u128,
            max_ms,
        };
        if delay as u128 > max_ms {
            return Err(too_long);
        }
        // Never truncate or wrap: a delay past the u64 clock is refused.
        u64::try_from(delay)
            .ok()
            .and_then(|d| now_ms.checked_add(d))
            .ok_or(too_long)
    };
    for header in [X_DELIVER_AT, X_OPT_DELIVERY_TIME] {
        let Some(value) = headers.get(header) else {
            continue;
        };
        let at = if let Value::Timestamp(secs) = value {
            // AMQP 0-9-1 timestamps are epoch seconds. A converted AMQP 1.0
            // time lost its milliseconds: the end of its second.
            let rounded_up = if header == X_OPT_DELIVERY_TIME {
                999
            } else {
                0
            };
            i128::from(*secs) * 1000 + rounded_up
        } else {
            match value.as_text().map(str::trim) {
                Some(text) => match chrono::DateTime::parse_from_rfc3339(text) {
                    Ok(t) => t.timestamp_millis() as i128,
                    Err(_) => whole_ms(header, parse_text(header, text)?)?,
                },
                None => whole_ms(header, number(header, value)?)?,
            }
        };
        return check(at - now_ms as i128);
    }
    for header in [X_DELAY, X_OPT_DELIVERY_DELAY] {
        if let Some(value) = headers.get(header) {
            return check(whole_ms(header, number(header, value)?)?);
        }
    }
    Ok(now_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_700_000_000_000;
    const MAX: Duration = Duration::from_secs(10 * 365 * 86400);

    fn due(key: &str, v: Value) -> Result<u64, InvalidDelay> {
        due_from_headers(&FieldTable(vec![(key.into(), v)]), NOW, MAX)
    }

    #[test]
    fn amqp_1_0_annotations_are_delays_and_times_never_early() {
        assert_eq!(due(X_OPT_DELIVERY_DELAY, Value::I64(5000)), Ok(NOW + 5000));
        assert_eq!(
            due(X_OPT_DELIVERY_TIME, Value::I64((NOW + 7000) as i64)),
            Ok(NOW + 7000)
        );
        // Converted to a 0-9-1 timestamp: whole seconds; the end of it.
        let secs = (NOW + 7_500) / 1000;
        assert_eq!(
            due(X_OPT_DELIVERY_TIME, Value::Timestamp(secs)),
            Ok(secs * 1000 + 999)
        );
        // The 0-9-1 names win.
        let both = FieldTable(vec![
            (X_OPT_DELIVERY_DELAY.into(), Value::I64(9000)),
            (X_DELAY.into(), Value::I64(1000)),
        ]);
        assert_eq!(due_from_headers(&both, NOW, MAX), Ok(NOW + 1000));
        assert!(matches!(
            due(X_OPT_DELIVERY_DELAY, Value::Bool(true)),
            Err(InvalidDelay::Type {
                header: X_OPT_DELIVERY_DELAY,
                ..
            })
        ));
    }

    #[test]
    fn every_integer_type_is_a_delay() {
        for v in [
            Value::I8(5),
            Value::U8(5),
            Value::I16(5),
            Value::U16(5),
            Value::I32(5),
            Value::U32(5),
            Value::I64(5),
            Value::U64(5),
        ] {
            assert_eq!(due(X_DELAY, v.clone()), Ok(NOW + 5), "{v:?}");
        }
    }

    #[test]
    fn strings_and_floats_convert_like_the_plugin() {
        assert_eq!(
            due(X_DELAY, Value::LongString(b"1500".to_vec())),
            Ok(NOW + 1500)
        );
        assert_eq!(
            due(X_DELAY, Value::ShortString(" 42 ".into())),
            Ok(NOW + 42)
        );
        assert_eq!(
            due(X_DELAY, Value::LongString(b"99.9".to_vec())),
            Ok(NOW + 99)
        );
        assert_eq!(due(X_DELAY, Value::F64(1234.99)), Ok(NOW + 1234));
        assert_eq!(due(X_DELAY, Value::F32(10.5)), Ok(NOW + 10));
    }

    #[test]
    fn decimals_and_byte_arrays_are_delays() {
        // 1500.75 ms, truncated as the plugin truncates floats.
        let decimal = Value::Decimal {
            scale: 2,
            value: 150_075,
        };
        assert_eq!(due(X_DELAY, decimal), Ok(NOW + 1500));
        let whole = Value::Decimal {
            scale: 0,
            value: 700,
        };
        assert_eq!(due(X_DELAY, whole), Ok(NOW + 700));
        assert_eq!(
            due(X_DELAY, Value::ByteArray(b"2500".to_vec())),
            Ok(NOW + 2500)
        );
    }

    #[test]
    fn words_a_float_parser_takes_are_not_delays() {
        // Rust's f64 parser reads these; a delay must have a digit in it.
        for text in ["inf", "-infinity", "NaN", "+inf"] {
            let e = due(X_DELAY, Value::LongString(text.as_bytes().to_vec())).unwrap_err();
            assert!(matches!(e, InvalidDelay::Unparseable { .. }), "{text}: {e}");
        }
    }

    #[test]
    fn missing_zero_and_negative_mean_now() {
        assert_eq!(due_from_headers(&FieldTable::new(), NOW, MAX), Ok(NOW));
        assert_eq!(due(X_DELAY, Value::I32(0)), Ok(NOW));
        assert_eq!(due(X_DELAY, Value::I32(-500)), Ok(NOW));
        assert_eq!(due(X_DELAY, Value::LongString(b"-3".to_vec())), Ok(NOW));
    }

    #[test]
    fn delays_beyond_u32_are_honoured_up_to_max() {
        let big = (u32::MAX as i64) + 1000;
        assert_eq!(due(X_DELAY, Value::I64(big)), Ok(NOW + big as u64));
        assert!(matches!(
            due(X_DELAY, Value::I64(i64::MAX)),
            Err(InvalidDelay::TooLong { .. })
        ));
    }

    #[test]
    fn a_delay_of_exactly_max_delay_is_kept_one_ms_more_is_not() {
        let max = 3_600_000u64;
        let limit = Duration::from_millis(max);
        let at = |ms: u64| {
            let h = FieldTable(vec![(X_DELAY.into(), Value::I64(ms as i64))]);
            due_from_headers(&h, NOW, limit)
        };
        assert_eq!(at(max), Ok(NOW + max));
        assert!(matches!(at(max + 1), Err(InvalidDelay::TooLong { .. })));
    }

    #[test]
    fn a_delay_beyond_u64_ms_is_never_truncated_into_an_early_one() {
        // 2^64 + 5 ms: `as u64` would make it 5 ms.
        let h = FieldTable(vec![(
            X_DELAY.into(),
            Value::LongString(b"18446744073709551621".to_vec()),
        )]);
        assert!(matches!(
            due_from_headers(&h, NOW, Duration::MAX),
            Err(InvalidDelay::TooLong { .. })
        ));
    }

    #[test]
    fn garbage_is_invalid_with_a_reason() {
        let e = due(X_DELAY, Value::LongString(b"soon".to_vec())).unwrap_err();
        assert!(e.to_string().contains("\"soon\""), "{e}");
        assert!(matches!(
            due(X_DELAY, Value::Bool(true)),
            Err(InvalidDelay::Type { .. })
        ));
        assert!(matches!(
            due(X_DELAY, Value::F64(f64::NAN)),
            Err(InvalidDelay::NotFinite { .. })
        ));
        assert!(matches!(
            due(X_DELAY, Value::LongString(vec![0xff, 0xfe])),
            Err(InvalidDelay::Type { .. })
        ));
        assert!(due(X_DELAY, Value::LongString(b"".to_vec())).is_err());
    }

    #[test]
    fn deliver_at_takes_epoch_ms_and_rfc3339() {
        assert_eq!(
            due(X_DELIVER_AT, Value::I64((NOW + 5000) as i64)),
            Ok(NOW + 5000)
        );
        assert_eq!(
            due(
                X_DELIVER_AT,
                Value::LongString(format!("{}", NOW + 7).into_bytes())
            ),
            Ok(NOW + 7)
        );
        let t = chrono::DateTime::from_timestamp_millis((NOW + 60_000) as i64)
            .unwrap()
            .to_rfc3339();
        assert_eq!(
            due(X_DELIVER_AT, Value::LongString(t.into_bytes())),
            Ok(NOW + 60_000)
        );
        assert_eq!(
            due(
                X_DELIVER_AT,
                Value::LongString(b"2000-01-01T00:00:00Z".to_vec())
            ),
            Ok(NOW)
        );
        assert!(due(X_DELIVER_AT, Value::LongString(b"tomorrow".to_vec())).is_err());
    }

    #[test]
    fn deliver_at_timestamp_is_epoch_seconds() {
        // Java's Date and pika's datetime headers arrive as AMQP timestamps.
        let at_s = NOW / 1000 + 3600;
        assert_eq!(due(X_DELIVER_AT, Value::Timestamp(at_s)), Ok(at_s * 1000));
        assert_eq!(due(X_DELIVER_AT, Value::Timestamp(0)), Ok(NOW));
        assert!(matches!(
            due(X_DELIVER_AT, Value::Timestamp(u64::MAX)),
            Err(InvalidDelay::TooLong { .. })
        ));
    }

    #[test]
    fn timestamp_delay_is_invalid() {
        let e = due(X_DELAY, Value::Timestamp(5)).unwrap_err();
        assert!(
            matches!(e, InvalidDelay::Type { kind, .. } if kind.contains("timestamp")),
            "{e}"
        );
    }

    #[test]
    fn deliver_at_wins_over_delay() {
        let h = FieldTable(vec![
            (X_DELAY.into(), Value::I32(1)),
            (X_DELIVER_AT.into(), Value::I64((NOW + 100) as i64)),
        ]);
        assert_eq!(due_from_headers(&h, NOW, MAX), Ok(NOW + 100));
    }
}
