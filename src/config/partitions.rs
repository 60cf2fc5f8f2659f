//! `partitions = N` on a RabbitMQ route: the route becomes N routes, one
//! per partition, behind one consistent-hash exchange.
//!
//! Route `orders` with `from = { queue = "delayd.orders", exchange =
//! "orders" }` and `partitions = 3` becomes routes `orders.0`, `orders.1`,
//! `orders.2`, consuming `delayd.orders.0` .. `delayd.orders.2`, each bound
//! with weight 1 to exchange `orders`, which delayd declares with type
//! `x-consistent-hash` (RabbitMQ's `rabbitmq_consistent_hash_exchange`
//! plugin, shipped with RabbitMQ and enabled with `rabbitmq-plugins
//! enable`). Producers publish to `orders` as before; a routing key always
//! hashes to the same partition, so per-key order holds. Everything else
//! about a partition (mode, target, its owner and state streams with the
//! broker store) is a route's.

use super::{ExchangeKind, RouteConfig};

/// Which partition of which route a route is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// The route as configured (`orders`).
    pub group: String,
    pub index: u16,
    pub count: u16,
    /// Its position under `[[routes]]`, for error messages
    /// (`routes[<route_index>].partitions`).
    pub route_index: usize,
}

/// The most partitions a route may have.
pub const MAX_PARTITIONS: u16 = 256;

/// The route name of partition `index` of `route`.
pub fn name(route: &str, index: u16) -> String {
    format!("{route}.{index}")
}

/// Every partitioned route replaced by its partitions, in place.
pub fn expand(routes: Vec<RouteConfig>) -> Vec<RouteConfig> {
    let mut out = Vec::with_capacity(routes.len());
    for (route_index, route) in routes.into_iter().enumerate() {
        let Some(count) = route.partitions.filter(|&n| n > 0) else {
            out.push(route);
            continue;
        };
        for index in 0..count {
            let mut part = route.clone();
            part.name = name(&route.name, index);
            part.partitions = None;
            part.partition = Some(Partition {
                group: route.name.clone(),
                index,
                count,
                route_index,
            });
            part.from.queue = route.from.queue.as_ref().map(|q| name(q, index));
            part.from.exchange_type = ExchangeKind::ConsistentHash;
            out.push(part);
        }
    }
    out
}
