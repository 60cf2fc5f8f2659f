//! A model of a route's lock (tests only), to look for two owners by
//! exhaustion rather than by example.
//!
//! The broker side is RabbitMQ's single active consumer on a quorum queue,
//! as delayd relies on it: one active consumer at a time, in registration
//! order; a consumer whose node drops out is suspected, gets nothing, and
//! loses its turn after the queue's disconnected timeout, but stays
//! registered and may be made active again later; deliveries are settled on
//! send (`no_ack`), so what went to one consumer never reaches another.
//!
//! The instance side follows [`Candidate::elected`](super::Candidate) and
//! `hold` step by step, with the real [`Lease`]. Each seed draws outages of
//! each instance's link (its publishes wait, its deliveries wait, the broker
//! suspects its consumer); every tick checks that at most one instance
//! fires (owns the route with its lease held), and once the outages are
//! over, an owner must fire within five leases.
//!
//! [`WaitRule`] picks the candidate's wait: the one the code took until
//! 2026-12-01 (two owners, which the tests keep showing), the one it takes
//! now, and the hand-over of a planned stop (`state/handover.rs`: its
//! notes, the candidate's reading of them and the bound are the real
//! code's), with its bound and without it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{handover, Lease, StateNames, WaitPings};
use crate::split_mix::SplitMix64 as Rng;

/// One step of the model's clock, in milliseconds.
const TICK: u64 = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Body {
    /// A candidate's ping while it waits for its turn.
    Standby,
    /// A candidate's own ping at the end of its wait.
    Check(u64),
    /// An owner's ping, stamped by its lease.
    Owner([u8; 16]),
    /// A chosen candidate's own ping while it waits (nonce, sequence).
    Wait([u8; 16]),
    /// A former owner that stopped on purpose (see
    /// [`WaitRule::UnbrokenWithHandover`]).
    Handover(u64),
    /// Its `Handover` was confirmed within a lease of its last own ping's
    /// send.
    Commit(u64),
}

impl Body {
    /// What the real code would receive: a hand-over note's bytes, or
    /// none for a ping.
    fn note(&self) -> Vec<u8> {
        match *self {
            Body::Handover(n) => handover::Note::Handover(u128::from(n)).encode().to_vec(),
            Body::Commit(n) => handover::Note::Commit(u128::from(n)).encode().to_vec(),
            _ => b"ping".to_vec(),
        }
    }
}

/// What a chosen candidate asks of its wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitRule {
    /// Waits out the lease and the margin from its first ping, then checks
    /// that a ping of its own comes back (the code until 2026-12-01).
    FromFirstPing,
    /// Also pings itself throughout the wait, and starts over when one of
    /// those pings comes back late or not at all: the turn may have moved
    /// away and back, and an owner in between may still hold its lease.
    Unbroken,
    /// [`WaitRule::Unbroken`], and a planned stop hands over without the
    /// wait (`super::handover`, `StateSession::hand_over`). The owner,
    /// once fenced, gives its consumer up and publishes
    /// `Handover(n)`; if its confirm came within a lease of the send of its
    /// last own ping that came back, it publishes `Commit(n)`. A chosen
    /// candidate that receives both goes straight to its check.
    UnbrokenWithHandover,
    /// The same, but the former owner publishes `Commit(n)` however late
    /// the confirm came: the bound's planted absence.
    HandoverWithoutTheBound,
}

impl WaitRule {
    fn hands_over(self) -> bool {
        matches!(
            self,
            Self::UnbrokenWithHandover | Self::HandoverWithoutTheBound
        )
    }
}

struct Consumer {
    instance: usize,
    tag: u64,
    /// Its connection's node died (a stopping owner that lost its
    /// connection that way hands over on a new one): suspected from then,
    /// and never delivered to again.
    dead_since: Option<u64>,
}

/// Timings, in milliseconds.
#[derive(Clone, Copy)]
struct Timing {
    lease: u64,
    margin: u64,
    every: u64,
    disconnected_timeout: u64,
    /// How often a chosen candidate pings itself ([`WaitRule::Unbroken`]).
    wait_every: u64,
    /// How late such a ping may come back.
    wait_late: u64,
}

