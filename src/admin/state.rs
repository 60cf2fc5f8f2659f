//! What the admin server's handlers share: its state (the engine, the
//! runtime's status, the token, cached summaries and samples), the JSON
//! error answer, and the helpers both the API and the status page use.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::rejection::QueryRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::api::{ApiErrorBody, MessageSummary, MessageTarget};
use crate::engine::{DueSummary, Engine, EngineError, PendingInfo};
use crate::id::MessageId;
use crate::route::Route;
use crate::status::{RouteIntake, RuntimeStatus};
use crate::wal::Record;

#[derive(Clone)]
pub struct AdminState {
    pub(crate) engine: Engine,
    pub(crate) status: Arc<dyn RuntimeStatus>,
    pub(crate) token: Option<Arc<str>>,
    metrics: Option<PrometheusHandle>,
    pub(crate) routes: Option<Arc<HashMap<String, Arc<Route>>>>,
    /// The last due-time summary, reused for a second (it walks every
    /// pending message).
    summary: Arc<std::sync::Mutex<Option<CachedSummary>>>,
    /// Fire counts and lateness sampled every few seconds, for rates.
    pub(crate) samples: Arc<Samples>,
}

pub(crate) type Summaries = Arc<BTreeMap<Arc<str>, DueSummary>>;

struct CachedSummary {
    taken: Instant,
    now_ms: u64,
    routes: Summaries,
}

impl AdminState {
    pub fn new(engine: Engine, status: Arc<dyn RuntimeStatus>, token: Option<String>) -> Self {
        Self {
            engine,
            status,
            token: token.map(Arc::from),
            metrics: crate::telemetry::metrics_handle(),
            routes: None,
            summary: Arc::default(),
            samples: Arc::default(),
        }
    }

    /// Every route's due-time summary, at most a second old, and the time
    /// it was taken (ms since the epoch).
    pub(crate) async fn due_summary(&self) -> Result<(u64, Summaries), ApiError> {
        {
            let cached = self.summary.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(c) = cached.as_ref().filter(|c| c.taken.elapsed() < SUMMARY_TTL) {
                return Ok((c.now_ms, c.routes.clone()));
            }
        }
        let engine = self.engine.clone();
        let (now_ms, routes) = tokio::task::spawn_blocking(move || engine.due_summary()).await?;
        let routes = Arc::new(routes);
        *self.summary.lock().unwrap_or_else(|e| e.into_inner()) = Some(CachedSummary {
            taken: Instant::now(),
            now_ms,
            routes: routes.clone(),
        });
        Ok((now_ms, routes))
    }

    /// The recorded metrics in Prometheus text, if metrics are on.
    pub(crate) fn rendered_metrics(&self) -> Option<String> {
        self.metrics.as_ref().map(|handle| {
            self.engine.publish_gauges();
            crate::telemetry::render(handle)
        })
    }

    /// The routes, for listing targets; their counters start at 0 (see
    /// [`crate::telemetry::register_routes`]).
    pub fn with_routes(mut self, routes: Arc<HashMap<String, Arc<Route>>>) -> Self {
        crate::telemetry::register_routes(routes.keys().map(String::as_str));
        self.routes = Some(routes);
        self
    }
}

/// How long a due-time summary is reused.
const SUMMARY_TTL: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreRole {
    /// Owns it (RabbitMQ) or consumes it in the group (Kafka).
    Owner,
    Standby,
    Restoring,
    /// Its state stream is missing: not consumed (see docs/broker-store.md).
    StateMissing,
    Starting,
}

impl StoreRole {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            StoreRole::Owner => "owner",
            StoreRole::Standby => "standby",
            StoreRole::Restoring => "restoring",
            StoreRole::StateMissing => "state missing",
            StoreRole::Starting => "starting",
        }
    }
}

/// Each broker-kept route's role here (none with the local store).
pub(crate) fn store_roles(state: &AdminState) -> Vec<(String, StoreRole)> {
    let store = state.status.store();
    let Some(routes) = store.get("routes").and_then(|r| r.as_object()) else {
        return Vec::new();
    };
    let intake = state.status.routes();
    routes
        .iter()
        .map(|(name, detail)| {
            let role = match (
                detail.get("owner").and_then(|o| o.as_bool()),
                intake.get(name),
            ) {
                (_, Some(RouteIntake::Standby)) => StoreRole::Standby,
                (_, Some(RouteIntake::StateMissing)) => StoreRole::StateMissing,
                (_, Some(RouteIntake::Restoring)) => StoreRole::Restoring,
                (Some(true), _) | (None, Some(RouteIntake::Consuming)) => StoreRole::Owner,
                (Some(false), _) => StoreRole::Standby,
                _ => StoreRole::Starting,
            };
            (name.clone(), role)
        })
        .collect()
}

