//! Choosing where a request runs, as a pure function over a snapshot: the live workers (with
//! the age of their last beat), the prefix each decode engine already caches (its HasBlocks
//! answer, gathered by the caller), and the requests this gateway has in flight on each. No I/O
//! and no clock: the same inputs give the same [`Plan`], so every case is a table row.
//!
//! The policy:
//! - prefill: the live, non-draining prefill engine with the least load, as it beat plus what
//!   this gateway sent it since; ties spread per request (`Policy::spread`), never to the
//!   lowest id;
//! - decode: every live, non-draining decode engine that answered HasBlocks, scored
//!   `cached prefix tokens - load_penalty_tokens x (running + queued + routed by this gateway)`,
//!   best first; ties go to more free blocks, then the lower id;
//! - with no prefill engine or no decode engine, a `both` engine serves it colocated;
//! - else nothing can.

use super::worker::WorkerId;
use crate::telemetry::metrics::RouteReason;
use std::collections::HashMap;
use std::fmt;

use kvwire_grpc::pb::control::WorkerStatus;

use crate::net::role::Role;

pub use super::worker::WorkerView;

/// Why a decode engine was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// It holds the first `blocks` full blocks of the prompt.
    PrefixHit {
        /// Blocks cached.
        blocks: usize,
    },
    /// Nobody holds a prefix: the least loaded.
    ByLoad,
}

/// The route reason of a request a `both` engine runs alone: no disaggregated pair exists, or
/// every decode engine tried refused the push.
pub const FALLBACK_REASON: &str = "fallback: colocated on a both-role engine";

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::PrefixHit { blocks } => write!(f, "prefix hit: {blocks} blocks cached"),
            Reason::ByLoad => f.write_str("no cached prefix: by load"),
        }
    }
}

/// A decode engine in the order of preference.
#[derive(Clone, Debug, PartialEq)]
pub struct Ranked {
    /// The engine.
    pub worker: WorkerStatus,
    /// Full prompt blocks it holds.
    pub cached_blocks: usize,
    /// Its score (higher is better).
    pub score: f64,
    /// Why it ranks where it does.
    pub reason: Reason,
}

/// Where a request goes: a prefill engine and decode engines to try in order, and the `both`
/// engine to fall back to when those fail.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// The prefill engine, when a disaggregated pair exists.
    pub prefill: Option<WorkerStatus>,
    /// The next prefill engine by load, tried once when `prefill` cannot be reached or takes
    /// longer than the Prefill deadline.
    pub prefill_spare: Option<WorkerStatus>,
    /// Decode engines, best first (empty without a prefill engine).
    pub decode: Vec<Ranked>,
    /// The colocated fallback.
    pub fallback: Option<WorkerStatus>,
}

impl Plan {
    /// True when nothing can serve the request.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        (self.prefill.is_none() || self.decode.is_empty()) && self.fallback.is_none()
    }
}

/// The label of a plan's routing decision (`tl_route_decisions_total{reason}`, the `route`
/// span's `reason`).
#[must_use]
pub fn reason_label(plan: &Plan) -> RouteReason {
    match (plan.decode.first(), &plan.fallback) {
        (Some(d), _) if plan.prefill.is_some() => match d.reason {
            Reason::PrefixHit { .. } => RouteReason::PrefixHit,
            Reason::ByLoad => RouteReason::ByLoad,
        },
        (_, Some(_)) => RouteReason::Colocated,
        _ => RouteReason::None,
    }
}

/// The weights of the policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy {
    /// Cached prefix tokens one sequence of load is worth.
    pub load_penalty_tokens: f64,
    /// Decode engines the plan ranks, best first (the ones a Prefill may try): the others
    /// are scored but not copied into the plan.
    pub ranked: usize,
    /// Which of the `both` engines still tied after score and this gateway's load takes a
    /// colocated request (a different value per request spreads them).
    pub spread: u64,
}