impl Timing {
    /// As the code derives them from `store.lease`.
    fn for_lease(lease: u64) -> Self {
        let names = StateNames::new("model").with_lease(Duration::from_millis(lease));
        let ms = |d: Duration| d.as_millis() as u64;
        Self {
            lease,
            margin: ms(names.margin()),
            every: ms(names.ping_every()),
            disconnected_timeout: ms(names.disconnected_timeout()),
            wait_every: ms(names.wait_ping_every()),
            wait_late: ms(names.wait_ping_late()),
        }
    }
}

enum Role {
    /// Not on the lock queue; registers at `at`.
    Registering { at: u64 },
    /// Waits for a ping (anyone's), pinging every round.
    Standby { next_round: u64 },
    /// Chosen: waits out the lease and the margin.
    Chosen {
        until: u64,
        next_ping: u64,
        /// Its own pings through the wait, judged by the code's own
        /// [`WaitPings`].
        pings: WaitPings,
        /// What it saw of a hand-over in this wait (the real code's).
        handover: handover::Seen,
    },
    /// Its own ping must come back within two rounds.
    Checking {
        nonce: u64,
        first_sent: u64,
        rounds: u32,
        deadline: u64,
    },
    Owner {
        lease: Lease,
        next_tick: u64,
        /// When its lease started, and the send of its last own ping that
        /// came back.
        started: u64,
        last_back_sent: u64,
    },
    /// Stopped on purpose, fenced: its `Handover(nonce)` is on its way.
    Leaving {
        nonce: u64,
        last_back_sent: u64,
        /// When its `Handover` goes out (after a reconnect and its owed
        /// Dones), unless it has.
        publish_at: Option<u64>,
    },
}

struct Instance {
    role: Role,
    tag: Option<u64>,
    /// Published, not yet at the queue (one tick of transit, or the link
    /// is down).
    outbox: VecDeque<Body>,
    /// Its connection was closed while the link was down: the broker
    /// learns of it when the link is back.
    close_pending: bool,
}

/// How often an owner is drained, in a hundred of its pings
/// ([`WaitRule::UnbrokenWithHandover`]).
const DRAIN_PERCENT: u64 = 2;

/// Link outages: (instance, from, to) in milliseconds.
type Outages = Vec<(usize, u64, u64)>;

fn draw_outages(rng: &mut Rng, instances: usize, horizon: u64, t: Timing) -> Outages {
    let mut outages = Vec::new();
    for i in 0..instances {
        let mut at = rng.below(2 * t.lease);
        while at < horizon {
            // From a blip the broker barely notices to longer than a lease.
            let length = t.disconnected_timeout / 2 + rng.below(2 * t.lease);
            outages.push((i, at, at + length));
            at += length + rng.below(3 * t.lease);
        }
    }
    outages
}

struct Model {
    t: Timing,
    rule: WaitRule,
    /// Faults (outages, drains) come until then.
    horizon: u64,
    base: Instant,
    now: u64,
    rng: Rng,
    queue: VecDeque<Body>,
    consumers: Vec<Consumer>,
    active: Option<u64>,
    /// Since when each instance's link is down, if it is.
    down_since: Vec<Option<u64>>,
    instances: Vec<Instance>,
    next_tag: u64,
    outages: Outages,
    trace: Vec<String>,
}

/// A run that broke the lock's guarantee: two instances fired at once,
/// or none owned the route once the links had been up for a while.
#[derive(Debug)]
pub struct Broken {
    pub seed: u64,
    pub at_ms: u64,
    pub what: &'static str,
    pub trace: Vec<String>,
}

/// How long the links stay up after the outages, and by when an owner must
/// fire: a few leases.
fn quiet(t: Timing) -> u64 {
    5 * t.lease
}