/// An error answer: a status and `{"error": "..."}`.
pub(crate) struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub(crate) fn internal(error: impl std::fmt::Display) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, error.to_string())
    }

    pub(crate) fn no_such_id(id: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            format!("no pending message with id {id}"),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ApiErrorBody {
            error: self.message,
        };
        (self.status, Json(body)).into_response()
    }
}

/// A malformed query string is a 400 with axum's reason.
impl From<QueryRejection> for ApiError {
    fn from(e: QueryRejection) -> Self {
        ApiError::bad_request(e.body_text())
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::InFlight(id) => ApiError::new(
                StatusCode::CONFLICT,
                format!("message {id} is being published and can no longer be cancelled"),
            ),
            other => ApiError::internal(other),
        }
    }
}

impl From<tokio::task::JoinError> for ApiError {
    fn from(e: tokio::task::JoinError) -> Self {
        ApiError::internal(e)
    }
}

/// One list row: metadata read from the stored record.
pub(crate) fn summary(
    engine: &Engine,
    routes: Option<&HashMap<String, Arc<Route>>>,
    info: &PendingInfo,
) -> MessageSummary {
    let mut row = MessageSummary {
        id: MessageId::legacy(info.id).to_string(),
        seq: info.id.to_string(),
        route: info.route.to_string(),
        due_ms: info.due_ms,
        due: rfc3339(info.due_ms),
        phase: info.phase,
        size: None,
        message_id: None,
        key: None,
        routing_key: None,
        source: None,
        target: None,
    };
    if let Ok(Some(Record::Schedule {
        id, uid, message, ..
    })) = engine.record_of(info)
    {
        row.id = MessageId::or_legacy(uid, id).to_string();
        row.size = Some(message.len());
        if let Ok(m) = delayd_adapters::decode(&message) {
            if let Some(route) = routes.and_then(|r| r.get(&*info.route)) {
                let target = route.target_for(&m);
                row.target = Some(MessageTarget {
                    broker: route.to.broker.clone(),
                    destination: target.destination,
                    routing_key: target.routing_key.unwrap_or_else(|| m.routing_key.clone()),
                });
            }
            row.message_id = m.properties.message_id;
            row.key = m
                .key
                .as_deref()
                .map(|k| String::from_utf8_lossy(k).into_owned());
            row.routing_key = Some(m.routing_key);
            row.source = Some(m.source);
        }
    }
    row
}

/// The local id of the pending message whose identity is `id` (as listed,
/// and as its `x-delayd-id`).
pub(crate) async fn resolve_id(engine: &Engine, id: &str) -> Result<u64, ApiError> {
    let uid: MessageId = id
        .parse()
        .map_err(|_| ApiError::no_such_id(format!("{id:?}")))?;
    let engine = engine.clone();
    tokio::task::spawn_blocking(move || engine.find_by_uid(uid))
        .await??
        .ok_or_else(|| ApiError::no_such_id(uid))
}

pub(crate) fn rfc3339(ms: u64) -> String {
    chrono::DateTime::from_timestamp_millis(ms as i64)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_default()
}

// ------------------------------------------------------------------ samples

/// How often the status page's rates are sampled, and over how long.
pub(crate) const SAMPLE_EVERY: Duration = Duration::from_secs(5);
pub(crate) const WINDOW: Duration = Duration::from_secs(60);

/// Fire counts and lateness histograms per route, sampled from the
/// recorded metrics every few seconds over the last minute.
#[derive(Default)]
pub struct Samples {
    taken: Mutex<VecDeque<(Instant, BTreeMap<String, RouteSample>)>>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct RouteSample {
    pub(crate) fired: f64,
    /// Lateness histogram: (upper bound in seconds, cumulative count).
    pub(crate) buckets: Vec<(f64, f64)>,
}

impl Samples {
    pub(crate) fn push(&self, at: Instant, sample: BTreeMap<String, RouteSample>) {
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        taken.push_back((at, sample));
        while taken
            .front()
            .is_some_and(|(t, _)| at.duration_since(*t) > WINDOW + SAMPLE_EVERY)
        {
            taken.pop_front();
        }
    }

    /// The oldest sample at most a minute old (and at least a second).
    pub(crate) fn baseline(
        &self,
        now: Instant,
    ) -> Option<(Instant, BTreeMap<String, RouteSample>)> {
        let taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        taken
            .iter()
            .find(|(t, _)| now.duration_since(*t) <= WINDOW + SAMPLE_EVERY)
            .filter(|(t, _)| now.duration_since(*t) >= Duration::from_secs(1))
            .cloned()
    }
}
