//! The role planner (`[planner]`, off by default): moves engines of role both between prefill
//! and decode at run time, from prefill queueing against decode load, as Dynamo's planner and
//! vLLM's runtime P/D switching do. The policy is a pure function of the registry's snapshot
//! and the time ([`Planner::tick`]); the gateway's loop ([`run`]) performs what it decides with
//! EngineControl.SetRole, and the engines' next beats tell every registry.
//!
//! Signals, each smoothed over the ticks (an exponentially weighted mean):
//! - prefill pressure: Prefill calls waiting or running per engine serving as prefill (the
//!   `queue_depth` each beats);
//! - decode load: sequences running per engine serving as decode.
//!
//! Moves, at most one per `cooldown_ms`, only of engines configured `both`:
//! - decode -> prefill, when prefill pressure is at least `prefill_queue_high`, at least two
//!   engines decode, and the decode load spread over one engine fewer stays below
//!   `decode_running_high`; the decode engine with the fewest running sequences moves (it has
//!   the least to finish);
//! - prefill -> decode, when decode load is at least `decode_running_high`, at least two
//!   engines prefill, and the prefill pressure over one engine fewer stays at most
//!   `prefill_queue_low`; the prefill engine with the shortest queue moves.
//!
//! The hysteresis between the high and low marks, and the projection of the other side's load
//! after the move, keep one move from calling for its reverse. With several gateways, enable it
//! on one: each planner acts on what it sees, and two would compete.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvwire_grpc::pb::control::WorkerStatus;

use super::state::Gateway;
use super::worker::WorkerView;
use crate::net::role::Role;

pub use super::config::PlannerSection;

/// One role change the planner decided.
#[derive(Clone, Debug, PartialEq)]
pub struct Move {
    /// The engine.
    pub worker: WorkerStatus,
    /// The role it serves in from now on.
    pub to: Role,
    /// The smoothed prefill pressure and decode load that called for it.
    pub prefill_queue: f64,
    /// See `prefill_queue`.
    pub decode_running: f64,
}

/// The planner's memory: the smoothed signals and the time of the last move.
#[derive(Debug)]
pub struct Planner {
    cfg: PlannerSection,
    prefill_queue: Option<f64>,
    decode_running: Option<f64>,
    /// The last move, or the first tick: signals are watched for a cooldown before the first
    /// move too, so a start's transient (decode engines still empty, a burst queued on
    /// prefill) moves nothing.
    last_move: Option<Instant>,
}

impl Planner {
    /// A planner with these marks and nothing seen yet.
    #[must_use]
    pub fn new(cfg: PlannerSection) -> Self {
        Self {
            cfg,
            prefill_queue: None,
            decode_running: None,
            last_move: None,
        }
    }

    /// The smoothed signals: (prefill calls per prefill engine, running sequences per decode
    /// engine), once a tick saw both roles.
    #[must_use]
    pub fn signals(&self) -> Option<(f64, f64)> {
        Some((self.prefill_queue?, self.decode_running?))
    }

    /// Looks at `workers` at `now` and decides at most one move.
    pub fn tick(&mut self, workers: &[WorkerView], now: Instant) -> Option<Move> {
        let usable =
            |w: &&WorkerView| !w.status.draining && !super::worker::is_stale(&w.status, w.age);
        let serving = |r: Role| {
            workers
                .iter()
                .filter(usable)
                .filter(move |w| w.role() == Some(r))
                .collect::<Vec<_>>()
        };
        let (prefills, decodes) = (serving(Role::Prefill), serving(Role::Decode));
        if prefills.is_empty() || decodes.is_empty() {
            return None;
        }
        let mean = |v: &[&WorkerView], f: fn(&WorkerStatus) -> u32| {
            v.iter().map(|w| f64::from(f(&w.status))).sum::<f64>() / v.len() as f64
        };
        let a = self.cfg.smoothing;
        let ewma = |old: Option<f64>, x: f64| old.map_or(x, |o| o + a * (x - o));
        let q = ewma(self.prefill_queue, mean(&prefills, |s| s.queue_depth));
        let r = ewma(
            self.decode_running,
            mean(&decodes, |s| s.running + s.queue_depth),
        );
        self.prefill_queue = Some(q);
        self.decode_running = Some(r);
        let since = *self.last_move.get_or_insert(now);
        let cooled = now.duration_since(since) >= Duration::from_millis(self.cfg.cooldown_ms);
        if !cooled {
            return None;
        }
        let movable = |v: &[&WorkerView], load: fn(&WorkerStatus) -> u32| {
            v.iter()
                .filter(|w| Role::from_wire(w.status.role) == Some(Role::Both))
                .min_by(|x, y| {
                    load(&x.status)
                        .cmp(&load(&y.status))
                        .then_with(|| x.status.worker_id.cmp(&y.status.worker_id))
                })
                .map(|w| w.status.clone())
        };
        let (np, nd) = (prefills.len() as f64, decodes.len() as f64);
        let chosen = if q >= self.cfg.prefill_queue_high
            && decodes.len() >= 2
            && r * nd / (nd - 1.0) < self.cfg.decode_running_high
        {
            movable(&decodes, |s| s.running + s.queue_depth).map(|w| (w, Role::Prefill))
        } else if r >= self.cfg.decode_running_high
            && prefills.len() >= 2
            && q * np / (np - 1.0) <= self.cfg.prefill_queue_low
        {
            movable(&prefills, |s| s.queue_depth).map(|w| (w, Role::Decode))
        } else {
            None
        };
        let (worker, to) = chosen?;
        self.last_move = Some(now);
        Some(Move {
            worker,
            to,
            prefill_queue: q,
            decode_running: r,
        })
    }
}

