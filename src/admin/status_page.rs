//! The status page at `/` on the admin listener: server-rendered HTML, no
//! script. Per route: pending messages, when they fall due (overdue, within
//! a minute, an hour, a day, later) as a small histogram, the fire rate and
//! lateness over the last minute, and the store role; the brokers'
//! connections; and the pending messages, a page at a time.
//!
//! Access follows the admin API's token. Without `http.token` the page is
//! open (the listener is loopback-only then) and read-only. With a token
//! the page asks for it (a form that sets an HttpOnly, SameSite=Strict
//! cookie holding a hash of the token, never the token itself; an
//! `Authorization: Bearer` header works too), and only then shows a cancel
//! button beside each message. A cancel is a form POST carrying a value
//! derived from the token (so another site cannot forge one) and does what
//! `DELETE /v1/messages/{id}` does.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::time::Instant;

use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use super::state::{
    resolve_id, rfc3339, store_roles, summary, AdminState, RouteSample, StoreRole, SAMPLE_EVERY,
};
use crate::engine::{DueSummary, EngineError, ListQuery};

pub fn routes() -> Router<AdminState> {
    Router::new()
        .route("/", get(page))
        .route("/ui/login", post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/cancel", post(cancel))
}

/// Messages per page of the pending list.
const PAGE: usize = 50;
/// How often fire counts and lateness are sampled, and how far back a rate looks.
const COOKIE: &str = "delayd_ui";

// ------------------------------------------------------------------ access

/// What a request may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// No token is configured: view only.
    Open,
    /// The token was given: view and cancel.
    Token,
    /// A token is configured and was not given.
    Denied,
}

fn derived(purpose: &str, token: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"delayd ");
    h.update(purpose.as_bytes());
    h.update([0]);
    h.update(token.as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

fn access(state: &AdminState, headers: &HeaderMap) -> Access {
    let Some(token) = state.token.as_deref() else {
        return Access::Open;
    };
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    if bearer.is_some_and(|b| same(b, token)) {
        return Access::Token;
    }
    let want = derived("ui-cookie", token);
    let cookie = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .any(|(name, value)| name == COOKIE && same(value, &want));
    if cookie {
        Access::Token
    } else {
        Access::Denied
    }
}

#[derive(Debug, Deserialize)]
struct LoginForm {
    token: String,
}

async fn login(State(state): State<AdminState>, Form(form): Form<LoginForm>) -> Response {
    match state.token.as_deref() {
        Some(token) if same(form.token.trim(), token) => {
            let cookie = format!(
                "{COOKIE}={}; HttpOnly; SameSite=Strict; Path=/",
                derived("ui-cookie", token)
            );
            ([(header::SET_COOKIE, cookie)], Redirect::to("/")).into_response()
        }
        Some(_) => login_page(StatusCode::UNAUTHORIZED, Some("That is not the token.")),
        None => Redirect::to("/").into_response(),
    }
}

async fn logout() -> Response {
    let cookie = format!("{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0");
    ([(header::SET_COOKIE, cookie)], Redirect::to("/")).into_response()
}

fn login_page(status: StatusCode, notice: Option<&str>) -> Response {
    let mut body = String::new();
    head(&mut body, "delayd: token required");
    body.push_str("<h1>delayd</h1>\n");
    if let Some(n) = notice {
        let _ = writeln!(body, "<p class=\"notice\">{}</p>", esc(n));
    }
    body.push_str(
        "<p>This delayd requires its admin token (<code>http.token</code>) for the status page.</p>\n\
         <form method=\"post\" action=\"/ui/login\" id=\"login\">\n\
         <label>Token <input type=\"password\" name=\"token\" autocomplete=\"current-password\" autofocus></label>\n\
         <button type=\"submit\">Show the status</button>\n</form>\n</body></html>\n",
    );
    (status, Html(body)).into_response()
}

// ------------------------------------------------------------------ cancel

#[derive(Debug, Deserialize)]
struct CancelForm {
    id: String,
    csrf: String,
    #[serde(default)]
    route: String,
}

async fn cancel(
    State(state): State<AdminState>,
    headers: HeaderMap,
    Form(form): Form<CancelForm>,
) -> Response {
    let token = match (access(&state, &headers), state.token.as_deref()) {
        (Access::Token, Some(token)) => token,
        _ => {
            return (
                StatusCode::FORBIDDEN,
                "cancelling from the status page needs the admin token\n",
            )
                .into_response()
        }
    };
    if !same(&form.csrf, &derived("ui-csrf", token)) {
        return (StatusCode::FORBIDDEN, "stale or forged form\n").into_response();
    }
    let outcome = match resolve_id(&state.engine, &form.id).await {
        Ok(local) => match state.engine.cancel(local).await {
            Ok(true) => match form.id.parse() {
                Ok(uid) => match state.engine.cancel_all_of(uid).await {
                    Ok(_) => format!("cancelled {}", form.id),
                    Err(e) => format!("cancelled {}, but not every copy: {e}", form.id),
                },
                Err(_) => format!("cancelled {}", form.id),
            },
            Ok(false) => format!("{} is no longer pending", form.id),
            Err(EngineError::InFlight(_)) => {
                format!(
                    "{} is being published and can no longer be cancelled",
                    form.id
                )
            }
            Err(e) => format!("cannot cancel {}: {e}", form.id),
        },
        Err(_) => format!("{} is no longer pending", form.id),
    };
    let mut to = format!("/?notice={}", crate::client::encode_query_value(&outcome));
    if !form.route.is_empty() {
        let _ = write!(
            to,
            "&route={}",
            crate::client::encode_query_value(&form.route)
        );
    }
    Redirect::to(&to).into_response()
}

// ------------------------------------------------------------------ samples

/// The sampler behind the page's rates; runs while the admin API does.
pub async fn sample(state: AdminState, stop: CancellationToken) {
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if let Some(text) = state.rendered_metrics() {
            state.samples.push(Instant::now(), parse_samples(&text));
        }
    }
}