impl Model {
    fn new(seed: u64, instances: usize, horizon: u64, lease: u64, rule: WaitRule) -> Self {
        let t = Timing::for_lease(lease);
        let mut rng = Rng(seed);
        let outages = draw_outages(&mut rng, instances, horizon, t);
        Self {
            t,
            rule,
            horizon,
            base: Instant::now(),
            now: 0,
            rng,
            queue: VecDeque::new(),
            consumers: Vec::new(),
            active: None,
            down_since: vec![None; instances],
            instances: (0..instances)
                .map(|i| Instance {
                    role: Role::Registering { at: i as u64 * 50 },
                    tag: None,
                    outbox: VecDeque::new(),
                    close_pending: false,
                })
                .collect(),
            next_tag: 0,
            outages,
            trace: Vec::new(),
        }
    }

    fn at(&self, ms: u64) -> Instant {
        self.base + Duration::from_millis(ms)
    }

    fn note(&mut self, what: String) {
        self.trace.push(format!("{:>6} ms {what}", self.now));
    }

    fn link_up(&self, i: usize) -> bool {
        self.down_since[i].is_none()
    }

    fn firing(&self, i: usize) -> bool {
        matches!(&self.instances[i].role, Role::Owner { lease, .. } if lease.held_at(self.at(self.now)))
    }

    /// Ticks with an instance firing, of all ticks, and the verdict.
    fn run(mut self, seed: u64, horizon: u64) -> (u64, u64, Result<(), Broken>) {
        let end = horizon + quiet(self.t);
        let mut owned = 0;
        while self.now < end {
            self.links();
            self.broker();
            for i in 0..self.instances.len() {
                self.instance(i);
            }
            let firing: Vec<usize> = (0..self.instances.len())
                .filter(|&i| self.firing(i))
                .collect();
            owned += u64::from(!firing.is_empty());
            if firing.len() > 1 {
                self.note(format!("instances {firing:?} fire at once"));
                return (
                    owned,
                    self.now / TICK,
                    Err(self.broken(seed, "two owners fired at once")),
                );
            }
            self.now += TICK;
        }
        if !(0..self.instances.len()).any(|i| self.firing(i)) {
            return (
                owned,
                end / TICK,
                Err(self.broken(seed, "no owner after the links were up for five leases")),
            );
        }
        (owned, end / TICK, Ok(()))
    }

    fn broken(self, seed: u64, what: &'static str) -> Broken {
        Broken {
            seed,
            at_ms: self.now,
            what,
            trace: self.trace,
        }
    }

    /// Outages begin and end.
    fn links(&mut self) {
        for i in 0..self.instances.len() {
            let down = self
                .outages
                .iter()
                .any(|&(j, from, to)| j == i && (from..to).contains(&self.now));
            match (down, self.down_since[i]) {
                (true, None) => {
                    self.down_since[i] = Some(self.now);
                    self.note(format!("instance {i}: link down"));
                }
                (false, Some(_)) => {
                    self.down_since[i] = None;
                    self.note(format!("instance {i}: link up"));
                    if std::mem::take(&mut self.instances[i].close_pending) {
                        self.remove_consumers_of(i);
                    }
                }
                _ => {}
            }
        }
    }

    /// Since when the broker suspects consumer `c`, if it does.
    fn suspected_since(&self, c: &Consumer) -> Option<u64> {
        c.dead_since.or(self.down_since[c.instance])
    }

    fn remove_consumers_of(&mut self, i: usize) {
        let closed: Vec<u64> = self
            .consumers
            .iter()
            .filter(|c| c.instance == i && Some(c.tag) != self.instances[i].tag)
            .map(|c| c.tag)
            .collect();
        self.consumers.retain(|c| !closed.contains(&c.tag));
        if self.active.is_some_and(|a| closed.contains(&a)) {
            self.active = None;
        }
    }

    fn consumer_instance(&self, tag: u64) -> usize {
        self.consumers
            .iter()
            .find(|c| c.tag == tag)
            .map(|c| c.instance)
            .expect("a registered consumer")
    }

