//! Micro-batch schedules, as the driver issues them: GPipe (fill, then drain: every forward,
//! then every backward) and 1F1B (after a warm-up of one forward per stage, each backward lets
//! the next forward in, so at most `stages` micro-batches hold activations at once).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Schedule {
    GPipe,
    OneFOneB,
    /// PipeDream's asynchronous 1F1B with weight stashing: the 1F1B order, but every
    /// micro-batch is its own step (its own context, an optimizer step at each stage as soon
    /// as its backward is done) instead of one step per mini-batch. See
    /// [`crate::Pipeline::train_step`] for the staleness it brings.
    AsyncOneFOneB,
}

impl std::str::FromStr for Schedule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "gpipe" => Ok(Schedule::GPipe),
            "1f1b" => Ok(Schedule::OneFOneB),
            "async-1f1b" | "pipedream" => Ok(Schedule::AsyncOneFOneB),
            other => Err(format!("unknown schedule {other:?} (gpipe, 1f1b, async-1f1b)")),
        }
    }
}

/// One step of the driver's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Start micro-batch `m`'s forward through every stage.
    Forward(usize),
    /// Run micro-batch `m`'s backward (waits for its forward).
    Backward(usize),
}

/// The idle fraction of an ideal pipeline of equal stages: (p − 1) / (m + p − 1).
pub fn theoretical_bubble(stages: usize, micro_batches: usize) -> f64 {
    let (p, m) = (stages as f64, micro_batches as f64);
    (p - 1.0) / (m + p - 1.0)
}

/// The order the driver issues forwards and backwards in.
pub fn driver_order(schedule: Schedule, stages: usize, micro_batches: usize) -> Vec<Op> {
    let m = micro_batches;
    match schedule {
        Schedule::GPipe => (0..m).map(Op::Forward).chain((0..m).map(Op::Backward)).collect(),
        Schedule::OneFOneB | Schedule::AsyncOneFOneB => {
            let warm = stages.min(m);
            let mut ops: Vec<Op> = (0..warm).map(Op::Forward).collect();
            for b in 0..m {
                ops.push(Op::Backward(b));
                if b + warm < m {
                    ops.push(Op::Forward(b + warm));
                }
            }
            ops
        }
    }
}

/// The most micro-batches whose activations are alive at once under `schedule`.
pub fn peak_in_flight(schedule: Schedule, stages: usize, micro_batches: usize) -> usize {
    let mut live = 0usize;
    let mut peak = 0;
    for op in driver_order(schedule, stages, micro_batches) {
        match op {
            Op::Forward(_) => live += 1,
            Op::Backward(_) => live -= 1,
        }
        peak = peak.max(live);
    }
    peak
}

/// Under [`Schedule::AsyncOneFOneB`]: the weight version each micro-batch's forward runs on
/// (the number of updates made before the driver issued it) and its staleness (how many
/// updates its gradient lands behind: the updates made between its forward and its own).
/// In the steady state every micro-batch is `stages − 1` updates stale, on every stage: the
/// driver steps all stages together and each forward runs on one version throughout (the
/// stages keep, "stash", every version an in-flight forward still needs).
pub fn async_versions(stages: usize, micro_batches: usize) -> Vec<(u64, u64)> {
    let mut done = 0u64;
    let mut version = vec![0u64; micro_batches];
    let mut out = vec![(0, 0); micro_batches];
    for op in driver_order(Schedule::AsyncOneFOneB, stages, micro_batches) {
        match op {
            Op::Forward(m) => version[m] = done,
            Op::Backward(m) => {
                out[m] = (version[m], done - version[m]);
                done += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_micro_batch_runs_forward_then_backward_once() {
        for schedule in [Schedule::GPipe, Schedule::OneFOneB, Schedule::AsyncOneFOneB] {
            for (p, m) in [(4, 1), (4, 4), (4, 8), (4, 16), (2, 3), (1, 5)] {
                let ops = driver_order(schedule, p, m);
                assert_eq!(ops.len(), 2 * m);
                for k in 0..m {
                    let f = ops.iter().position(|&o| o == Op::Forward(k)).unwrap();
                    let b = ops.iter().position(|&o| o == Op::Backward(k)).unwrap();
                    assert!(f < b, "{schedule:?} p={p} m={m}: backward {k} before its forward");
                }
            }
        }
    }

    #[test]
    fn asynchronous_1f1b_is_stages_minus_one_updates_stale() {
        let v = async_versions(4, 8);
        assert_eq!(v.iter().map(|x| x.0).collect::<Vec<_>>(), [0, 0, 0, 0, 1, 2, 3, 4]);
        assert_eq!(v.iter().map(|x| x.1).collect::<Vec<_>>(), [0, 1, 2, 3, 3, 3, 3, 3]);
        assert!(
            async_versions(1, 5).iter().all(|&(_, stale)| stale == 0),
            "one stage: no staleness"
        );
        assert_eq!(async_versions(4, 2), vec![(0, 0), (0, 1)]);
    }

    #[test]
    fn one_f_one_b_bounds_what_is_in_flight() {
        assert_eq!(peak_in_flight(Schedule::GPipe, 4, 16), 16);
        assert_eq!(peak_in_flight(Schedule::OneFOneB, 4, 16), 4);
        assert_eq!(peak_in_flight(Schedule::OneFOneB, 4, 2), 2);
    }

    #[test]
    fn bubble_formula() {
        assert!((theoretical_bubble(4, 4) - 3.0 / 7.0).abs() < 1e-12);
        assert!((theoretical_bubble(4, 16) - 3.0 / 19.0).abs() < 1e-12);
        assert_eq!(theoretical_bubble(1, 8), 0.0);
    }
}