/// `delayd_fired_total` and `delayd_lateness_seconds_bucket` per route.
fn parse_samples(text: &str) -> BTreeMap<String, RouteSample> {
    let mut out: BTreeMap<String, RouteSample> = BTreeMap::new();
    for line in text.lines() {
        let fired = line.starts_with("delayd_fired_total{");
        let bucket = line.starts_with("delayd_lateness_seconds_bucket{");
        if !fired && !bucket {
            continue;
        }
        let Some((labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let (Some(route), Ok(value)) = (label(labels, "route"), value.parse::<f64>()) else {
            continue;
        };
        let entry = out.entry(route).or_default();
        if fired {
            entry.fired = value;
        } else if let Some(le) = label(labels, "le") {
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::INFINITY)
            };
            entry.buckets.push((le, value));
        }
    }
    for s in out.values_mut() {
        s.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    out
}

/// The value of label `name` in `metric{a="x",b="y"}`.
fn label(series: &str, name: &str) -> Option<String> {
    let start = series.find(&format!("{name}=\""))? + name.len() + 2;
    let mut value = String::new();
    let mut chars = series[start..].chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                'n' => value.push('\n'),
                other => value.push(other),
            },
            '"' => return Some(value),
            c => value.push(c),
        }
    }
    None
}

/// Fire rate (per second) and lateness quantiles over the window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Activity {
    rate: Option<f64>,
    p50: Option<f64>,
    p99: Option<f64>,
}

