//! The admin API's JSON bodies, shared by the server (`admin`) and its
//! command-line client (`messages`), so the two cannot drift apart.

use serde::{Deserialize, Serialize};

use crate::engine::Phase;

/// `GET /v1/messages`: one page, in (due, id) order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MessagePage {
    pub items: Vec<MessageSummary>,
    /// Give it as `cursor` for the next page; `None` on the last one.
    pub next_cursor: Option<String>,
}

/// One pending message, as listed. The fields read from its stored record
/// are `None` when the record cannot be read or decoded.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MessageSummary {
    /// The message's identity, the `x-delayd-id` it goes out with (see
    /// `crate::id`); what `GET`/`DELETE /v1/messages/{id}` take.
    pub id: String,
    /// Its sequence number in this instance's WAL (local; a string, since it
    /// can pass 2^53, beyond what JSON numbers keep exactly).
    #[serde(default)]
    pub seq: String,
    pub route: String,
    pub due_ms: u64,
    /// `due_ms` in RFC 3339.
    pub due: String,
    pub phase: Phase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<usize>,
    #[serde(default)]
    pub message_id: Option<String>,
    /// The Kafka key, as UTF-8 (lossy).
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub routing_key: Option<String>,
    /// The queue or topic it was consumed from.
    #[serde(default)]
    pub source: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<MessageTarget>,
}

/// Where a message will be published.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MessageTarget {
    pub broker: String,
    /// Exchange or topic.
    pub destination: String,
    pub routing_key: String,
}

/// `GET /v1/messages/{id}`: the summary, the message's headers and
/// properties, and its body when asked for (`?body=true`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MessageDetail {
    #[serde(flatten)]
    pub summary: MessageSummary,
    /// Header values as JSON: numbers and strings as such, binary as
    /// `{"hex": ...}`, decimals as `{"scale", "value"}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub properties: Option<MessageProperties>,
    /// The body as text, when it is UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// The body in hex, when it is not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_hex: Option<String>,
}

/// The AMQP properties of a stored message.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MessageProperties {
    pub content_type: Option<String>,
    pub content_encoding: Option<String>,
    pub delivery_mode: Option<u8>,
    pub priority: Option<u8>,
    pub correlation_id: Option<String>,
    pub reply_to: Option<String>,
    pub expiration: Option<String>,
    pub message_id: Option<String>,
    pub timestamp: Option<u64>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub user_id: Option<String>,
    pub app_id: Option<String>,
}

impl From<delayd_adapters::Properties> for MessageProperties {
    /// The API shows every property but `cluster_id` (deprecated in AMQP).
    fn from(p: delayd_adapters::Properties) -> Self {
        Self {
            content_type: p.content_type,
            content_encoding: p.content_encoding,
            delivery_mode: p.delivery_mode,
            priority: p.priority,
            correlation_id: p.correlation_id,
            reply_to: p.reply_to,
            expiration: p.expiration,
            message_id: p.message_id,
            timestamp: p.timestamp,
            kind: p.kind,
            user_id: p.user_id,
            app_id: p.app_id,
        }
    }
}

/// `DELETE /v1/messages/{id}` cancels one id; `DELETE /v1/messages?...`
/// every id with a key.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cancelled {
    pub cancelled: CancelledIds,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum CancelledIds {
    One(String),
    Many(Vec<String>),
}

/// `DELETE /v1/messages?route=R[&due_from=&due_to=][&dry_run=true]`: a purge.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Purged {
    pub route: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub due_from: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub due_to: Option<u64>,
    /// Only counted, nothing removed.
    pub dry_run: bool,
    /// Pending messages of the route within the window when it was walked.
    pub matched: u64,
    /// Cancelled (their Done records durable).
    pub purged: u64,
    /// Being published at the time: left to leave.
    pub in_flight: u64,
}

/// Every error answer: `{"error": "..."}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiErrorBody {
    pub error: String,
}
