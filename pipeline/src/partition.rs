//! Splitting a sequential model into contiguous stages: by hints (layers per stage, relative
//! weights) or from a profile, choosing the cut that minimises the slowest stage under each
//! stage's memory limit (dynamic programming, checked against exhaustive search).

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

/// What one layer costs on its target, measured (see [`crate::profile`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LayerCost {
    /// Seconds per micro-batch, forward and backward.
    pub forward: f64,
    pub backward: f64,
    /// Parameters (bytes); a stage holds them with their gradients and optimizer state (×3).
    pub param_bytes: u64,
    /// Activations kept per micro-batch in flight (bytes).
    pub activation_bytes: u64,
}

/// Contiguous stages over layers `0..n`, with each stage's predicted time per micro-batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Partition {
    pub stages: Vec<Range<usize>>,
    /// Forward + backward seconds per micro-batch, per stage (empty for hint partitions made
    /// without costs).
    pub predicted: Vec<f64>,
}

impl Partition {
    /// The slowest stage's predicted time.
    pub fn bottleneck(&self) -> f64 {
        self.predicted.iter().copied().fold(0.0, f64::max)
    }

    fn with_costs(stages: Vec<Range<usize>>, costs: Option<&[LayerCost]>) -> Partition {
        let predicted = costs.map_or_else(Vec::new, |c| stages.iter().map(|r| stage_time(c, r.clone())).collect());
        Partition { stages, predicted }
    }
}

impl fmt::Display for Partition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.stages.iter().enumerate() {
            write!(f, "stage {i}: layers {}..{}", r.start, r.end)?;
            if let Some(t) = self.predicted.get(i) {
                write!(f, ", predicted {:.3} ms per micro-batch", t * 1e3)?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PartitionError {
    #[error("{layers} layers cannot make {stages} non-empty stages")]
    TooFewLayers { layers: usize, stages: usize },
    #[error("hints cover {covered} layers of {layers}")]
    Hints { covered: usize, layers: usize },
    #[error("no contiguous partition fits the memory limits (the smallest needs {need} bytes on one stage)")]
    Memory { need: u64 },
    #[error("bad weights: {0}")]
    Weights(String),
}

/// Forward + backward seconds of layers `r`.
pub fn stage_time(costs: &[LayerCost], r: Range<usize>) -> f64 {
    costs[r].iter().map(|c| c.forward + c.backward).sum()
}

/// Bytes a stage over layers `r` holds with `in_flight` micro-batches' activations kept.
pub fn stage_memory(costs: &[LayerCost], r: Range<usize>, in_flight: usize) -> u64 {
    costs[r]
        .iter()
        .map(|c| 3 * c.param_bytes + c.activation_bytes * in_flight as u64)
        .sum()
}

/// Stages of `counts[i]` layers each.
pub fn by_counts(layers: usize, counts: &[usize]) -> Result<Partition, PartitionError> {
    let covered: usize = counts.iter().sum();
    if covered != layers || counts.contains(&0) {
        return Err(PartitionError::Hints { covered, layers });
    }
    let mut start = 0;
    let stages = counts
        .iter()
        .map(|&n| {
            start += n;
            start - n..start
        })
        .collect();
    Ok(Partition::with_costs(stages, None))
}

/// Stages whose shares of the layers follow `weights` (rounded, each at least one layer).
pub fn by_weights(layers: usize, weights: &[f64]) -> Result<Partition, PartitionError> {
    let k = weights.len();
    if k == 0 || k > layers {
        return Err(PartitionError::TooFewLayers { layers, stages: k });
    }
    if weights.iter().any(|w| !w.is_finite() || *w <= 0.0) {
        return Err(PartitionError::Weights(format!("{weights:?} (each must be positive)")));
    }
    let total: f64 = weights.iter().sum();
    let mut cuts = Vec::with_capacity(k + 1);
    cuts.push(0usize);
    let mut acc = 0.0;
    for (i, w) in weights.iter().enumerate().take(k - 1) {
        acc += w;
        let ideal = (acc / total * layers as f64).round() as usize;
        // At least one layer for this stage and for each after it.
        let lo = cuts[i] + 1;
        let hi = layers - (k - 1 - i);
        cuts.push(ideal.clamp(lo, hi));
    }
    cuts.push(layers);
    Ok(Partition::with_costs(
        cuts.windows(2).map(|w| w[0]..w[1]).collect(),
        None,
    ))
}

/// The contiguous partition into `limits.len()` stages that minimises the slowest stage's
/// time, each stage within its memory limit with `in_flight` micro-batches in flight (dynamic
/// programming over cut points: O(stages × layers²)).
pub fn auto(costs: &[LayerCost], limits: &[u64], in_flight: usize) -> Result<Partition, PartitionError> {
    let (n, k) = (costs.len(), limits.len());
    if k == 0 || k > n {
        return Err(PartitionError::TooFewLayers { layers: n, stages: k });
    }
    // best[s][i]: the smallest bottleneck placing layers 0..i on stages 0..s (s+1 stages).
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; n + 1]; k];
    let mut cut = vec![vec![0usize; n + 1]; k];
    for (i, b) in best[0].iter_mut().enumerate().skip(1) {
        if stage_memory(costs, 0..i, in_flight) <= limits[0] {
            *b = stage_time(costs, 0..i);
        }
    }
    for s in 1..k {
        for i in s + 1..=n {
            for j in s..i {
                if best[s - 1][j] == inf || stage_memory(costs, j..i, in_flight) > limits[s] {
                    continue;
                }
                let t = best[s - 1][j].max(stage_time(costs, j..i));
                if t < best[s][i] {
                    best[s][i] = t;
                    cut[s][i] = j;
                }
            }
        }
    }
    if best[k - 1][n] == inf {
        let need = (0..n)
            .map(|l| stage_memory(costs, l..l + 1, in_flight))
            .max()
            .unwrap_or(0);
        return Err(PartitionError::Memory { need });
    }
    let mut stages = Vec::with_capacity(k);
    let mut end = n;
    for s in (0..k).rev() {
        let start = if s == 0 { 0 } else { cut[s][end] };
        stages.push(start..end);
        end = start;
    }
    stages.reverse();
    Ok(Partition::with_costs(stages, Some(costs)))
}

