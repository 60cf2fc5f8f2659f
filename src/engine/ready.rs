//! Due messages out of the wheel, waiting for the dispatcher: one queue per
//! route, each in (deadline, id) order, taken a route at a time.
//!
//! The wheel knows only deadlines, so a burst of 200,000 messages on one
//! route due now would go out before a quiet route's message due a moment
//! later, all 200,000 of them first. Here each route with due work gets an
//! equal share of every batch (round robin, one message per route per
//! round, starting each batch one route further on), so a burst costs
//! another route at most its share of a batch. Order is kept per route,
//! which is what a route promises; across routes there is none to keep.
//!
//! An entry is also here while its deadline is ahead of the wall clock (the
//! wheel advanced, then the clock stepped back): it is taken once the clock
//! reaches it.

use std::collections::btree_map::Range;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::wheel::Expired;

use super::state::Slot;

#[derive(Debug, Default)]
pub struct Ready {
    /// Indexed by route.
    routes: Vec<BTreeMap<(u64, u64), Slot>>,
    /// Routes with an entry here.
    nonempty: BTreeSet<u16>,
    /// Id -> (route, deadline) of every entry, so finding one is O(1).
    at: HashMap<u64, (u16, u64)>,
    /// The route the next batch starts its round with.
    turn: u16,
}

impl Ready {
    pub fn len(&self) -> usize {
        self.at.len()
    }

    pub fn insert(&mut self, deadline: u64, id: u64, slot: Slot) {
        let route = slot.route;
        let index = route as usize;
        if self.routes.len() <= index {
            self.routes.resize_with(index + 1, BTreeMap::new);
        }
        self.routes[index].insert((deadline, id), slot);
        self.nonempty.insert(route);
        self.at.insert(id, (route, deadline));
    }

    pub fn remove(&mut self, id: u64) -> Option<Expired<Slot>> {
        let (route, deadline) = self.at.remove(&id)?;
        let queue = &mut self.routes[route as usize];
        let data = queue.remove(&(deadline, id))?;
        if queue.is_empty() {
            self.nonempty.remove(&route);
        }
        Some(Expired { id, deadline, data })
    }

    pub fn contains(&self, id: u64) -> bool {
        self.at.contains_key(&id)
    }

    pub fn get(&self, id: u64) -> Option<(Slot, u64)> {
        let &(route, deadline) = self.at.get(&id)?;
        let slot = *self.routes[route as usize].get(&(deadline, id))?;
        Some((slot, deadline))
    }

    pub fn get_mut(&mut self, id: u64) -> Option<&mut Slot> {
        let &(route, deadline) = self.at.get(&id)?;
        self.routes[route as usize].get_mut(&(deadline, id))
    }

    /// The earliest deadline here.
    pub fn first_deadline(&self) -> Option<u64> {
        self.nonempty
            .iter()
            .filter_map(|&r| self.routes[r as usize].keys().next().map(|k| k.0))
            .min()
    }

    /// The latest deadline here.
    pub fn last_deadline(&self) -> Option<u64> {
        self.nonempty
            .iter()
            .filter_map(|&r| self.routes[r as usize].keys().next_back().map(|k| k.0))
            .max()
    }