    /// The queue: publishes arrive, the turn moves, deliveries go out.
    fn broker(&mut self) {
        for i in 0..self.instances.len() {
            if self.link_up(i) {
                let arrived: Vec<Body> = self.instances[i].outbox.drain(..).collect();
                self.queue.extend(arrived.iter().copied());
                if let Role::Leaving {
                    nonce,
                    last_back_sent,
                    ..
                } = self.instances[i].role
                {
                    if arrived.contains(&Body::Handover(nonce)) {
                        // Confirmed now (transit back: none, the most
                        // lenient case for the bound).
                        let bound = self.rule != WaitRule::HandoverWithoutTheBound;
                        let at = |ms| self.base + Duration::from_millis(ms);
                        let lease = Duration::from_millis(self.t.lease);
                        if !bound || handover::may_commit(at(last_back_sent), at(self.now), lease) {
                            self.publish(i, Body::Commit(nonce));
                        }
                        self.instances[i].role = Role::Registering { at: self.now + 100 };
                    }
                }
            }
        }
        // A suspected active consumer loses its turn after the timeout; a
        // queue with no active consumer gives the turn to the first that
        // can take it. The one passed over stays registered.
        let suspected_long = self.active.is_some_and(|a| {
            self.consumers
                .iter()
                .find(|c| c.tag == a)
                .and_then(|c| self.suspected_since(c))
                .is_some_and(|since| self.now - since >= self.t.disconnected_timeout)
        });
        if self.active.is_none() || suspected_long {
            let next = self
                .consumers
                .iter()
                .find(|c| Some(c.tag) != self.active && self.suspected_since(c).is_none())
                .map(|c| (c.tag, c.instance));
            if let Some((tag, i)) = next {
                if let Some(old) = self.active {
                    // Back to the end of the waiting consumers.
                    let pos = self
                        .consumers
                        .iter()
                        .position(|c| c.tag == old)
                        .expect("registered");
                    let c = self.consumers.remove(pos);
                    self.consumers.push(c);
                }
                self.active = Some(tag);
                self.note(format!("the turn moves to instance {i}"));
            }
        }
        let Some(active) = self.active else { return };
        let i = self.consumer_instance(active);
        if !self.link_up(i) || self.instances[i].tag != Some(active) {
            return;
        }
        let delivered: Vec<Body> = self.queue.drain(..).collect();
        for body in delivered {
            self.deliver(i, body);
        }
    }

    fn publish(&mut self, i: usize, body: Body) {
        self.instances[i].outbox.push_back(body);
    }

    fn deliver(&mut self, i: usize, body: Body) {
        let now = self.now;
        let wait = self.t.lease + self.t.margin;
        let fresh = self.rng.next();
        let inst = &mut self.instances[i];
        let mut chosen = false;
        let mut broken = false;
        let mut committed = false;
        match &mut inst.role {
            Role::Standby { .. } => {
                inst.role = Role::Chosen {
                    until: now + wait,
                    next_ping: now,
                    pings: WaitPings::new(fresh, Duration::from_millis(self.t.wait_late)),
                    handover: {
                        let mut seen = handover::Seen::default();
                        seen.committed(&body.note());
                        seen
                    },
                };
                chosen = true;
            }
            Role::Chosen {
                pings, handover, ..
            } => match body {
                Body::Wait(ping) => broken = !pings.arrived(&ping),
                Body::Handover(_) | Body::Commit(_) => committed = handover.committed(&body.note()),
                _ => {}
            },
            Role::Checking {
                nonce, first_sent, ..
            } if body == Body::Check(*nonce) => {
                let held_from = self.base + Duration::from_millis(*first_sent);
                inst.role = Role::Owner {
                    lease: Lease::new(Duration::from_millis(self.t.lease), held_from),
                    next_tick: now,
                    started: *first_sent,
                    last_back_sent: *first_sent,
                };
                self.trace
                    .push(format!("{now:>6} ms instance {i}: owns the route"));
            }
            Role::Owner {
                lease,
                started,
                last_back_sent,
                ..
            } => {
                if let Body::Owner(ping) = body {
                    lease.renew_from(&ping);
                    if ping[..8] == lease.nonce {
                        let ms = u64::from_be_bytes(ping[8..].try_into().expect("8 bytes"));
                        *last_back_sent = (*last_back_sent).max(*started + ms);
                    }
                }
            }
            _ => {}
        }
        if chosen {
            self.note(format!("instance {i}: chosen, waits out the lease"));
        }
        if broken && self.rule != WaitRule::FromFirstPing {
            self.start_over(i, "a ping of its wait came back out of order");
        } else if committed && self.rule.hands_over() {
            self.note(format!("instance {i}: handed over to, checks at once"));
            self.check(i);
        }
    }