/// The `both` engine a colocated request goes to: the best score of its cached prefix against
/// its load (running and queued as it beat, plus what this gateway sent it since), then the
/// fewest sent by this gateway, then, among the engines still tied, the `spread`-th, so equal
/// engines share the requests instead of the lowest id taking them all.
fn pick_colocated<'a>(
    candidates: impl Iterator<Item = &'a WorkerStatus>,
    cached: impl Fn(&str) -> usize,
    in_flight: &HashMap<WorkerId, u32>,
    policy: Policy,
) -> Option<WorkerStatus> {
    let mut best: Vec<(&WorkerStatus, f64, u32)> = Vec::new();
    for w in candidates {
        let mine = in_flight.get(&w.worker_id).copied().unwrap_or(0);
        let s = score(
            cached(&w.worker_id) * w.block_tokens as usize,
            w.running + w.queue_depth + mine,
            policy.load_penalty_tokens,
        );
        let against = best
            .first()
            .map(|&(_, bs, bm)| s.total_cmp(&bs).then(bm.cmp(&mine)));
        match against {
            None | Some(std::cmp::Ordering::Greater) => {
                best.clear();
                best.push((w, s, mine));
            }
            Some(std::cmp::Ordering::Equal) => best.push((w, s, mine)),
            Some(std::cmp::Ordering::Less) => {}
        }
    }
    let n = best.len() as u64;
    (n > 0).then(|| best[(policy.spread % n) as usize].0.clone())
}

/// The `both` engines that can serve a request colocated.
fn colocated_candidates(workers: &[WorkerView]) -> impl Iterator<Item = &WorkerStatus> {
    workers
        .iter()
        .filter(|w| w.is(Role::Both) && w.usable() && w.front().is_some())
        .map(|w| &w.status)
}

/// The routing score of a decode engine: cached prefix tokens minus `load_penalty_tokens` per
/// sequence it runs, has queued, or was sent by this gateway since its last beat.
///
/// With the default penalty of 64, a 32-block prefix at B=4 (128 tokens) outweighs a load
/// difference of one sequence, and is given up once the holder runs two more sequences than
/// another engine.
#[must_use]
pub fn score(cached_prefix_tokens: usize, load: u32, load_penalty_tokens: f64) -> f64 {
    cached_prefix_tokens as f64 - load_penalty_tokens * f64::from(load)
}

/// The prefill engine of a request and its spare: the usable prefill engines by the load they
/// beat plus the requests this gateway sent each since (Prefill calls in flight and, on a
/// `both` engine, its streams), so a burst between beats spreads; among the least loaded, the
/// `spread`-th (by id), never always the lowest id. The spare is the best of the others.
fn pick_prefill<'a>(
    candidates: impl Iterator<Item = &'a WorkerView>,
    in_flight: &HashMap<WorkerId, u32>,
    spread: u64,
) -> (Option<WorkerStatus>, Option<WorkerStatus>) {
    let mut c: Vec<(u32, &WorkerStatus)> = candidates
        .filter(|w| w.is(Role::Prefill) && w.usable())
        .map(|w| {
            let mine = in_flight.get(&w.status.worker_id).copied().unwrap_or(0);
            (w.load().saturating_add(mine), &w.status)
        })
        .collect();
    c.sort_by(|a, b| {
        a.0.cmp(&b.0)
            .then_with(|| a.1.worker_id.cmp(&b.1.worker_id))
    });
    let Some(&(least, _)) = c.first() else {
        return (None, None);
    };
    let ties = c.iter().take_while(|x| x.0 == least).count() as u64;
    // Mixed, so that a caller stepping `spread` by more than one per request still spreads.
    let pick = ((spread.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % ties) as usize;
    let spare = c
        .iter()
        .enumerate()
        .find(|&(i, _)| i != pick)
        .map(|(_, x)| x.1.clone());
    (Some(c[pick].1.clone()), spare)
}

fn least_loaded(workers: &[WorkerView], role: Role) -> Option<&WorkerView> {
    least_loaded_except(workers, role, None)
}

/// [`least_loaded`] among the workers other than `except`.
fn least_loaded_except<'a>(
    workers: &'a [WorkerView],
    role: Role,
    except: Option<&str>,
) -> Option<&'a WorkerView> {
    workers
        .iter()
        .filter(|w| w.is(role) && w.usable() && Some(w.status.worker_id.as_str()) != except)
        .min_by(|a, b| {
            a.load()
                .cmp(&b.load())
                .then_with(|| a.status.worker_id.cmp(&b.status.worker_id))
        })
}