fn activity(now: &RouteSample, then: Option<&RouteSample>, seconds: f64) -> Activity {
    let Some(then) = then else {
        return Activity::default();
    };
    let fired = (now.fired - then.fired).max(0.0);
    let deltas: Vec<(f64, f64)> = now
        .buckets
        .iter()
        .map(|&(le, n)| {
            let before = then.buckets.iter().find(|b| b.0 == le).map_or(0.0, |b| b.1);
            (le, (n - before).max(0.0))
        })
        .collect();
    let total = deltas.last().map_or(0.0, |b| b.1);
    let quantile = |q: f64| {
        (total > 0.0)
            .then(|| deltas.iter().find(|b| b.1 >= q * total).map(|b| b.0))
            .flatten()
    };
    Activity {
        rate: (seconds > 0.0).then_some(fired / seconds),
        p50: quantile(0.5),
        p99: quantile(0.99),
    }
}

// -------------------------------------------------------------------- page

#[derive(Debug, Deserialize)]
struct PageParams {
    route: Option<String>,
    cursor: Option<String>,
    notice: Option<String>,
}

async fn page(
    State(state): State<AdminState>,
    headers: HeaderMap,
    Query(params): Query<PageParams>,
) -> Response {
    let access = access(&state, &headers);
    if access == Access::Denied {
        return login_page(StatusCode::UNAUTHORIZED, None);
    }
    match render(&state, access, params).await {
        Ok(html) => Html(html).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e).into_response(),
    }
}

