//! Admin HTTP: `/healthz`, `/readyz`, `/metrics`, and the `/v1/messages` API
//! (list, get, cancel). Bound to loopback by default; `/v1` can require a
//! bearer token.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::{Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use delayd_adapters::{FieldTable, Value};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::config::HttpSection;
use crate::engine::{Engine, EngineError, ListQuery, PendingInfo};
use crate::runtime::Brokers;
use crate::wal::Record;

#[derive(Clone)]
pub struct AdminState {
    engine: Engine,
    brokers: Brokers,
    ready: Arc<AtomicBool>,
    token: Option<Arc<str>>,
    metrics: Option<PrometheusHandle>,
}

impl AdminState {
    pub fn new(
        engine: Engine,
        brokers: Brokers,
        ready: Arc<AtomicBool>,
        token: Option<String>,
    ) -> Self {
        Self {
            engine,
            brokers,
            ready,
            token: token.map(Arc::from),
            metrics: crate::telemetry::metrics_handle(),
        }
    }
}

/// The bearer token from config, `DELAYD_HTTP__TOKEN`, or `http.token_file`.
pub fn token(http: &HttpSection) -> anyhow::Result<Option<String>> {
    if let Some(t) = &http.token {
        return Ok(Some(t.trim().to_owned()));
    }
    if let Some(path) = &http.token_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("http.token_file: cannot read {}: {e}", path.display()))?;
        let t = text.lines().next().unwrap_or("").trim().to_owned();
        anyhow::ensure!(
            !t.is_empty(),
            "http.token_file: {} is empty",
            path.display()
        );
        return Ok(Some(t));
    }
    Ok(None)
}

pub fn router(state: AdminState) -> Router {
    let api = Router::new()
        .route("/v1/messages", get(list))
        .route("/v1/messages/{id}", get(show).delete(cancel))
        .route("/v1/counts", get(counts))
        .layer(middleware::from_fn_with_state(state.clone(), require_token));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .merge(api)
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such endpoint") })
        .with_state(state)
}

