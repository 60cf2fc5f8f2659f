//! Admin HTTP: `/healthz`, `/readyz`, `/metrics`, and the `/v1/messages` API
//! (list, get, cancel by id or by key). Bound to loopback by default; `/v1`
//! can require a bearer token. Every error is JSON: `{"error": "..."}`.
//! Also the status page at `/` (`status_page`). What both use is in
//! `state`.

mod state;
mod status_page;

pub use state::AdminState;
use state::{resolve_id, store_roles, summary, ApiError, StoreRole, Summaries};

use std::collections::HashMap;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::api::{Cancelled, CancelledIds, MessageDetail, MessagePage, Purged};
use crate::engine::{Engine, EngineError, ListQuery};
use crate::id::MessageId;
use crate::status::RouteIntake;
use crate::wal::Record;

pub fn router(state: AdminState) -> Router {
    let api = Router::new()
        .route("/v1/messages", get(list).delete(cancel_by_key_or_purge))
        .route("/v1/messages/{id}", get(show).delete(cancel))
        .route("/v1/counts", get(counts))
        .layer(middleware::from_fn_with_state(state.clone(), require_token));
    Router::new()
        .merge(status_page::routes())
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .merge(api)
        .fallback(|| async { error(StatusCode::NOT_FOUND, "no such endpoint") })
        .method_not_allowed_fallback(|| async {
            error(StatusCode::METHOD_NOT_ALLOWED, "method not allowed here")
        })
        .with_state(state)
}

pub async fn serve(listener: tokio::net::TcpListener, state: AdminState, stop: CancellationToken) {
    let sampler = tokio::spawn(status_page::sample(state.clone(), stop.clone()));
    let app = router(state);
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(async move { stop.cancelled().await })
        .await
    {
        tracing::error!(error = %e, "admin server failed");
    }
    sampler.abort();
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    ApiError::new(status, message).into_response()
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

/// Live unless the WAL stopped after a fatal error (the process is on its
/// way out; an orchestrator should restart it).
async fn healthz(State(state): State<AdminState>) -> Response {
    match state.engine.wal().halt().reason() {
        None => "ok\n".into_response(),
        Some(reason) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the WAL stopped: {reason}"),
        ),
    }
}

async fn readyz(State(state): State<AdminState>) -> Response {
    let brokers = state.status.brokers();
    let all_up = brokers.iter().all(|b| b.ready);
    // A route is ready once its queue, exchange, binding and consumer exist:
    // before that a message published to it can be dropped unbound.
    let routes = state.status.routes();
    let all_consuming = routes
        .values()
        .all(|s| matches!(s, RouteIntake::Consuming | RouteIntake::Standby));
    let ready =
        state.status.accepting() && all_up && all_consuming && !state.engine.wal().is_stopped();
    // Backpressure does not make delayd unready: it is healthy and its
    // consumers wait on purpose; sending it no traffic would not help.
    let paused = state.status.paused();
    let (max_pending, max_disk) = state.engine.limits();
    let body = json!({
        "ready": ready,
        "wal": if state.engine.wal().is_stopped() { "stopped" } else { "recovered" },
        "store": state.status.store(),
        "brokers": brokers,
        "routes": routes,
        "pending": state.engine.pending(),
        "wal_bytes": state.engine.space().bytes,
        "backpressure": !paused.is_empty(),
        "paused_routes": paused,
        "limits": { "max_pending": max_pending, "max_disk": max_disk },
    });
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body)).into_response()
}

async fn metrics(State(state): State<AdminState>) -> Result<Response, ApiError> {
    let Some(mut text) = state.rendered_metrics() else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "metrics are not enabled",
        ));
    };
    let (now_ms, summaries) = state.due_summary().await?;
    scrape_time_metrics(&mut text, &state, now_ms, &summaries);
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

/// The metrics computed at each scrape (see `telemetry::METRICS`).
fn scrape_time_metrics(out: &mut String, state: &AdminState, now_ms: u64, summaries: &Summaries) {
    use crate::telemetry::write_family;
    let one = |labels: &[&str], value: f64| (labels.iter().map(|l| l.to_string()).collect(), value);
    let owners: Vec<_> = store_roles(state)
        .into_iter()
        .map(|(route, role)| one(&[&route], f64::from(u8::from(role == StoreRole::Owner))))
        .collect();
    write_family(out, "delayd_store_owner", &owners);
    let next_due: Vec<_> = summaries
        .iter()
        .filter_map(|(route, s)| Some(one(&[route], s.next_due_ms? as f64 / 1000.0)))
        .collect();
    write_family(out, "delayd_next_due_timestamp_seconds", &next_due);
    let overdue: Vec<_> = summaries
        .iter()
        .map(|(route, s)| {
            let age = s.oldest_overdue_ms.map_or(0, |d| now_ms.saturating_sub(d));
            one(&[route], age as f64 / 1000.0)
        })
        .collect();
    write_family(out, "delayd_oldest_overdue_seconds", &overdue);
    let mut connected = Vec::new();
    for b in state.status.brokers() {
        let consume = match b.consume {
            "connected" => Some(1.0),
            "disconnected" => Some(0.0),
            _ => None,
        };
        let publish = match b.publish {
            "connected" | "blocked" => Some(1.0),
            "idle" => Some(0.0),
            _ => None,
        };
        for (role, value) in [("consume", consume), ("publish", publish)] {
            if let Some(v) = value {
                connected.push(one(&[&b.name, role], v));
            }
        }
    }
    write_family(out, "delayd_broker_connected", &connected);
    write_family(
        out,
        "delayd_build_info",
        &[one(&[env!("CARGO_PKG_VERSION")], 1.0)],
    );
}