async fn render(state: &AdminState, access: Access, p: PageParams) -> Result<String, String> {
    let (now_ms, summaries) = state
        .due_summary()
        .await
        .map_err(|_| "cannot summarise the pending messages".to_owned())?;
    let counts = state.engine.counts();
    let total = state.engine.pending();
    let current = state
        .rendered_metrics()
        .map(|t| parse_samples(&t))
        .unwrap_or_default();
    let now = Instant::now();
    let baseline = state.samples.baseline(now);
    let seconds = baseline
        .as_ref()
        .map_or(0.0, |(t, _)| now.duration_since(*t).as_secs_f64());
    let roles: BTreeMap<String, StoreRole> = store_roles(state).into_iter().collect();
    let store = state.status.store();
    let intake = state.status.routes();

    // The pending list.
    let after = p.cursor.as_deref().and_then(|c| {
        let (due, id) = c.split_once('.')?;
        Some((due.parse().ok()?, id.parse().ok()?))
    });
    let route_filter = p.route.clone().filter(|r| !r.is_empty());
    let query = ListQuery {
        route: route_filter.clone(),
        due_from: None,
        due_to: None,
        after,
        limit: PAGE,
    };
    let engine = state.engine.clone();
    let routes = state.routes.clone();
    let rows = tokio::task::spawn_blocking(move || {
        let page = engine.list(&query);
        let next = (page.len() == PAGE)
            .then(|| page.last().map(|l| format!("{}.{}", l.due_ms, l.id)))
            .flatten();
        let rows: Vec<_> = page
            .iter()
            .map(|info| summary(&engine, routes.as_deref(), info))
            .collect();
        (rows, next)
    })
    .await
    .map_err(|e| e.to_string())?;
    let (rows, next_cursor) = rows;

    let mut h = String::with_capacity(32 << 10);
    head(&mut h, "delayd status");
    let _ = writeln!(
        h,
        "<header><h1>delayd</h1><span class=\"meta\">{} · store <b>{}</b> · WAL {} · {}</span>",
        esc(env!("CARGO_PKG_VERSION")),
        esc(store
            .get("kind")
            .and_then(|k| k.as_str())
            .unwrap_or("local")),
        bytes(state.engine.space().bytes),
        esc(&rfc3339(now_ms)),
    );
    match access {
        Access::Token => h.push_str(
            "<form method=\"post\" action=\"/ui/logout\" class=\"inline\"><button>Forget the token</button></form>",
        ),
        _ => h.push_str("<span class=\"meta\">read-only</span>"),
    }
    h.push_str("</header>\n");
    if let Some(n) = &p.notice {
        let _ = writeln!(h, "<p class=\"notice\" id=\"notice\">{}</p>", esc(n));
    }

    // Routes.
    let _ = writeln!(
        h,
        "<h2>Routes</h2>\n<p>Pending in all: <b id=\"total-pending\">{total}</b></p>"
    );
    h.push_str(
        "<table id=\"routes\"><thead><tr><th>route</th><th>pending</th><th>overdue</th>\
         <th>≤ 1 min</th><th>≤ 1 h</th><th>≤ 1 day</th><th>later</th><th>due in</th>\
         <th>fired / s</th><th>lateness p50 / p99</th><th>intake</th><th>store</th></tr></thead><tbody>\n",
    );
    for (route, pending) in &counts {
        let s = summaries.get(route).cloned().unwrap_or_default();
        let act = current.get(&**route).map_or_else(Activity::default, |now| {
            activity(
                now,
                baseline.as_ref().and_then(|(_, b)| b.get(&**route)),
                seconds,
            )
        });
        let intake = intake.get(&**route).map_or("-".to_owned(), |i| {
            serde_json::to_value(i)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default()
        });
        let role = roles.get(&**route).map_or("local", |r| r.as_str());
        let r = esc(route);
        let _ = writeln!(
            h,
            "<tr data-route=\"{r}\"><td><a href=\"/?route={q}\">{r}</a></td><td class=\"pending num\">{pending}</td>\
             <td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>\
             <td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td></tr>",
            s.overdue,
            s.within_minute,
            s.within_hour,
            s.within_day,
            later(&s),
            histogram(&s),
            act.rate.map_or("–".to_owned(), |r| format!("{r:.1}")),
            match (act.p50, act.p99) {
                (Some(a), Some(b)) => format!("≤ {} / ≤ {}", secs(a), secs(b)),
                _ => "–".to_owned(),
            },
            esc(&intake),
            role,
            q = esc(&crate::client::encode_query_value(route)),
        );
    }
    h.push_str("</tbody></table>\n");

    // Brokers.
    h.push_str(
        "<h2>Brokers</h2>\n<table id=\"brokers\"><thead><tr><th>broker</th><th>consume</th>\
         <th>publish</th><th>ready</th></tr></thead><tbody>\n",
    );
    for b in state.status.brokers() {
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td class=\"{c}\">{c}</td><td class=\"{p}\">{p}</td><td>{}</td></tr>",
            esc(&b.name),
            if b.ready { "yes" } else { "no" },
            c = esc(b.consume),
            p = esc(b.publish),
        );
    }
    h.push_str("</tbody></table>\n");

    // Pending messages.
    let _ = writeln!(
        h,
        "<h2>Pending messages{}</h2>",
        route_filter
            .as_deref()
            .map(|r| format!(" of {}", esc(r)))
            .unwrap_or_default()
    );
    h.push_str("<p class=\"filters\">Route: <a href=\"/\">all</a>");
    for (route, _) in &counts {
        let _ = write!(
            h,
            " · <a href=\"/?route={}\">{}</a>",
            esc(&crate::client::encode_query_value(route)),
            esc(route)
        );
    }
    h.push_str("</p>\n");
    let csrf = state
        .token
        .as_deref()
        .filter(|_| access == Access::Token)
        .map(|t| derived("ui-csrf", t));
    h.push_str(
        "<table id=\"pending\"><thead><tr><th>id</th><th>route</th><th>due</th><th>in</th>\
         <th>target</th><th>size</th><th>phase</th>",
    );
    if csrf.is_some() {
        h.push_str("<th></th>");
    }
    h.push_str("</tr></thead><tbody>\n");
    for row in &rows {
        let target = row.target.as_ref().map_or("–".to_owned(), |t| {
            format!("{}: {} / {}", t.broker, t.destination, t.routing_key)
        });
        let phase = serde_json::to_value(row.phase)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let _ = write!(
            h,
            "<tr data-id=\"{id}\"><td class=\"id\"><code>{id}</code></td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td>",
            esc(&row.route),
            esc(&row.due),
            esc(&until(row.due_ms, now_ms)),
            esc(&target),
            row.size.map_or("–".to_owned(), bytes_usize),
            esc(&phase),
            id = esc(&row.id),
        );
        if let Some(csrf) = &csrf {
            let _ = write!(
                h,
                "<td><form method=\"post\" action=\"/ui/cancel\" class=\"inline\">\
                 <input type=\"hidden\" name=\"id\" value=\"{}\"><input type=\"hidden\" name=\"csrf\" value=\"{csrf}\">\
                 <input type=\"hidden\" name=\"route\" value=\"{}\"><button class=\"cancel\">cancel</button></form></td>",
                esc(&row.id),
                esc(route_filter.as_deref().unwrap_or("")),
            );
        }
        h.push_str("</tr>\n");
    }
    h.push_str("</tbody></table>\n");
    if rows.is_empty() {
        h.push_str("<p>Nothing pending here.</p>\n");
    }
    h.push_str("<p class=\"pages\"><a href=\"/");
    if let Some(r) = &route_filter {
        let _ = write!(h, "?route={}", esc(&crate::client::encode_query_value(r)));
    }
    h.push_str("\">first page</a>");
    if let Some(next) = next_cursor {
        let mut link = format!("/?cursor={}", crate::client::encode_query_value(&next));
        if let Some(r) = &route_filter {
            let _ = write!(link, "&route={}", crate::client::encode_query_value(r));
        }
        let _ = write!(h, " · <a id=\"next\" href=\"{}\">next page</a>", esc(&link));
    }
    h.push_str("</p>\n");
    if access == Access::Open {
        h.push_str(
            "<p class=\"meta\">Read-only: with <code>http.token</code> set, the page asks for it and can cancel messages.</p>\n",
        );
    }
    h.push_str("</body></html>\n");
    Ok(h)
}