    /// Each route's entries from `lower` on, in (deadline, id) order, for
    /// the routes `route` admits (`None`: all).
    pub fn ranges(
        &self,
        route: Option<u16>,
        lower: (u64, u64),
    ) -> impl Iterator<Item = Range<'_, (u64, u64), Slot>> {
        self.nonempty
            .iter()
            .filter(move |&&r| route.is_none_or(|want| want == r))
            .map(move |&r| self.routes[r as usize].range(lower..))
    }

    /// Move up to `max` entries due by `now` into `out`, a route at a time:
    /// each round takes the first `weights[route]` entries (1 if unlisted)
    /// of every route that has one due, starting one route further on than
    /// the last batch did. A route's entry after its `claimed` (due, id)
    /// waits: an earlier message of that route is stored but not yet armed.
    pub fn take_in_turn(
        &mut self,
        now: u64,
        max: usize,
        claimed: &dyn Fn(u16) -> Option<(u64, u64)>,
        weights: &[u32],
        out: &mut Vec<Expired<Slot>>,
    ) {
        if self.nonempty.is_empty() || out.len() >= max {
            return;
        }
        let start = self.turn;
        let mut order: Vec<u16> = self.nonempty.range(start..).copied().collect();
        order.extend(self.nonempty.range(..start).copied());
        self.turn = order.first().map_or(0, |&r| r.checked_add(1).unwrap_or(0));
        let limits: Vec<Option<(u64, u64)>> = order.iter().map(|&r| claimed(r)).collect();
        let mut active: Vec<(u16, Option<(u64, u64)>)> = order.into_iter().zip(limits).collect();
        while out.len() < max && !active.is_empty() {
            active.retain(|&(route, limit)| {
                let share = weights.get(route as usize).copied().unwrap_or(1).max(1);
                let queue = &mut self.routes[route as usize];
                for _ in 0..share {
                    if out.len() >= max {
                        return true;
                    }
                    let Some((&(deadline, id), _)) = queue.first_key_value() else {
                        return false;
                    };
                    if deadline > now || limit.is_some_and(|c| (deadline, id) > c) {
                        return false;
                    }
                    let (_, data) = queue.pop_first().expect("first is there");
                    self.at.remove(&id);
                    out.push(Expired { id, deadline, data });
                }
                true
            });
        }
        self.nonempty
            .retain(|&r| !self.routes[r as usize].is_empty());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::WalPos;

    fn slot(route: u16) -> Slot {
        Slot {
            pos: WalPos {
                segment: 0,
                offset: 0,
            },
            route,
        }
    }

    fn take(ready: &mut Ready, now: u64, max: usize) -> Vec<Expired<Slot>> {
        let mut out = Vec::new();
        ready.take_in_turn(now, max, &|_| None, &[], &mut out);
        out
    }

    /// Route A holds 10,000 due messages, route B 10 due later: B's 10 are
    /// all in A's first batch, and each route's own order is kept.
    #[test]
    fn a_quiet_route_is_not_held_behind_another_routes_burst() {
        let mut ready = Ready::default();
        for id in 0..10_000u64 {
            ready.insert(1_000, id, slot(0));
        }
        for id in 10_000..10_010u64 {
            ready.insert(1_500, id, slot(1));
        }
        let first = take(&mut ready, 2_000, 256);
        let b: Vec<u64> = first
            .iter()
            .filter(|e| e.data.route == 1)
            .map(|e| e.id)
            .collect();
        assert_eq!(b, (10_000..10_010).collect::<Vec<_>>());
        let a: Vec<u64> = first
            .iter()
            .filter(|e| e.data.route == 0)
            .map(|e| e.id)
            .collect();
        assert_eq!(a, (0..246).collect::<Vec<_>>(), "route A in its order");
        let mut rest = Vec::new();
        loop {
            let batch = take(&mut ready, 2_000, 256);
            if batch.is_empty() {
                break;
            }
            rest.extend(batch.into_iter().map(|e| e.id));
        }
        assert_eq!(rest, (246..10_000).collect::<Vec<_>>());
        assert_eq!(ready.len(), 0);
    }

    /// Three routes with more due than a batch: each gets a third, and the
    /// route that went first goes later next time.
    #[test]
    fn every_route_with_due_work_gets_an_equal_share_and_a_turn_first() {
        let mut ready = Ready::default();
        for route in 0..3u16 {
            for n in 0..1_000u64 {
                ready.insert(10, u64::from(route) * 1_000 + n, slot(route));
            }
        }
        let mut firsts = Vec::new();
        for _ in 0..3 {
            let batch = take(&mut ready, 10, 90);
            let per_route: Vec<usize> = (0..3u16)
                .map(|r| batch.iter().filter(|e| e.data.route == r).count())
                .collect();
            assert_eq!(per_route, vec![30, 30, 30]);
            firsts.push(batch[0].data.route);
        }
        assert_eq!(firsts, vec![0, 1, 2]);
    }

    /// Weights: route 0 at 3 takes three for each of route 1's.
    #[test]
    fn a_weighted_route_takes_its_weight_per_round() {
        let mut ready = Ready::default();
        for route in 0..2u16 {
            for n in 0..100u64 {
                ready.insert(10, u64::from(route) * 100 + n, slot(route));
            }
        }
        let mut out = Vec::new();
        ready.take_in_turn(10, 40, &|_| None, &[3, 1], &mut out);
        let first: Vec<u16> = out.iter().take(8).map(|e| e.data.route).collect();
        assert_eq!(first, vec![0, 0, 0, 1, 0, 0, 0, 1]);
        assert_eq!(out.iter().filter(|e| e.data.route == 0).count(), 30);
    }

    /// Not due yet (the clock stepped back) or after its route's claim: it
    /// waits, and other routes go on.
    #[test]
    fn an_entry_waits_for_its_deadline_and_its_routes_claim_only() {
        let mut ready = Ready::default();
        ready.insert(100, 1, slot(0));
        ready.insert(200, 2, slot(0));
        ready.insert(100, 3, slot(1));
        ready.insert(300, 4, slot(2));
        let mut out = Vec::new();
        let claims = |r: u16| (r == 0).then_some((100, 1));
        ready.take_in_turn(250, 10, &claims, &[], &mut out);
        let ids: Vec<u64> = out.iter().map(|e| e.id).collect();
        assert_eq!(ids, vec![1, 3], "2 is after route 0's claim, 4 not due");
        assert_eq!(ready.first_deadline(), Some(200));
        assert!(ready.get(2).is_some() && ready.contains(4));
        assert_eq!(ready.remove(4).map(|e| e.deadline), Some(300));
        assert_eq!(ready.len(), 1);
    }
}