    /// The wait is over: its own ping must come back within two rounds.
    fn check(&mut self, i: usize) {
        let nonce = self.rng.next();
        self.instances[i].role = Role::Checking {
            nonce,
            first_sent: self.now,
            rounds: 0,
            deadline: self.now + self.t.every,
        };
        self.publish(i, Body::Check(nonce));
    }

    fn start_over(&mut self, i: usize, why: &str) {
        self.instances[i].role = Role::Standby {
            next_round: self.now,
        };
        self.note(format!("instance {i}: waits again: {why}"));
    }

    fn instance(&mut self, i: usize) {
        let now = self.now;
        let t = self.t;
        let at = self.at(now);
        match &mut self.instances[i].role {
            Role::Registering { at: when } => {
                if now >= *when && self.link_up(i) {
                    let tag = self.next_tag;
                    self.next_tag += 1;
                    self.consumers.push(Consumer {
                        instance: i,
                        tag,
                        dead_since: None,
                    });
                    self.instances[i].tag = Some(tag);
                    self.instances[i].role = Role::Standby { next_round: now };
                }
            }
            Role::Standby { next_round } => {
                if now >= *next_round {
                    *next_round = now + t.every;
                    self.publish(i, Body::Standby);
                }
            }
            Role::Chosen {
                until,
                next_ping,
                pings,
                ..
            } => {
                if self.rule != WaitRule::FromFirstPing {
                    if pings.late_at(at) {
                        self.start_over(i, "a ping of its wait is late");
                        return;
                    }
                    if now >= *next_ping {
                        let body = Body::Wait(pings.send(at));
                        *next_ping = now + t.wait_every;
                        self.publish(i, body);
                        return;
                    }
                }
                if now >= *until {
                    self.check(i);
                }
            }
            Role::Checking {
                nonce,
                rounds,
                deadline,
                ..
            } => {
                if now >= *deadline {
                    *rounds += 1;
                    let nonce = *nonce;
                    if *rounds >= 2 {
                        self.instances[i].role = Role::Standby { next_round: now };
                    } else {
                        *deadline = now + t.every;
                        self.publish(i, Body::Check(nonce));
                    }
                }
            }
            Role::Owner {
                lease,
                next_tick,
                last_back_sent,
                ..
            } => {
                if now >= *next_tick {
                    let drained = self.rule.hands_over()
                        && self.down_since[i].is_none()
                        && now < self.horizon
                        && self.rng.chance(DRAIN_PERCENT);
                    if drained && lease.held_at(at) {
                        // A planned stop, or a connection lost with the
                        // lease still held: it fences itself at once, and
                        // its `Handover` goes out a while later, on a new
                        // connection if the old one is gone.
                        let (nonce, last_back_sent) = (self.rng.next(), *last_back_sent);
                        let publish_at = now + self.rng.below(self.t.lease + self.t.lease / 2);
                        self.instances[i].role = Role::Leaving {
                            nonce,
                            last_back_sent,
                            publish_at: Some(publish_at),
                        };
                        self.instances[i].tag = None;
                        if self.rng.chance(50) {
                            // Stopped, or drained: the broker removes its
                            // consumer at once.
                            self.remove_consumers_of(i);
                            self.note(format!("instance {i}: stops, hands over"));
                        } else {
                            // Its connection's node died: the consumer stays,
                            // suspected, until the disconnected timeout.
                            for c in self.consumers.iter_mut().filter(|c| c.instance == i) {
                                c.dead_since = Some(now);
                            }
                            self.note(format!("instance {i}: its node died, hands over"));
                        }
                    } else if !lease.held_at(at) {
                        // Lost: the connection closes, and the instance
                        // registers again on a new one.
                        self.instances[i].role = Role::Registering { at: now + 100 };
                        self.instances[i].tag = None;
                        if self.link_up(i) {
                            self.remove_consumers_of(i);
                        } else {
                            self.instances[i].close_pending = true;
                        }
                        self.note(format!("instance {i}: lost the lock"));
                    } else {
                        *next_tick = now + t.every;
                        let ping = lease.ping_at(at);
                        self.publish(i, Body::Owner(ping));
                    }
                }
            }
            // Publishes its Handover, then waits for the confirm (see
            // `broker`).
            Role::Leaving {
                nonce,
                publish_at: Some(at),
                ..
            } if now >= *at => {
                let nonce = *nonce;
                if let Role::Leaving { publish_at, .. } = &mut self.instances[i].role {
                    *publish_at = None;
                }
                self.publish(i, Body::Handover(nonce));
            }
            Role::Leaving { .. } => {}
        }
    }
}