fn later(s: &DueSummary) -> u64 {
    s.pending.saturating_sub(s.overdue + s.within_day)
}

/// Five bars (overdue, ≤ 1 min, 1 min–1 h, 1 h–1 day, later), heights
/// relative to the largest.
fn histogram(s: &DueSummary) -> String {
    let bars = [
        ("overdue", s.overdue),
        ("due within a minute", s.within_minute),
        ("due in 1 min to 1 h", s.within_hour - s.within_minute),
        ("due in 1 h to 1 day", s.within_day - s.within_hour),
        ("due later", later(s)),
    ];
    let max = bars.iter().map(|b| b.1).max().unwrap_or(0).max(1);
    let mut out = String::from("<span class=\"hist\">");
    for (what, n) in bars {
        let height = if n == 0 { 0 } else { 2 + n * 22 / max };
        let _ = write!(
            out,
            "<i style=\"height:{height}px\" title=\"{n} {what}\"></i>"
        );
    }
    out.push_str("</span>");
    out
}

fn until(due_ms: u64, now_ms: u64) -> String {
    if due_ms <= now_ms {
        return format!("{} ago", human(now_ms - due_ms));
    }
    human(due_ms - now_ms)
}

fn human(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0 => format!("{ms} ms"),
        1..=119 => format!("{s} s"),
        120..=7199 => format!("{} min", s / 60),
        7200..=172_799 => format!("{} h", s / 3600),
        _ => format!("{} d", s / 86_400),
    }
}

fn secs(s: f64) -> String {
    if s.is_infinite() {
        "> 300 s".to_owned()
    } else if s < 1.0 {
        format!("{} ms", (s * 1000.0).round())
    } else {
        format!("{s} s")
    }
}

fn bytes(n: u64) -> String {
    match n {
        0..1024 => format!("{n} B"),
        1024..1_048_576 => format!("{:.1} KiB", n as f64 / 1024.0),
        1_048_576..1_073_741_824 => format!("{:.1} MiB", n as f64 / 1_048_576.0),
        _ => format!("{:.1} GiB", n as f64 / 1_073_741_824.0),
    }
}

fn bytes_usize(n: usize) -> String {
    bytes(n as u64)
}