/// The decode engines worth asking HasBlocks: live, not draining, receiving KV.
#[must_use]
pub fn decode_candidates(workers: &[WorkerView]) -> Vec<&WorkerStatus> {
    workers
        .iter()
        .filter(|w| w.is(Role::Decode) && w.usable() && w.kv_target().is_some())
        .map(|w| &w.status)
        .collect()
}

/// The decode engines to ask HasBlocks before [`plan`]: the candidates, when a prefill engine
/// exists to pair them with (else none: the request can only run colocated).
#[must_use]
pub fn has_blocks_targets(workers: &[WorkerView]) -> Vec<&WorkerStatus> {
    if least_loaded(workers, Role::Prefill).is_some() {
        decode_candidates(workers)
    } else {
        Vec::new()
    }
}

/// Chooses where a request goes. `cached` holds, per decode worker id, the full prompt blocks
/// it answered it holds (an engine missing from it failed or timed out, and is left out);
/// `in_flight` the requests this gateway has sent each worker and not yet finished.
#[must_use]
pub fn plan(
    workers: &[WorkerView],
    cached: &HashMap<WorkerId, usize>,
    in_flight: &HashMap<WorkerId, u32>,
    policy: Policy,
) -> Plan {
    let (prefill, prefill_spare) = pick_prefill(workers.iter(), in_flight, policy.spread);
    // Every candidate is scored; only the best `ranked` are copied into the plan, so the
    // work per request is a score per engine, not a copy of each.
    let mut scored: Vec<(&WorkerStatus, usize, f64)> = if prefill.is_some() {
        decode_candidates(workers)
            .into_iter()
            .filter_map(|w| {
                let k = *cached.get(&w.worker_id)?;
                let load =
                    w.running + w.queue_depth + in_flight.get(&w.worker_id).copied().unwrap_or(0);
                let score = score(
                    k * w.block_tokens as usize,
                    load,
                    policy.load_penalty_tokens,
                );
                Some((w, k, score))
            })
            .collect()
    } else {
        Vec::new()
    };
    // Best score first; on a tie the engine with more free blocks (which spreads new prefixes
    // over the pools), then the lower id.
    let order = |a: &(&WorkerStatus, usize, f64), b: &(&WorkerStatus, usize, f64)| {
        b.2.total_cmp(&a.2)
            .then(b.0.free_blocks.cmp(&a.0.free_blocks))
            .then_with(|| a.0.worker_id.cmp(&b.0.worker_id))
    };
    let keep = policy.ranked.max(1);
    if scored.len() > keep {
        scored.select_nth_unstable_by(keep - 1, order);
        scored.truncate(keep);
    }
    scored.sort_by(order);
    let decode: Vec<Ranked> = scored
        .into_iter()
        .map(|(w, k, score)| Ranked {
            worker: w.clone(),
            cached_blocks: k,
            score,
            reason: if k > 0 {
                Reason::PrefixHit { blocks: k }
            } else {
                Reason::ByLoad
            },
        })
        .collect();
    let fallback = pick_colocated(
        colocated_candidates(workers),
        |id| cached.get(id).copied().unwrap_or(0),
        in_flight,
        policy,
    );
    Plan {
        prefill,
        prefill_spare,
        decode,
        fallback,
    }
}

