//! `delayd messages list|get|cancel|purge`: the admin API from the command line.
//!
//! The address comes from `--http`, else `http.listen` of `--config` (or the
//! built-in default 127.0.0.1:9464); the token from `--token` /
//! `DELAYD_HTTP__TOKEN`, else `http.token` / `http.token_file` of the config.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use serde_json::Value;

use crate::api::{ApiErrorBody, Cancelled, CancelledIds, MessagePage, Purged};
use crate::client::{encode_query_value, Client};
use crate::config::Config;

#[derive(Debug, Args)]
pub struct MessagesArgs {
    /// Admin API address (host:port). Default: http.listen of the config.
    #[arg(long, global = true)]
    pub http: Option<String>,
    /// Bearer token for the admin API.
    #[arg(
        long,
        global = true,
        env = "DELAYD_HTTP__TOKEN",
        hide_env_values = true
    )]
    pub token: Option<String>,
    /// Config file to take http.listen and the token from.
    #[arg(short, long, global = true, env = "DELAYD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Print the API's JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: MessagesCommand,
}

#[derive(Debug, Subcommand)]
pub enum MessagesCommand {
    /// List pending messages by due time, one page at a time.
    List {
        #[arg(long)]
        route: Option<String>,
        /// Only messages due at or after this (epoch ms).
        #[arg(long)]
        due_from: Option<u64>,
        /// Only messages due at or before this (epoch ms).
        #[arg(long)]
        due_to: Option<u64>,
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// `next_cursor` of the previous page.
        #[arg(long)]
        cursor: Option<String>,
        /// Only the messages with this AMQP message_id (needs --route).
        #[arg(long)]
        message_id: Option<String>,
        /// Only the messages with this Kafka key (needs --route).
        #[arg(long)]
        key: Option<String>,
    },
    /// Show one pending message: metadata, properties and headers.
    Get {
        id: String,
        /// Include the body.
        #[arg(long)]
        body: bool,
    },
    /// Cancel a pending message by id, or by message_id / key on a route.
    Cancel {
        /// The delayd id (as listed, or the x-delayd-id it would carry).
        #[arg(required_unless_present_any = ["message_id", "key"])]
        id: Option<String>,
        /// Cancel the messages with this AMQP message_id on --route.
        #[arg(long, requires = "route", conflicts_with = "id")]
        message_id: Option<String>,
        /// Cancel the messages with this Kafka key on --route.
        #[arg(long, requires = "route", conflicts_with_all = ["id", "message_id"])]
        key: Option<String>,
        /// The route of --message-id / --key.
        #[arg(long)]
        route: Option<String>,
    },
    /// Cancel every pending message of a route (optionally only those due
    /// within a window). Says first how many it would remove; removes them
    /// only with --yes.
    Purge {
        #[arg(long)]
        route: String,
        /// Only messages due at or after this (epoch ms).
        #[arg(long)]
        due_from: Option<u64>,
        /// Only messages due at or before this (epoch ms).
        #[arg(long)]
        due_to: Option<u64>,
        /// Remove them (without it, only count).
        #[arg(long)]
        yes: bool,
    },
}

pub fn run(args: MessagesArgs) -> anyhow::Result<()> {
    let client = client(&args)?;
    if let MessagesCommand::Purge {
        route,
        due_from,
        due_to,
        yes,
    } = &args.command
    {
        return purge(&client, &args, route, *due_from, *due_to, *yes);
    }
    let (method, path) = request(&args.command);
    let body = call(&client, method, &path)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&body)?);
        return Ok(());
    }
    let unexpected = || format!("unexpected answer to {method} {path}");
    match &args.command {
        MessagesCommand::List { .. } => {
            print_list(&serde_json::from_value(body).with_context(unexpected)?)
        }
        MessagesCommand::Get { .. } => println!("{}", serde_json::to_string_pretty(&body)?),
        MessagesCommand::Purge { .. } => {}
        MessagesCommand::Cancel { .. } => {
            let done: Cancelled = serde_json::from_value(body).with_context(unexpected)?;
            let ids = match done.cancelled {
                CancelledIds::One(id) => vec![id],
                CancelledIds::Many(ids) => ids,
            };
            println!("cancelled {}", ids.join(" "));
        }
    }
    Ok(())
}

/// One request, its JSON answer, or the API's error.
fn call(client: &Client, method: &str, path: &str) -> anyhow::Result<Value> {
    let response = client.request(method, path)?;
    let body: Value = serde_json::from_slice(&response.body).with_context(|| {
        format!(
            "admin API answered {} with non-JSON: {}",
            response.status,
            String::from_utf8_lossy(&response.body)
        )
    })?;
    if !(200..300).contains(&response.status) {
        let message = serde_json::from_value::<ApiErrorBody>(body)
            .map_or_else(|_| "no message".to_owned(), |b| b.error);
        anyhow::bail!("{} {method} {path}: {message}", response.status);
    }
    Ok(body)
}