/// The gateway's planner loop: every `interval_ms`, a tick over the registry's snapshot, and
/// SetRole for what it decides (not waiting for the old role's work: the engine finishes it
/// by itself). Ends when the gateway stops.
pub(super) async fn run(
    g: Arc<Gateway>,
    cfg: PlannerSection,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut planner = Planner::new(cfg.clone());
    let mut every = tokio::time::interval(Duration::from_millis(cfg.interval_ms.max(1)));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            () = stop.cancelled() => return,
        }
        let snap = g.registry.snapshot(Instant::now());
        let Some(m) = planner.tick(&snap, Instant::now()) else {
            continue;
        };
        let from = super::worker::serving_role(&m.worker).map_or("unspecified", Role::name);
        let answer = match g.upstream.control(&m.worker.grpc_address) {
            Ok(ctl) => tokio::time::timeout(Duration::from_secs(2), ctl.set_role(m.to, 0))
                .await
                .map_err(|_| tonic::Status::deadline_exceeded("SetRole took over 2 s"))
                .and_then(|r| r),
            Err(e) => Err(tonic::Status::unavailable(e.to_string())),
        };
        let outcome = if answer.is_ok() {
            crate::telemetry::metrics::ChangeOutcome::Ok
        } else {
            crate::telemetry::metrics::ChangeOutcome::Failed
        };
        g.metrics
            .role_changes
            .get_or_create(&crate::telemetry::metrics::RoleChange {
                from,
                to: m.to.name(),
                outcome,
            })
            .inc();
        match answer {
            Ok(_) => tracing::info!(
                worker = m.worker.worker_id,
                from,
                to = m.to.name(),
                prefill_queue = m.prefill_queue,
                decode_running = m.decode_running,
                "planner moved an engine"
            ),
            Err(e) => tracing::warn!(
                worker = m.worker.worker_id,
                to = m.to.name(),
                error = %e,
                "planner could not move an engine"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use kvwire_grpc::pb::control::Role as PbRole;

    use super::*;

    fn w(id: &str, role: PbRole, serving: PbRole, queue: u32, running: u32) -> WorkerView {
        WorkerView {
            status: WorkerStatus {
                worker_id: id.into(),
                role: role as i32,
                serving: serving as i32,
                queue_depth: queue,
                running,
                heartbeat_ms: 100,
                ..WorkerStatus::default()
            },
            age: Duration::from_millis(10),
        }
    }

    /// A fresh planner's decision on `workers` once its first cooldown (3 s) has passed, having
    /// seen them at the start too.
    fn decide(workers: &[WorkerView], t0: Instant) -> Option<Move> {
        let mut p = Planner::new(cfg());
        assert!(p.tick(workers, t0).is_none(), "a move at the first tick");
        p.tick(workers, t0 + Duration::from_secs(3))
    }

    fn cfg() -> PlannerSection {
        PlannerSection {
            enabled: true,
            smoothing: 1.0,
            ..PlannerSection::default()
        }
    }

    #[test]
    fn a_prefill_queue_moves_the_idlest_both_decode_engine_and_the_cooldown_holds_the_next() {
        let mut p = Planner::new(cfg());
        let t0 = Instant::now();
        let workers = [
            w("P", PbRole::Prefill, PbRole::Prefill, 5, 1),
            w("D1", PbRole::Decode, PbRole::Decode, 0, 4),
            w("X1", PbRole::Both, PbRole::Decode, 0, 6),
            w("X2", PbRole::Both, PbRole::Decode, 0, 3),
        ];
        // The first cooldown only watches: nothing moves at the start.
        assert!(p.tick(&workers, t0).is_none());
        let t0 = t0 + Duration::from_millis(3_000);
        let m = p.tick(&workers, t0).unwrap();
        // D1 has the fewest sequences but is configured decode: X2 moves.
        assert_eq!((m.worker.worker_id.as_str(), m.to), ("X2", Role::Prefill));
        assert_eq!(p.signals(), Some((5.0, 13.0 / 3.0)));
        // Within the cooldown, nothing more; after it, the next.
        assert!(
            p.tick(&workers, t0 + Duration::from_millis(2_999))
                .is_none()
        );
        let m = p.tick(&workers, t0 + Duration::from_millis(3_000)).unwrap();
        assert_eq!(m.worker.worker_id, "X2");
    }

    #[test]
    fn no_move_that_would_overload_the_other_side_or_leave_a_role_empty() {
        let t0 = Instant::now();
        // Decode over two engines fewer would be 2 x 20 = 40 >= 32: no move.
        let busy = [
            w("P", PbRole::Prefill, PbRole::Prefill, 9, 1),
            w("X1", PbRole::Both, PbRole::Decode, 0, 20),
            w("X2", PbRole::Both, PbRole::Decode, 0, 20),
        ];
        assert!(decide(&busy, t0).is_none());
        // One decode engine: never moved, however long the prefill queue.
        let one = [
            w("P", PbRole::Prefill, PbRole::Prefill, 9, 1),
            w("X1", PbRole::Both, PbRole::Decode, 0, 0),
        ];
        assert!(decide(&one, t0).is_none());
        // Draining and stale engines count for nothing.
        let mut gone = w("X2", PbRole::Both, PbRole::Decode, 0, 0);
        gone.status.draining = true;
        let mut stale = w("X3", PbRole::Both, PbRole::Decode, 0, 0);
        stale.age = Duration::from_secs(1);
        assert!(
            Planner::new(cfg())
                .tick(&[one[0].clone(), one[1].clone(), gone, stale], t0)
                .is_none()
        );
        // No engine of role both: nothing can move.
        let fixed = [
            w("P", PbRole::Prefill, PbRole::Prefill, 9, 1),
            w("D1", PbRole::Decode, PbRole::Decode, 0, 0),
            w("D2", PbRole::Decode, PbRole::Decode, 0, 0),
        ];
        assert!(decide(&fixed, t0).is_none());
    }

    #[test]
    fn decode_load_moves_a_quiet_prefill_engine_back_and_hysteresis_holds_between_marks() {
        let t0 = Instant::now();
        let loaded = [
            w("P", PbRole::Prefill, PbRole::Prefill, 0, 0),
            w("X1", PbRole::Both, PbRole::Prefill, 1, 0),
            w("D1", PbRole::Decode, PbRole::Decode, 0, 40),
        ];
        let m = decide(&loaded, t0).unwrap();
        // P is configured prefill; X1 moves although its queue is longer.
        assert_eq!((m.worker.worker_id.as_str(), m.to), ("X1", Role::Decode));
        // Prefill over one engine fewer would be 2 x 1 = 2 > 1 (the low mark): it stays.
        let queued = [
            w("P", PbRole::Prefill, PbRole::Prefill, 1, 0),
            w("X1", PbRole::Both, PbRole::Prefill, 1, 0),
            w("D1", PbRole::Decode, PbRole::Decode, 0, 40),
        ];
        assert!(decide(&queued, t0).is_none());
        // Between the marks on both sides: nothing.
        let calm = [
            w("P", PbRole::Prefill, PbRole::Prefill, 2, 0),
            w("X1", PbRole::Both, PbRole::Decode, 0, 10),
            w("D1", PbRole::Decode, PbRole::Decode, 0, 10),
        ];
        assert!(decide(&calm, t0).is_none());
    }

    #[test]
    fn smoothing_lets_one_spike_pass() {
        let t0 = Instant::now();
        let mut p = Planner::new(PlannerSection {
            smoothing: 0.3,
            ..cfg()
        });
        let quiet = [
            w("P", PbRole::Prefill, PbRole::Prefill, 0, 0),
            w("X1", PbRole::Both, PbRole::Decode, 0, 2),
            w("X2", PbRole::Both, PbRole::Decode, 0, 2),
        ];
        let mut spike = quiet.clone();
        spike[0].status.queue_depth = 6;
        assert!(p.tick(&quiet, t0).is_none());
        let t0 = t0 + Duration::from_secs(3);
        assert!(p.tick(&quiet, t0).is_none());
        // 0 + 0.3 x 6 = 1.8 < 3: one spike moves nothing; a sustained queue does.
        assert!(p.tick(&spike, t0).is_none());
        let moved = (0..5).find_map(|_| p.tick(&spike, t0));
        assert_eq!(moved.map(|m| m.to), Some(Role::Prefill));
    }

    #[test]
    fn bad_marks_are_refused() {
        assert!(PlannerSection::default().validate().is_ok());
        for bad in [
            PlannerSection {
                smoothing: 0.0,
                ..PlannerSection::default()
            },
            PlannerSection {
                smoothing: 1.5,
                ..PlannerSection::default()
            },
            PlannerSection {
                interval_ms: 0,
                ..PlannerSection::default()
            },
            PlannerSection {
                prefill_queue_low: 3.0,
                ..PlannerSection::default()
            },
            PlannerSection {
                decode_running_high: f64::NAN,
                ..PlannerSection::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