/// A snapshot's workers arranged for routing many requests: the decode candidates in the order
/// [`plan_walk`] walks them (by the load they beat, then free blocks, then id). Built once per
/// snapshot, so a request's plan costs its prefix hits and a few engines, not the fleet.
#[derive(Debug)]
pub struct Fleet {
    /// The snapshot it was built from.
    pub snap: std::sync::Arc<[WorkerView]>,
    /// True when a usable prefill engine exists.
    prefills: bool,
    /// Decode candidates (indices into `snap`), in walking order.
    by_load: Vec<usize>,
    /// The candidates' block sizes, each once.
    pub block_sizes: Vec<u32>,
    /// The load penalty the walking order is for.
    penalty: f64,
}

impl Fleet {
    /// Arranges `snap` for plans with `load_penalty_tokens` = `penalty`.
    #[must_use]
    pub fn new(snap: std::sync::Arc<[WorkerView]>, penalty: f64) -> Self {
        let prefills = least_loaded(&snap, Role::Prefill).is_some();
        let mut by_load: Vec<usize> = (0..snap.len())
            .filter(|&i| {
                let w = &snap[i];
                w.is(Role::Decode) && w.usable() && w.kv_target().is_some()
            })
            .collect();
        // The order of the best score each can reach (its beat load's; without a penalty,
        // load does not count), then the plan's tie-breaks.
        let weigh = penalty > 0.0;
        by_load.sort_by(|&a, &b| {
            let (a, b) = (&snap[a].status, &snap[b].status);
            let load = |w: &WorkerStatus| if weigh { w.running + w.queue_depth } else { 0 };
            load(a)
                .cmp(&load(b))
                .then(b.free_blocks.cmp(&a.free_blocks))
                .then_with(|| a.worker_id.cmp(&b.worker_id))
        });
        let mut block_sizes: Vec<u32> = by_load
            .iter()
            .map(|&i| snap[i].status.block_tokens.max(1))
            .collect();
        block_sizes.sort_unstable();
        block_sizes.dedup();
        Self {
            snap,
            prefills,
            by_load,
            block_sizes,
            penalty,
        }
    }

    /// The decode candidates, in walking order.
    pub fn candidates(&self) -> impl Iterator<Item = &WorkerStatus> {
        self.by_load.iter().map(|&i| &self.snap[i].status)
    }
}