/// Text for HTML content and attribute values.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn head(out: &mut String, title: &str) {
    let _ = write!(
        out,
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{}</title><style>{STYLE}</style></head><body>\n",
        esc(title)
    );
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}\
h1{font-size:1.4em;display:inline;margin-right:1em}h2{font-size:1.1em;margin-top:1.6em}\
header{display:flex;gap:1em;align-items:baseline;flex-wrap:wrap}.meta{color:#666}\
table{border-collapse:collapse}th,td{padding:3px 8px;border-bottom:1px solid #ddd;text-align:left;vertical-align:bottom}\
th{font-weight:600;background:#f5f5f5}.num{text-align:right;font-variant-numeric:tabular-nums}\
.hist{display:inline-flex;align-items:flex-end;gap:2px;height:24px}\
.hist i{display:inline-block;width:9px;background:#4a7bd0}\
.hist i:first-child{background:#d0604a}.notice{background:#fff4d0;padding:4px 8px}\
.disconnected,.blocked{color:#b00;font-weight:600}.connected{color:#070}\
form.inline{display:inline}button.cancel{color:#b00}code{font-size:12px}";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_read_from_prometheus_text() {
        let text = "# TYPE delayd_fired_total counter\n\
            delayd_fired_total{route=\"a\\\"b\"} 10\n\
            delayd_fired_total{route=\"c\"} 3\n\
            delayd_lateness_seconds_bucket{route=\"c\",le=\"0.01\"} 2\n\
            delayd_lateness_seconds_bucket{route=\"c\",le=\"+Inf\"} 3\n\
            delayd_lateness_seconds_bucket{route=\"c\",le=\"0.001\"} 1\n\
            delayd_lateness_seconds_sum{route=\"c\"} 0.5\n";
        let s = parse_samples(text);
        assert_eq!(s["a\"b"].fired, 10.0);
        assert_eq!(
            s["c"],
            RouteSample {
                fired: 3.0,
                buckets: vec![(0.001, 1.0), (0.01, 2.0), (f64::INFINITY, 3.0)],
            }
        );
    }

    #[test]
    fn activity_is_the_difference_over_the_window() {
        let then = RouteSample {
            fired: 10.0,
            buckets: vec![(0.001, 5.0), (0.01, 10.0), (f64::INFINITY, 10.0)],
        };
        let now = RouteSample {
            fired: 110.0,
            buckets: vec![(0.001, 5.0), (0.01, 105.0), (f64::INFINITY, 110.0)],
        };
        let a = activity(&now, Some(&then), 10.0);
        assert_eq!(a.rate, Some(10.0));
        assert_eq!(a.p50, Some(0.01));
        assert_eq!(a.p99, Some(f64::INFINITY));
        assert_eq!(activity(&now, None, 0.0), Activity::default());
    }

    #[test]
    fn html_is_escaped_and_the_histogram_has_five_bars() {
        assert_eq!(
            esc("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
        let s = DueSummary {
            pending: 10,
            overdue: 1,
            within_minute: 2,
            within_hour: 5,
            within_day: 6,
            ..DueSummary::default()
        };
        let h = histogram(&s);
        assert_eq!(h.matches("<i ").count(), 5);
        assert!(h.contains("title=\"1 overdue\""), "{h}");
        assert!(h.contains("title=\"3 due in 1 min to 1 h\""), "{h}");
        assert!(h.contains("title=\"1 due in 1 h to 1 day\""), "{h}");
        assert!(h.contains("title=\"3 due later\""), "{h}");
    }

    #[test]
    fn the_cookie_and_the_form_value_are_derived_not_the_token() {
        let c = derived("ui-cookie", "s3cret");
        assert_eq!(c.len(), 64);
        assert!(!c.contains("s3cret"));
        assert_ne!(c, derived("ui-csrf", "s3cret"));
        assert_ne!(c, derived("ui-cookie", "other"));
    }
}