pub async fn serve(listener: tokio::net::TcpListener, state: AdminState, stop: CancellationToken) {
    let app = router(state);
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await
    {
        tracing::error!(error = %e, "admin server failed");
    }
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

async fn require_token(State(state): State<AdminState>, request: Request, next: Next) -> Response {
    if let Some(expected) = &state.token {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let ok = given.is_some_and(|g| constant_time_eq(g.as_bytes(), expected.as_bytes()));
        if !ok {
            return error(StatusCode::UNAUTHORIZED, "a valid bearer token is required");
        }
    }
    next.run(request).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn readyz(State(state): State<AdminState>) -> Response {
    let brokers = state.brokers.status();
    let all_up = brokers.iter().all(|b| b.ready);
    let ready = state.ready.load(Ordering::Acquire) && all_up && !state.engine.wal().is_stopped();
    let body = json!({
        "ready": ready,
        "wal": if state.engine.wal().is_stopped() { "stopped" } else { "recovered" },
        "brokers": brokers,
        "pending": state.engine.pending(),
    });
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

async fn metrics(State(state): State<AdminState>) -> Response {
    match &state.metrics {
        Some(handle) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            handle.render(),
        )
            .into_response(),
        None => error(StatusCode::SERVICE_UNAVAILABLE, "metrics are not enabled"),
    }
}

async fn counts(State(state): State<AdminState>) -> Response {
    let routes: serde_json::Map<String, serde_json::Value> = state
        .engine
        .counts()
        .into_iter()
        .map(|(r, n)| (r.to_string(), json!(n)))
        .collect();
    Json(json!({ "total": state.engine.pending(), "routes": routes })).into_response()
}

#[derive(Debug, Deserialize)]
struct ListParams {
    route: Option<String>,
    due_from: Option<u64>,
    due_to: Option<u64>,
    cursor: Option<String>,
    limit: Option<usize>,
}

async fn list(State(state): State<AdminState>, Query(p): Query<ListParams>) -> Response {
    let after = match p.cursor.as_deref().map(parse_cursor) {
        Some(Some(c)) => Some(c),
        Some(None) => return error(StatusCode::BAD_REQUEST, "malformed cursor"),
        None => None,
    };
    let limit = p.limit.unwrap_or(100).clamp(1, 1000);
    let query = ListQuery {
        route: p.route,
        due_from: p.due_from,
        due_to: p.due_to,
        after,
        limit,
    };
    let engine = state.engine.clone();
    let result = tokio::task::spawn_blocking(move || {
        let page = engine.list(&query);
        let items: Vec<serde_json::Value> =
            page.iter().map(|info| summary(&engine, info)).collect();
        let next = (page.len() == limit)
            .then(|| page.last().map(|l| format!("{}.{}", l.due_ms, l.id)))
            .flatten();
        json!({ "items": items, "next_cursor": next })
    })
    .await;
    match result {
        Ok(body) => Json(body).into_response(),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

fn parse_cursor(s: &str) -> Option<(u64, u64)> {
    let (due, id) = s.split_once('.')?;
    Some((due.parse().ok()?, id.parse().ok()?))
}

/// One list row: metadata read from the stored record.
fn summary(engine: &Engine, info: &PendingInfo) -> serde_json::Value {
    let mut row = json!({
        "id": info.id.to_string(),
        "route": info.route,
        "due_ms": info.due_ms,
        "due": rfc3339(info.due_ms),
        "phase": info.phase,
    });
    if let Ok(Record::Schedule { message, .. }) = engine.wal().read(info.pos) {
        row["size"] = json!(message.len());
        if let Ok(m) = delayd_adapters::decode(&message) {
            row["message_id"] = json!(m.properties.message_id);
            row["key"] = json!(m.key.as_deref().map(String::from_utf8_lossy));
            row["routing_key"] = json!(m.routing_key);
            row["source"] = json!(m.source);
        }
    }
    row
}

#[derive(Debug, Deserialize)]
struct ShowParams {
    #[serde(default)]
    body: bool,
}

fn parse_id(id: &str) -> Result<u64, Box<Response>> {
    id.parse().map_err(|_| {
        Box::new(error(
            StatusCode::NOT_FOUND,
            format!("no pending message with id {id:?}"),
        ))
    })
}

async fn show(
    State(state): State<AdminState>,
    Path(id): Path<String>,
    Query(p): Query<ShowParams>,
) -> Response {
    let id = match parse_id(&id) {
        Ok(id) => id,
        Err(r) => return *r,
    };
    let engine = state.engine.clone();
    let found = tokio::task::spawn_blocking(move || engine.read(id)).await;
    let (info, record) = match found {
        Ok(Ok(Some(x))) => x,
        Ok(Ok(None)) => {
            return error(
                StatusCode::NOT_FOUND,
                format!("no pending message with id {id}"),
            )
        }
        Ok(Err(e)) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let mut out = summary(&state.engine, &info);
    if let Record::Schedule { message, .. } = record {
        if let Ok(m) = delayd_adapters::decode(&message) {
            out["headers"] = table_json(&m.headers);
            out["properties"] = json!({
                "content_type": m.properties.content_type,
                "content_encoding": m.properties.content_encoding,
                "delivery_mode": m.properties.delivery_mode,
                "priority": m.properties.priority,
                "correlation_id": m.properties.correlation_id,
                "reply_to": m.properties.reply_to,
                "expiration": m.properties.expiration,
                "message_id": m.properties.message_id,
                "timestamp": m.properties.timestamp,
                "type": m.properties.kind,
                "user_id": m.properties.user_id,
                "app_id": m.properties.app_id,
            });
            if p.body {
                match String::from_utf8(m.body.clone()) {
                    Ok(text) => out["body"] = json!(text),
                    Err(_) => out["body_hex"] = json!(hex(&m.body)),
                }
            }
        }
    }
    Json(out).into_response()
}

async fn cancel(State(state): State<AdminState>, Path(id): Path<String>) -> Response {
    let id = match parse_id(&id) {
        Ok(id) => id,
        Err(r) => return *r,
    };
    match state.engine.cancel(id) {
        Ok(true) => Json(json!({ "cancelled": id.to_string() })).into_response(),
        Ok(false) => error(
            StatusCode::NOT_FOUND,
            format!("no pending message with id {id}"),
        ),
        Err(EngineError::InFlight(_)) => error(
            StatusCode::CONFLICT,
            format!("message {id} is being published and can no longer be cancelled"),
        ),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

fn rfc3339(ms: u64) -> String {
    chrono::DateTime::from_timestamp_millis(ms as i64)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        .unwrap_or_default()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn table_json(t: &FieldTable) -> serde_json::Value {
    serde_json::Value::Object(
        t.iter()
            .map(|(k, v)| (k.to_owned(), value_json(v)))
            .collect(),
    )
}

fn value_json(v: &Value) -> serde_json::Value {
    match v {
        Value::Bool(b) => json!(b),
        Value::I8(x) => json!(x),
        Value::U8(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::F32(x) => json!(x),
        Value::F64(x) => json!(x),
        Value::Decimal { scale, value } => json!({ "scale": scale, "value": value }),
        Value::ShortString(s) => json!(s),
        Value::LongString(b) | Value::ByteArray(b) => match std::str::from_utf8(b) {
            Ok(s) => json!(s),
            Err(_) => json!({ "hex": hex(b) }),
        },
        Value::Array(items) => serde_json::Value::Array(items.iter().map(value_json).collect()),
        Value::Timestamp(t) => json!(t),
        Value::Table(t) => table_json(t),
        Value::Void => serde_json::Value::Null,
    }
}
