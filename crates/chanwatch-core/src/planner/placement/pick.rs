//! The balance move picker: which channel moves next, from where, to where (DESIGN §5).
//!
//! Owns: the choice of moves against a [`Loads`]. Must not: look at the view, or decide
//! whether balance may run at all (quiet period, cool-down: the callers' business).

use std::collections::BTreeMap;

use super::{Load, Loads, Movable, PlannedMove, Want};
use crate::types::{ChannelName, NodeId};

/// Up to `budget` balance moves (DESIGN §5): while the spread is over one channel's weight
/// `unit` by the smallest capacity, a channel moves from the busiest node that has one it
/// may move to the least loaded node (ties: lowest IDs). Of the source's channels it takes
/// the one that leaves the two nodes closest to each other (then the heaviest, then the last
/// by name), and only one the target has room for under `room` and whose move lowers
/// Σ weight²/capacity, so balance ends. But when one move would leave the loads balanced, it
/// takes that move instead (see [`finishing_move`]). `loads` ends as it would after the moves.
pub(in crate::planner) fn pick_moves(
    loads: &mut Loads,
    movable: &mut BTreeMap<NodeId, Vec<Movable>>,
    budget: usize,
    unit: u64,
    room: impl Fn(&Loads, NodeId, u64) -> bool,
    allowed: impl Fn(&ChannelName, NodeId) -> bool,
) -> Vec<PlannedMove> {
    let mut out = Vec::new();
    'moves: while out.len() < budget && !loads.balanced(unit) {
        let Some((to, low)) = loads.lightest() else {
            break;
        };
        if let Some((from, i)) = finishing_move(loads, movable, to, unit, &room, &allowed) {
            let m = movable.get_mut(&from).map(|cs| cs.remove(i));
            if let Some(m) = m {
                take(loads, &mut out, m, from, to);
                break;
            }
        }
        for (from, high) in loads.by_load_desc() {
            if high <= low {
                break; // the rest are as light as the target
            }
            let Some(cs) = movable.get_mut(&from) else {
                continue;
            };
            let (ca, cb) = (high.capacity, low.capacity);
            // Only a move that lowers Σ weight²/capacity, so balance ends:
            // 2 (a/ca − b/cb) > w/ca + w/cb, times ca·cb.
            let lowers = |w: u64| {
                let d = i128::from(high.weight) * i128::from(cb)
                    - i128::from(low.weight) * i128::from(ca);
                2 * d > i128::from(w) * (i128::from(ca) + i128::from(cb))
            };
            let gap = |w: u64| gap(high, low, w);
            let best = cs
                .iter()
                .enumerate()
                .filter(|(_, m)| {
                    lowers(m.weight) && room(loads, to, m.weight) && allowed(&m.channel, to)
                })
                .min_by(|(i, a), (j, b)| {
                    gap(a.weight)
                        .cmp(&gap(b.weight))
                        .then(b.weight.cmp(&a.weight))
                        .then(j.cmp(i))
                })
                .map(|(i, _)| i);
            let Some(i) = best else {
                // Everything on this node is mid-transition, pinned, cooling down or kept
                // off the least loaded node: try the next busiest.
                continue;
            };
            let m = cs.remove(i);
            take(loads, &mut out, m, from, to);
            continue 'moves;
        }
        break;
    }
    out
}

/// How far apart `high` and `low` are after `w` moves from one to the other, times both
/// capacities: |(a/ca − w/ca) − (b/cb + w/cb)| · ca · cb = |(a − w)·cb − (b + w)·ca|.
fn gap(high: Load, low: Load, w: u64) -> i128 {
    let l = i128::from(high.weight) - i128::from(w);
    let r = i128::from(low.weight) + i128::from(w);
    (l * i128::from(low.capacity) - r * i128::from(high.capacity)).abs()
}

/// Counts `m`'s move from `from` to `to` in `loads` and plans it.
fn take(loads: &mut Loads, out: &mut Vec<PlannedMove>, m: Movable, from: NodeId, to: NodeId) {
    loads.remove(from, m.weight);
    loads.add(
        to,
        Want {
            weight: m.weight,
            group: None,
        },
    );
    out.push(PlannedMove {
        channel: m.channel,
        from,
        to,
    });
}

/// A single move to the least loaded node `to` after which the loads are balanced, if one
/// exists: the node it leaves is one of the busiest (any other leaves the busiest as it is).
/// The greedy step alone can spend two moves where one suffices (capacities 1, 1, 3, 1 with a
/// weight-3 channel on a full node: it first moves a weight-2 channel off the tied node of
/// lower ID); found by the proptest against the brute-force optimum. Cost: O(nodes) per
/// busiest node, plus its movable channels.
fn finishing_move(
    loads: &Loads,
    movable: &BTreeMap<NodeId, Vec<Movable>>,
    to: NodeId,
    unit: u64,
    room: &impl Fn(&Loads, NodeId, u64) -> bool,
    allowed: &impl Fn(&ChannelName, NodeId) -> bool,
) -> Option<(NodeId, usize)> {
    let (_, top) = loads.busiest()?;
    let target = loads.get(to);
    let smallest = loads.min_capacity();
    for (from, high) in loads.by_load_desc() {
        if high != top {
            break;
        }
        let Some(cs) = movable.get(&from).filter(|cs| !cs.is_empty()) else {
            continue;
        };
        if from == to {
            continue;
        }
        // The extremes of every other node, which the move leaves as they are.
        let others = loads.iter().filter(|(n, _)| *n != from && *n != to);
        let (mut max, mut min): (Option<Load>, Option<Load>) = (None, None);
        for (_, l) in others {
            max = Some(max.map_or(l, |m| m.max(l)));
            min = Some(min.map_or(l, |m| m.min(l)));
        }
        // Of the finishing moves, the one the greedy step would prefer: the two nodes left
        // closest, then the heavier channel, then the later one.
        let gap = |w: u64| gap(high, target, w);
        let finishes = |m: &Movable| {
            let left = Load {
                weight: high.weight.saturating_sub(m.weight),
                capacity: high.capacity,
            };
            let got = target.plus(m.weight);
            let hi = [Some(left), Some(got), max].into_iter().flatten().max();
            let lo = [Some(left), Some(got), min].into_iter().flatten().min();
            matches!((hi, lo), (Some(hi), Some(lo)) if hi.within(lo, unit, smallest))
        };
        let best = cs
            .iter()
            .enumerate()
            .filter(|(_, m)| room(loads, to, m.weight) && allowed(&m.channel, to) && finishes(m))
            .min_by(|(i, a), (j, b)| {
                gap(a.weight)
                    .cmp(&gap(b.weight))
                    .then(b.weight.cmp(&a.weight))
                    .then(j.cmp(i))
            });
        if let Some((i, _)) = best {
            return Some((from, i));
        }
    }
    None
}