/// [`plan`] over a [`Fleet`] whose every decode candidate's prefix is known without asking:
/// `hits` lists the engines holding at least one leading block (and how many); every other
/// candidate holds none. Gives the same plan as [`plan`] with `cached` holding every
/// candidate (0 for those not in `hits`), but scores only the hits and walks the others in
/// load order until none left can beat the ranked ones, so its work does not grow with the
/// fleet.
#[must_use]
pub fn plan_walk(
    fleet: &Fleet,
    hits: &HashMap<&str, usize>,
    in_flight: &HashMap<WorkerId, u32>,
    policy: Policy,
) -> Plan {
    type Scored<'a> = (&'a WorkerStatus, usize, f64);
    let order = |a: &Scored<'_>, b: &Scored<'_>| {
        b.2.total_cmp(&a.2)
            .then(b.0.free_blocks.cmp(&a.0.free_blocks))
            .then_with(|| a.0.worker_id.cmp(&b.0.worker_id))
    };
    let keep = policy.ranked.max(1);
    if policy.load_penalty_tokens != fleet.penalty || fleet.penalty < 0.0 {
        // Not the order the fleet was arranged in: the full scan.
        let cached: HashMap<WorkerId, usize> = fleet
            .candidates()
            .map(|c| {
                let k = hits.get(c.worker_id.as_str()).copied().unwrap_or(0);
                (WorkerId::of(c), k)
            })
            .collect();
        return plan(&fleet.snap, &cached, in_flight, policy);
    }
    let mut best: Vec<Scored<'_>> = Vec::new();
    if fleet.prefills {
        let scored = |w: &'_ WorkerStatus, k: usize| -> f64 {
            let load =
                w.running + w.queue_depth + in_flight.get(&w.worker_id).copied().unwrap_or(0);
            score(
                k * w.block_tokens as usize,
                load,
                policy.load_penalty_tokens,
            )
        };
        for &i in &fleet.by_load {
            let w = &fleet.snap[i].status;
            if let Some(&k) = hits.get(w.worker_id.as_str())
                && k > 0
            {
                best.push((w, k, scored(w, k)));
            }
        }
        best.sort_by(order);
        best.truncate(keep);
        // The others, by the load they beat: none can score above its beat load's score, and
        // the walk's order is that bound's order, so it stops at the first that cannot rank.
        for &i in &fleet.by_load {
            let w = &fleet.snap[i].status;
            if hits.get(w.worker_id.as_str()).is_some_and(|&k| k > 0) {
                continue;
            }
            if best.len() >= keep {
                let bound = score(0, w.running + w.queue_depth, policy.load_penalty_tokens);
                let last = best[best.len() - 1];
                if order(&(w, 0, bound), &last) != std::cmp::Ordering::Less {
                    break;
                }
            }
            let candidate = (w, 0, scored(w, 0));
            let at = best.partition_point(|x| order(x, &candidate) == std::cmp::Ordering::Less);
            best.insert(at, candidate);
            best.truncate(keep);
        }
    }
    let (prefill, prefill_spare) = pick_prefill(fleet.snap.iter(), in_flight, policy.spread);
    Plan {
        prefill,
        prefill_spare,
        decode: best
            .into_iter()
            .map(|(w, k, score)| Ranked {
                worker: w.clone(),
                cached_blocks: k,
                score,
                reason: if k > 0 {
                    Reason::PrefixHit { blocks: k }
                } else {
                    Reason::ByLoad
                },
            })
            .collect(),
        fallback: pick_colocated(
            colocated_candidates(&fleet.snap),
            |id| hits.get(id).copied().unwrap_or(0),
            in_flight,
            policy,
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kvwire_grpc::pb::control::Role as PbRole;

    use super::*;

    const POLICY: Policy = Policy {
        load_penalty_tokens: 64.0,
        ranked: usize::MAX,
        spread: 0,
    };

    /// A worker: id, role, running sequences, free blocks; beating every 100 ms, 10 ms ago.
    fn w(id: &str, role: PbRole, running: u32, free: u32) -> WorkerView {
        WorkerView {
            status: WorkerStatus {
                worker_id: id.into(),
                role: role as i32,
                running,
                free_blocks: free,
                block_tokens: 4,
                heartbeat_ms: 100,
                kv_address: format!("{id}:kv"),
                http_address: format!("{id}:http"),
                grpc_address: format!("{id}:grpc"),
                model: "fake".into(),
                kv_format: 1,
                ..WorkerStatus::default()
            },
            age: Duration::from_millis(10),
        }
    }

    fn draining(mut v: WorkerView) -> WorkerView {
        v.status.draining = true;
        v
    }

    fn stale(mut v: WorkerView) -> WorkerView {
        v.age = Duration::from_millis(301);
        v
    }

    struct Case {
        name: &'static str,
        workers: Vec<WorkerView>,
        cached: &'static [(&'static str, usize)],
        in_flight: &'static [(&'static str, u32)],
        /// Expected prefill, decode order with reasons, fallback.
        prefill: Option<&'static str>,
        decode: &'static [(&'static str, Reason)],
        fallback: Option<&'static str>,
    }

    const P: PbRole = PbRole::Prefill;
    const D: PbRole = PbRole::Decode;
    const B: PbRole = PbRole::Both;

    #[test]
    fn route_plan_cases() {
        let cases = vec![
            Case {
                name: "the prefix holder wins over an idle engine",
                workers: vec![w("p", P, 0, 9), w("d1", D, 0, 10), w("d2", D, 0, 10)],
                cached: &[("d1", 0), ("d2", 32)],
                in_flight: &[],
                prefill: Some("p"),
                decode: &[
                    ("d2", Reason::PrefixHit { blocks: 32 }),
                    ("d1", Reason::ByLoad),
                ],
                fallback: None,
            },
            Case {
                // 32 blocks x 4 tokens = 128 = two sequences of load at 64 each: a tie, then
                // more free blocks wins.
                name: "a holder two sequences busier ties, and free blocks decide",
                workers: vec![w("p", P, 0, 9), w("d1", D, 0, 50), w("d2", D, 2, 10)],
                cached: &[("d1", 0), ("d2", 32)],
                in_flight: &[],
                prefill: Some("p"),
                decode: &[
                    ("d1", Reason::ByLoad),
                    ("d2", Reason::PrefixHit { blocks: 32 }),
                ],
                fallback: None,
            },
            Case {
                name: "a holder far more loaded (counting this gateway's in-flight) loses",
                workers: vec![w("p", P, 0, 9), w("d1", D, 0, 10), w("d2", D, 1, 10)],
                cached: &[("d1", 0), ("d2", 32)],
                in_flight: &[("d2", 2)],
                prefill: Some("p"),
                decode: &[
                    ("d1", Reason::ByLoad),
                    ("d2", Reason::PrefixHit { blocks: 32 }),
                ],
                fallback: None,
            },
            Case {
                name: "equal scores and free blocks: the lower id",
                workers: vec![w("p", P, 0, 9), w("d2", D, 0, 10), w("d1", D, 0, 10)],
                cached: &[("d1", 0), ("d2", 0)],
                in_flight: &[],
                prefill: Some("p"),
                decode: &[("d1", Reason::ByLoad), ("d2", Reason::ByLoad)],
                fallback: None,
            },
            Case {
                name: "draining and stale workers are skipped; the shortest queue prefills",
                workers: vec![
                    draining(w("d1", D, 0, 99)),
                    stale(w("d2", D, 0, 99)),
                    w("d3", D, 5, 1),
                    w("p1", P, 3, 9),
                    w("p2", P, 1, 9),
                    draining(w("p3", P, 0, 9)),
                ],
                cached: &[("d1", 9), ("d2", 9), ("d3", 0)],
                in_flight: &[],
                prefill: Some("p2"),
                decode: &[("d3", Reason::ByLoad)],
                fallback: None,
            },
            Case {
                name: "a decode engine that did not answer HasBlocks is left out",
                workers: vec![w("p", P, 0, 9), w("d1", D, 0, 10), w("d2", D, 0, 10)],
                cached: &[("d2", 1)],
                in_flight: &[],
                prefill: Some("p"),
                decode: &[("d2", Reason::PrefixHit { blocks: 1 })],
                fallback: None,
            },
            Case {
                name: "no decode engine: a both engine serves it colocated",
                workers: vec![w("p", P, 0, 9), w("b", B, 0, 9), draining(w("d", D, 0, 9))],
                cached: &[],
                in_flight: &[],
                prefill: Some("p"),
                decode: &[],
                fallback: Some("b"),
            },
            Case {
                name: "no prefill engine: no decode plan, the both engine",
                workers: vec![w("d", D, 0, 9), w("b2", B, 4, 9), w("b1", B, 1, 9)],
                cached: &[("d", 3)],
                in_flight: &[],
                prefill: None,
                decode: &[],
                fallback: Some("b1"),
            },
            Case {
                name: "nothing left",
                workers: vec![stale(w("p", P, 0, 9)), draining(w("b", B, 0, 9))],
                cached: &[],
                in_flight: &[],
                prefill: None,
                decode: &[],
                fallback: None,
            },
        ];
        for c in cases {
            let cached: HashMap<WorkerId, usize> = c
                .cached
                .iter()
                .map(|(k, v)| (WorkerId::new((*k).to_owned()), *v))
                .collect();
            let in_flight: HashMap<WorkerId, u32> = c
                .in_flight
                .iter()
                .map(|(k, v)| (WorkerId::new((*k).to_owned()), *v))
                .collect();
            let got = plan(&c.workers, &cached, &in_flight, POLICY);
            let id = |w: &Option<WorkerStatus>| w.as_ref().map(|w| w.worker_id.clone());
            assert_eq!(
                id(&got.prefill).as_deref(),
                c.prefill,
                "{}: prefill",
                c.name
            );
            let decode: Vec<(String, Reason)> = got
                .decode
                .iter()
                .map(|r| (r.worker.worker_id.clone(), r.reason))
                .collect();
            let want: Vec<(String, Reason)> =
                c.decode.iter().map(|(k, r)| ((*k).into(), *r)).collect();
            assert_eq!(decode, want, "{}: decode", c.name);
            assert_eq!(
                id(&got.fallback).as_deref(),
                c.fallback,
                "{}: fallback",
                c.name
            );
            assert_eq!(
                got.is_empty(),
                c.fallback.is_none() && c.decode.is_empty(),
                "{}",
                c.name
            );
        }
        assert_eq!(
            Reason::PrefixHit { blocks: 3 }.to_string(),
            "prefix hit: 3 blocks cached"
        );
    }

    /// The walk over a [`Fleet`] plans as [`plan`] does with every candidate's prefix known,
    /// over random fleets: loads, free blocks, this gateway's in-flight counts and prefix hits,
    /// with many ties (small ranges), and every ranking depth.
    #[test]
    fn the_walk_plans_as_the_full_scan_does() {
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        for case in 0..2_000 {
            let n = 1 + next(12) as usize;
            let mut workers = vec![w("P", PbRole::Prefill, next(3) as u32, 10)];
            if next(2) == 0 {
                workers.push(w("B", PbRole::Both, 0, 10));
            }
            let mut hits_owned: Vec<(String, usize)> = Vec::new();
            let mut in_flight: HashMap<WorkerId, u32> = HashMap::new();
            for i in 0..n {
                let id = format!("D{i:02}");
                let mut v = w(&id, PbRole::Decode, next(4) as u32, next(3) as u32);
                v.status.queue_depth = next(2) as u32;
                if next(5) == 0 {
                    v = draining(v);
                }
                if next(3) == 0 {
                    hits_owned.push((id.clone(), 1 + next(40) as usize));
                }
                if next(3) == 0 {
                    in_flight.insert(WorkerId::new(id.clone()), next(3) as u32);
                }
                workers.push(v);
            }
            workers.sort_by(|a, b| a.status.worker_id.cmp(&b.status.worker_id));
            let hits: HashMap<&str, usize> =
                hits_owned.iter().map(|(id, k)| (id.as_str(), *k)).collect();
            let policy = Policy {
                load_penalty_tokens: [0.0, 4.0, 64.0][next(3) as usize],
                ranked: 1 + next(5) as usize,
                spread: next(7),
            };
            let fleet = Fleet::new(workers.clone().into(), policy.load_penalty_tokens);
            let cached: HashMap<WorkerId, usize> = fleet
                .candidates()
                .map(|c| {
                    let k = hits.get(c.worker_id.as_str()).copied().unwrap_or(0);
                    (WorkerId::of(c), k)
                })
                .collect();
            let full = plan(&workers, &cached, &in_flight, policy);
            let walked = plan_walk(&fleet, &hits, &in_flight, policy);
            assert_eq!(walked, full, "case {case}");
        }
    }

    /// Colocated requests over equal `both` engines spread over them; one this gateway already
    /// sent a request to, or that holds less of the prompt, is passed over.
    #[test]
    fn colocated_requests_spread_over_equal_both_engines() {
        let workers = vec![
            w("B1", PbRole::Both, 0, 10),
            w("B2", PbRole::Both, 0, 10),
            w("B3", PbRole::Both, 0, 10),
        ];
        let mut got: HashMap<WorkerId, u32> = HashMap::new();
        for spread in 0..30 {
            let policy = Policy { spread, ..POLICY };
            let p = plan(&workers, &HashMap::new(), &HashMap::new(), policy);
            *got.entry(WorkerId::of(&p.fallback.unwrap())).or_default() += 1;
        }
        assert_eq!(
            got.values().copied().collect::<Vec<_>>(),
            [10, 10, 10],
            "{got:?}"
        );
        // B1 has a request of this gateway in flight: the others take the next ones.
        let in_flight = HashMap::from([(WorkerId::new("B1".into()), 1)]);
        for spread in 0..6 {
            let policy = Policy { spread, ..POLICY };
            let p = plan(&workers, &HashMap::new(), &in_flight, policy);
            assert_ne!(p.fallback.unwrap().worker_id, "B1");
        }
        // B3 holds 40 blocks of the prompt (160 tokens): worth more than 2 sequences of load.
        let cached = HashMap::from([(WorkerId::new("B3".into()), 40)]);
        let in_flight = HashMap::from([(WorkerId::new("B3".into()), 2)]);
        let p = plan(&workers, &cached, &in_flight, POLICY);
        assert_eq!(p.fallback.unwrap().worker_id, "B3");
    }

    /// Prefill engines tied on load share the requests, stepped by `spread` one or two at a
    /// time; one with a Prefill of this gateway in flight, or a longer queue at its beat, is
    /// passed over; the spare is another engine; an engine serving as decode now (its role
    /// changed) is neither.
    #[test]
    fn prefill_engines_share_a_burst_and_follow_role_changes() {
        let mut workers = vec![
            w("P1", PbRole::Prefill, 0, 10),
            w("P2", PbRole::Prefill, 0, 10),
            w("D1", PbRole::Decode, 0, 10),
        ];
        let cached = HashMap::from([(WorkerId::new("D1".into()), 0)]);
        for step in [1, 2] {
            let mut got: HashMap<WorkerId, u32> = HashMap::new();
            for spread in (0..400).step_by(step) {
                let policy = Policy { spread, ..POLICY };
                let p = plan(&workers, &cached, &HashMap::new(), policy);
                let (a, b) = (p.prefill.unwrap(), p.prefill_spare.unwrap());
                assert_ne!(a.worker_id, b.worker_id);
                *got.entry(WorkerId::of(&a)).or_default() += 1;
            }
            let n = 400 / step as u32;
            for id in ["P1", "P2"] {
                let k = got.get(id).copied().unwrap_or(0);
                assert!(k > n / 4 && k < 3 * n / 4, "step {step}: {got:?}");
            }
        }
        let busy = HashMap::from([(WorkerId::new("P1".into()), 1)]);
        for spread in 0..8 {
            let p = plan(&workers, &cached, &busy, Policy { spread, ..POLICY });
            assert_eq!(p.prefill.unwrap().worker_id, "P2");
            assert_eq!(p.prefill_spare.unwrap().worker_id, "P1");
        }
        workers[1].status.queue_depth = 2;
        for spread in 0..8 {
            let p = plan(
                &workers,
                &cached,
                &HashMap::new(),
                Policy { spread, ..POLICY },
            );
            assert_eq!(p.prefill.unwrap().worker_id, "P1");
        }
        // P1 is a both engine serving as decode now: P2 prefills, with no spare, and P1 is a
        // decode candidate.
        workers[0].status.role = PbRole::Both as i32;
        workers[0].status.serving = PbRole::Decode as i32;
        let p = plan(&workers, &cached, &HashMap::new(), POLICY);
        assert_eq!(p.prefill.unwrap().worker_id, "P2");
        assert!(p.prefill_spare.is_none());
        assert!(
            decode_candidates(&workers)
                .iter()
                .any(|c| c.worker_id == "P1")
        );
        assert!(
            p.fallback.is_none(),
            "a both engine serving as decode is no fallback"
        );
    }
}