/// The best contiguous partition by trying every one (for checking [`auto`]; exponential).
pub fn exhaustive(costs: &[LayerCost], limits: &[u64], in_flight: usize) -> Option<Partition> {
    let (n, k) = (costs.len(), limits.len());
    if k == 0 || k > n {
        return None;
    }
    let mut best: Option<Partition> = None;
    let mut cuts = vec![0usize; k + 1];
    cuts[k] = n;
    fn walk(
        s: usize,
        cuts: &mut Vec<usize>,
        costs: &[LayerCost],
        limits: &[u64],
        in_flight: usize,
        best: &mut Option<Partition>,
    ) {
        let k = limits.len();
        if s == k {
            let stages: Vec<Range<usize>> = cuts.windows(2).map(|w| w[0]..w[1]).collect();
            if stages
                .iter()
                .zip(limits)
                .any(|(r, &l)| stage_memory(costs, r.clone(), in_flight) > l)
            {
                return;
            }
            let p = Partition::with_costs(stages, Some(costs));
            if best.as_ref().is_none_or(|b| p.bottleneck() < b.bottleneck()) {
                *best = Some(p);
            }
            return;
        }
        if s == k - 1 {
            walk(s + 1, cuts, costs, limits, in_flight, best);
            return;
        }
        for end in cuts[s] + 1..=costs.len() - (k - 1 - s) {
            cuts[s + 1] = end;
            walk(s + 1, cuts, costs, limits, in_flight, best);
        }
    }
    walk(0, &mut cuts, costs, limits, in_flight, &mut best);
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cost(t: f64, mem: u64) -> LayerCost {
        LayerCost {
            forward: t / 3.0,
            backward: 2.0 * t / 3.0,
            param_bytes: mem,
            activation_bytes: mem,
        }
    }

    #[test]
    fn hints_by_count_and_weight() {
        assert_eq!(by_counts(6, &[1, 2, 3]).unwrap().stages, vec![0..1, 1..3, 3..6]);
        assert!(by_counts(6, &[1, 2]).is_err());
        assert!(by_counts(3, &[1, 0, 2]).is_err());
        assert_eq!(by_weights(8, &[1.0, 1.0, 2.0]).unwrap().stages, vec![0..2, 2..4, 4..8]);
        // Every stage gets a layer even when its weight rounds to nothing.
        assert_eq!(
            by_weights(3, &[100.0, 0.001, 0.001]).unwrap().stages,
            vec![0..1, 1..2, 2..3]
        );
        assert!(by_weights(2, &[1.0, 1.0, 1.0]).is_err());
        assert!(by_weights(4, &[1.0, -1.0]).is_err());
    }

    #[test]
    fn auto_balances_the_slowest_stage() {
        let costs: Vec<LayerCost> = [1.0, 1.0, 1.0, 6.0, 1.0, 1.0, 1.0, 1.0]
            .iter()
            .map(|&t| cost(t, 10))
            .collect();
        let p = auto(&costs, &[u64::MAX; 3], 1).unwrap();
        assert_eq!(p.stages, vec![0..3, 3..4, 4..8]);
        assert_eq!(p.bottleneck(), 6.0);
        println!("{p}");
    }

    #[test]
    fn auto_respects_memory_limits() {
        let costs: Vec<LayerCost> = (0..6).map(|_| cost(1.0, 100)).collect();
        // Stage 0 may hold one layer only (4 × 100 bytes per layer with 1 in flight).
        let p = auto(&costs, &[400, 10_000, 10_000], 1).unwrap();
        assert_eq!(p.stages[0], 0..1);
        assert!(matches!(
            auto(&costs, &[300, 300, 300], 1),
            Err(PartitionError::Memory { need: 400 })
        ));
    }

    #[test]
    fn auto_matches_exhaustive_search() {
        // A deterministic pseudo-random family of instances.
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..200 {
            let n = 2 + (next() % 9) as usize;
            let k = 1 + (next() % n.min(5) as u64) as usize;
            let costs: Vec<LayerCost> = (0..n)
                .map(|_| cost(0.1 + (next() % 100) as f64 / 10.0, 1 + next() % 50))
                .collect();
            let limits: Vec<u64> = (0..k).map(|_| 200 + next() % 800).collect();
            let dp = auto(&costs, &limits, 2).ok();
            let ex = exhaustive(&costs, &limits, 2);
            assert_eq!(dp.is_some(), ex.is_some(), "{costs:?} {limits:?}");
            if let (Some(a), Some(b)) = (dp, ex) {
                assert!((a.bottleneck() - b.bottleneck()).abs() < 1e-12, "{a} vs {b}");
            }
        }
    }
}