/// `purge`: count first (a dry run), then remove only with `--yes`.
fn purge(
    client: &Client,
    args: &MessagesArgs,
    route: &str,
    due_from: Option<u64>,
    due_to: Option<u64>,
    yes: bool,
) -> anyhow::Result<()> {
    let dry = MessagesCommand::Purge {
        route: route.to_owned(),
        due_from,
        due_to,
        yes: false,
    };
    let (method, path) = request(&dry);
    let counted: Purged = serde_json::from_value(call(client, method, &path)?)
        .with_context(|| format!("unexpected answer to {method} {path}"))?;
    let window = match (due_from, due_to) {
        (None, None) => String::new(),
        (from, to) => format!(
            " due {}to {}",
            from.map(|f| format!("from {f} ")).unwrap_or_default(),
            to.map_or("any time".to_owned(), |t| t.to_string())
        ),
    };
    if args.json && !yes {
        println!("{}", serde_json::to_string_pretty(&counted)?);
    } else {
        println!(
            "route {route}: {} pending message(s){window} would be removed",
            counted.matched
        );
    }
    if !yes {
        anyhow::bail!("nothing removed: run again with --yes to remove them");
    }
    let (method, path) = request(&args.command);
    let done: Purged = serde_json::from_value(call(client, method, &path)?)
        .with_context(|| format!("unexpected answer to {method} {path}"))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&done)?);
    } else {
        print!("route {route}: removed {}", done.purged);
        if done.in_flight > 0 {
            print!(
                " ({} being published were left: they are leaving)",
                done.in_flight
            );
        }
        println!();
    }
    Ok(())
}

fn client(args: &MessagesArgs) -> anyhow::Result<Client> {
    let config = match (&args.http, &args.token, &args.config) {
        // Everything given on the command line: no config needed.
        (Some(_), Some(_), None) => None,
        _ => Some(Config::load(args.config.as_deref())?),
    };
    let addr = match (&args.http, &config) {
        (Some(a), _) => a.clone(),
        (None, Some(c)) if !c.http.listen.is_empty() => c.http.listen.clone(),
        _ => anyhow::bail!("no admin API address: give --http or set http.listen"),
    };
    let token = match (&args.token, &config) {
        (Some(t), _) => Some(t.clone()),
        (None, Some(c)) => c.http.bearer_token()?,
        (None, None) => None,
    };
    Ok(Client::new(addr, token))
}

fn request(command: &MessagesCommand) -> (&'static str, String) {
    let mut query = Vec::new();
    let mut add = |name: &str, value: Option<String>| {
        if let Some(v) = value {
            query.push(format!("{name}={}", encode_query_value(&v)));
        }
    };
    let (method, path) = match command {
        MessagesCommand::List {
            route,
            due_from,
            due_to,
            limit,
            cursor,
            message_id,
            key,
        } => {
            add("route", route.clone());
            add("due_from", due_from.map(|v| v.to_string()));
            add("due_to", due_to.map(|v| v.to_string()));
            add("limit", Some(limit.to_string()));
            add("cursor", cursor.clone());
            add("message_id", message_id.clone());
            add("key", key.clone());
            ("GET", "/v1/messages".to_owned())
        }
        MessagesCommand::Get { id, body } => {
            add("body", body.then(|| "true".to_owned()));
            ("GET", format!("/v1/messages/{}", encode_query_value(id)))
        }
        MessagesCommand::Cancel { id: Some(id), .. } => {
            ("DELETE", format!("/v1/messages/{}", encode_query_value(id)))
        }
        MessagesCommand::Cancel {
            id: None,
            message_id,
            key,
            route,
        } => {
            add("route", route.clone());
            add("message_id", message_id.clone());
            add("key", key.clone());
            ("DELETE", "/v1/messages".to_owned())
        }
        MessagesCommand::Purge {
            route,
            due_from,
            due_to,
            yes,
        } => {
            add("route", Some(route.clone()));
            add("due_from", due_from.map(|v| v.to_string()));
            add("due_to", due_to.map(|v| v.to_string()));
            add("dry_run", (!yes).then(|| "true".to_owned()));
            ("DELETE", "/v1/messages".to_owned())
        }
    };
    if query.is_empty() {
        (method, path)
    } else {
        (method, format!("{path}?{}", query.join("&")))
    }
}

fn print_list(page: &MessagePage) {
    println!(
        "{:<20} {:<16} {:<24} {:<10} {:>8} {:<24} target",
        "id", "route", "due", "phase", "size", "message_id/key"
    );
    let dash = || "-".to_owned();
    for item in &page.items {
        let lookup = item.key.clone().or_else(|| item.message_id.clone());
        let target = item.target.as_ref().map_or_else(dash, |t| {
            format!("{}:{}/{}", t.broker, t.destination, t.routing_key)
        });
        let phase = serde_json::to_value(item.phase)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_else(dash);
        println!(
            "{:<20} {:<16} {:<24} {:<10} {:>8} {:<24} {}",
            item.id,
            item.route,
            item.due,
            phase,
            item.size.map_or_else(dash, |s| s.to_string()),
            lookup.unwrap_or_else(dash),
            target
        );
    }
    println!("{} message(s)", page.items.len());
    if let Some(next) = &page.next_cursor {
        println!("next page: --cursor {next}");
    }
}