/// What this instance is for a route on the broker-kept store.
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
    message_id: Option<String>,
    key: Option<String>,
    key_hex: Option<String>,
}

/// A lookup key: `message_id` (AMQP), `key` (Kafka, UTF-8) or `key_hex`.
/// (Inlined in each query struct: `serde(flatten)` breaks numbers in query strings.)
struct KeyParams {
    message_id: Option<String>,
    key: Option<String>,
    key_hex: Option<String>,
}

impl KeyParams {
    fn bytes(&self) -> Result<Option<Vec<u8>>, ApiError> {
        let given = [&self.message_id, &self.key, &self.key_hex]
            .iter()
            .filter(|k| k.is_some())
            .count();
        if given > 1 {
            return Err(ApiError::bad_request(
                "give only one of message_id, key, key_hex",
            ));
        }
        if let Some(hex) = &self.key_hex {
            return unhex(hex)
                .map(Some)
                .ok_or_else(|| ApiError::bad_request("key_hex is not hexadecimal"));
        }
        Ok(self
            .message_id
            .as_ref()
            .or(self.key.as_ref())
            .map(|k| k.as_bytes().to_vec()))
    }
}

async fn list(
    State(state): State<AdminState>,
    query: Result<Query<ListParams>, QueryRejection>,
) -> Result<Json<MessagePage>, ApiError> {
    let Query(p) = query?;
    let key = KeyParams {
        message_id: p.message_id,
        key: p.key,
        key_hex: p.key_hex,
    };
    if let Some(key) = key.bytes()? {
        return list_by_key(&state, p.route, key).await;
    }
    let after = match p.cursor.as_deref().map(parse_cursor) {
        Some(Some(c)) => Some(c),
        Some(None) => return Err(ApiError::bad_request("malformed cursor")),
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
    let routes = state.routes.clone();
    let page = tokio::task::spawn_blocking(move || {
        let page = engine.list(&query);
        let items = page
            .iter()
            .map(|info| summary(&engine, routes.as_deref(), info))
            .collect();
        let next_cursor = (page.len() == limit)
            .then(|| page.last().map(|l| format!("{}.{}", l.due_ms, l.id)))
            .flatten();
        MessagePage { items, next_cursor }
    })
    .await?;
    Ok(Json(page))
}

/// `GET /v1/messages?route=R&message_id=X`: the pending messages with that key.
async fn list_by_key(
    state: &AdminState,
    route: Option<String>,
    key: Vec<u8>,
) -> Result<Json<MessagePage>, ApiError> {
    let Some(route) = route else {
        return Err(ApiError::bad_request(
            "a lookup by message_id or key needs route",
        ));
    };
    let ids = state.engine.lookup_key(&route, &key).await?;
    let engine = state.engine.clone();
    let routes = state.routes.clone();
    let page = tokio::task::spawn_blocking(move || {
        let mut items = Vec::new();
        for id in ids {
            if let Some((info, _)) = engine.read(id)? {
                items.push(summary(&engine, routes.as_deref(), &info));
            }
        }
        Ok::<_, EngineError>(MessagePage {
            items,
            next_cursor: None,
        })
    })
    .await??;
    Ok(Json(page))
}

fn parse_cursor(s: &str) -> Option<(u64, u64)> {
    let (due, id) = s.split_once('.')?;
    Some((due.parse().ok()?, id.parse().ok()?))
}

#[derive(Debug, Deserialize)]
struct ShowParams {
    #[serde(default)]
    body: bool,
}

async fn show(
    State(state): State<AdminState>,
    Path(id): Path<String>,
    query: Result<Query<ShowParams>, QueryRejection>,
) -> Result<Json<MessageDetail>, ApiError> {
    let Query(p) = query?;
    let id = resolve_id(&state.engine, &id).await?;
    let engine = state.engine.clone();
    let found = tokio::task::spawn_blocking(move || engine.read(id)).await??;
    let (info, record) = found.ok_or_else(|| ApiError::no_such_id(id))?;
    let mut detail = MessageDetail {
        summary: summary(&state.engine, state.routes.as_deref(), &info),
        headers: None,
        properties: None,
        body: None,
        body_hex: None,
    };
    if let Record::Schedule { message, .. } = record {
        if let Ok(m) = delayd_adapters::decode(&message) {
            detail.headers = Some(m.headers.to_json());
            detail.properties = Some(m.properties.into());
            if p.body {
                match String::from_utf8(m.body) {
                    Ok(text) => detail.body = Some(text),
                    Err(e) => detail.body_hex = Some(hex(e.as_bytes())),
                }
            }
        }
    }
    Ok(Json(detail))
}

async fn cancel(
    State(state): State<AdminState>,
    Path(id): Path<String>,
) -> Result<Json<Cancelled>, ApiError> {
    let local = resolve_id(&state.engine, &id).await?;
    if !state.engine.cancel(local).await? {
        return Err(ApiError::no_such_id(id));
    }
    if let Ok(uid) = id.parse() {
        state.engine.cancel_all_of(uid).await?;
    }
    Ok(Json(Cancelled {
        cancelled: CancelledIds::One(id),
    }))
}

#[derive(Debug, Deserialize)]
struct CancelByKeyParams {
    route: Option<String>,
    message_id: Option<String>,
    key: Option<String>,
    key_hex: Option<String>,
    due_from: Option<u64>,
    due_to: Option<u64>,
    #[serde(default)]
    dry_run: bool,
}

/// `DELETE /v1/messages?route=R&message_id=X` (or `key`, `key_hex`)
/// cancels by key; `DELETE /v1/messages?route=R[&due_from=&due_to=]`
/// without a key purges the route (see [`purge`]).
async fn cancel_by_key_or_purge(
    State(state): State<AdminState>,
    query: Result<Query<CancelByKeyParams>, QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(p) = query?;
    let keyed = p.message_id.is_some() || p.key.is_some() || p.key_hex.is_some();
    if keyed {
        if p.due_from.is_some() || p.due_to.is_some() || p.dry_run {
            return Err(ApiError::bad_request(
                "due_from, due_to and dry_run go with a purge (route alone), not with a key",
            ));
        }
        return Ok(cancel_by_key(state, p).await?.into_response());
    }
    let Some(route) = p.route else {
        return Err(ApiError::bad_request(
            "give route (to purge it, optionally with due_from/due_to), route with message_id, key or key_hex, or DELETE /v1/messages/{id}",
        ));
    };
    let configured = state
        .routes
        .as_ref()
        .is_some_and(|r| r.contains_key(&route));
    if !configured && state.engine.counts().iter().all(|(r, _)| **r != *route) {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no route {route:?}"),
        ));
    }
    let purged = purge(&state.engine, route, p.due_from, p.due_to, p.dry_run).await?;
    Ok(Json(purged).into_response())
}