/// What a search found.
pub struct Searched {
    /// The first broken run, if any.
    pub broken: Option<Broken>,
    /// The share of ticks with an owner firing, over the runs made.
    pub owned: f64,
}

/// Run `seeds` (outages for `horizon` ms, then quiet) until one breaks.
pub fn search(seeds: std::ops::Range<u64>, horizon: u64, lease: u64, rule: WaitRule) -> Searched {
    let (mut owned, mut ticks) = (0, 0);
    for seed in seeds {
        let (o, t, verdict) = Model::new(seed, 3, horizon, lease, rule).run(seed, horizon);
        owned += o;
        ticks += t;
        if let Err(broken) = verdict {
            return Searched {
                broken: Some(broken),
                owned: owned as f64 / ticks.max(1) as f64,
            };
        }
    }
    Searched {
        broken: None,
        owned: owned as f64 / ticks.max(1) as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_holds(searched: Searched) {
        if let Some(b) = searched.broken {
            panic!(
                "seed {}, {} ms: {}\n{}",
                b.seed,
                b.at_ms,
                b.what,
                b.trace.join("\n")
            );
        }
    }

    #[test]
    fn a_wait_counted_from_the_first_ping_lets_two_owners_fire() {
        let searched = search(0..2000, 30_000, 1000, WaitRule::FromFirstPing);
        let broken = searched.broken.expect("the model finds two owners");
        assert_eq!(broken.what, "two owners fired at once");
    }

    #[test]
    fn a_handover_committed_within_a_lease_never_lets_two_owners_fire() {
        assert_holds(search(
            0..1000,
            30_000,
            1000,
            WaitRule::UnbrokenWithHandover,
        ));
        let searched = search(0..1000, 30_000, 1000, WaitRule::HandoverWithoutTheBound);
        let broken = searched.broken.expect("without the bound, two owners");
        assert_eq!(broken.what, "two owners fired at once");
    }

    #[test]
    fn an_unbroken_wait_never_lets_two_owners_fire_and_always_elects_one() {
        assert_holds(search(0..1000, 30_000, 1000, WaitRule::Unbroken));
        assert_holds(search(1000..1300, 60_000, 5000, WaitRule::Unbroken));
    }

    /// A benchmark-like run, too long for the test command (which runs the
    /// bounded tests above): `bash scripts/sim.sh --lock N`. It fails as
    /// they do.
    #[test]
    #[ignore]
    fn long_run() {
        let n: u64 = std::env::var("LOCK_MODEL_SEEDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(100_000);
        for (lease, horizon) in [(1000, 30_000), (5000, 120_000)] {
            for rule in [
                WaitRule::FromFirstPing,
                WaitRule::Unbroken,
                WaitRule::UnbrokenWithHandover,
            ] {
                let searched = search(0..n, horizon, lease, rule);
                println!(
                    "lease {lease} ms, {rule:?}: {}, owner firing {:.1} % of the time",
                    searched
                        .broken
                        .as_ref()
                        .map_or("no broken run".to_string(), |b| format!(
                            "seed {}: {}",
                            b.seed, b.what
                        )),
                    100.0 * searched.owned
                );
                // The old wait is there to show the model still finds its
                // two owners; the others must hold.
                match rule {
                    WaitRule::FromFirstPing => assert!(searched.broken.is_some()),
                    _ => assert_holds(searched),
                }
            }
        }
    }
}