/// Cancel every pending message of `route` due within the window (see
/// [`Engine::purge`]), logged when anything went.
async fn purge(
    engine: &Engine,
    route: String,
    due_from: Option<u64>,
    due_to: Option<u64>,
    dry_run: bool,
) -> Result<Purged, ApiError> {
    let count = engine.purge(&route, due_from, due_to, dry_run).await?;
    if count.purged > 0 {
        tracing::warn!(route = %route, purged = count.purged, due_from, due_to, "purged pending messages through the admin API");
    }
    Ok(Purged {
        route,
        due_from,
        due_to,
        dry_run,
        matched: count.matched,
        purged: count.purged,
        in_flight: count.in_flight,
    })
}

/// `DELETE /v1/messages?route=R&message_id=X` (or `key=K`, `key_hex=HEX`):
/// cancel every pending message on R with that key. 404 when none matches.
async fn cancel_by_key(
    state: AdminState,
    p: CancelByKeyParams,
) -> Result<Json<Cancelled>, ApiError> {
    let key = KeyParams {
        message_id: p.message_id,
        key: p.key,
        key_hex: p.key_hex,
    };
    let Some(key) = key.bytes()? else {
        return Err(ApiError::bad_request(
            "give message_id, key or key_hex (and route), or DELETE /v1/messages/{id}",
        ));
    };
    let Some(route) = p.route else {
        return Err(ApiError::bad_request(
            "a cancel by message_id or key needs route",
        ));
    };
    // Their identities, read before their records can go.
    let ids = state.engine.lookup_key(&route, &key).await?;
    let engine = state.engine.clone();
    let uids = tokio::task::spawn_blocking(move || -> Result<_, EngineError> {
        let mut uids = HashMap::new();
        for id in ids {
            if let Some((_, Record::Schedule { uid, .. })) = engine.read(id)? {
                uids.insert(id, MessageId::or_legacy(uid, id));
            }
        }
        Ok(uids)
    })
    .await??;
    let ids = state.engine.cancel_by_key(&route, &key).await?;
    if ids.is_empty() {
        let shown = String::from_utf8_lossy(&key);
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no pending message with key {shown:?} on route {route:?}"),
        ));
    }
    Ok(Json(Cancelled {
        cancelled: CancelledIds::Many(
            ids.iter()
                .map(|id| uids.get(id).copied().unwrap_or(MessageId::legacy(*id)))
                .map(|uid| uid.to_string())
                .collect(),
        ),
    }))
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
