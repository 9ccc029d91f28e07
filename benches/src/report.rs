//! Results: one [`Record`] per (suite, backend, metric, size), printed as a table and written as
//! JSON lines.

use serde::Serialize;

/// One measurement. `p50_ns`/`p99_ns` for round trips, `gbps` (GB/s, 10^9 bytes) for bandwidth.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub suite: &'static str,
    pub backend: String,
    pub metric: &'static str,
    pub bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p50_ns: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p99_ns: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_percent: Option<f64>,
    /// Operations per second, for `rate` records.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_second: Option<f64>,
    pub iterations: u64,
    /// Name of the baseline this result is compared with (empty for baselines themselves).
    pub baseline: String,
    /// Ours over baseline: latency ratio for `rtt` (lower is better), bandwidth ratio for `bw`
    /// (higher is better).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    /// Where this process's shared-memory waits went during the row, and its minor page
    /// faults (rows over shared memory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stages: Option<Stages>,
}

/// This process's shared-memory waits (see `sluice_transport::shm::stats`) and minor page
/// faults during one row.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Stages {
    #[serde(flatten)]
    pub waits: sluice_transport::shm::stats::WaitStats,
    pub minor_faults: u64,
}

impl Stages {
    /// `self` and `other` together (one row measured in slices).
    pub fn plus(&self, other: &Stages) -> Stages {
        Stages {
            waits: self.waits.plus(&other.waits),
            minor_faults: self.minor_faults + other.minor_faults,
        }
    }
}

/// Counts [`Stages`] from a start until [`StageMeter::stop`].
pub struct StageMeter {
    waits: sluice_transport::shm::stats::WaitStats,
    faults: u64,
}

fn minor_faults() -> u64 {
    nix::sys::resource::getrusage(nix::sys::resource::UsageWho::RUSAGE_SELF)
        .map(|u| u.minor_page_faults() as u64)
        .unwrap_or(0)
}

impl StageMeter {
    pub fn start() -> StageMeter {
        sluice_transport::shm::stats::enable();
        StageMeter {
            waits: sluice_transport::shm::stats::snapshot(),
            faults: minor_faults(),
        }
    }

    pub fn stop(&self) -> Stages {
        Stages {
            waits: sluice_transport::shm::stats::snapshot().since(&self.waits),
            minor_faults: minor_faults().saturating_sub(self.faults),
        }
    }
}

impl Record {
    /// Round-trip percentiles of `samples`, in the order they were taken. The first is a
    /// warm-up (first touches of fresh buffers, rings and pages: at 64 MiB it alone is the
    /// p99 of a 20-sample run) and is left out when there are more than three.
    pub fn rtt(suite: &'static str, backend: impl Into<String>, bytes: usize, mut samples: Vec<f64>) -> Record {
        if samples.len() > 3 {
            samples.remove(0);
        }
        samples.sort_by(|a, b| a.total_cmp(b));
        let pick = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
        Record {
            suite,
            backend: backend.into(),
            metric: "rtt",
            bytes: bytes as u64,
            p50_ns: Some(pick(0.5)),
            p99_ns: Some(pick(0.99)),
            gbps: None,
            cpu_percent: None,
            per_second: None,
            iterations: samples.len() as u64,
            baseline: String::new(),
            ratio: None,
            stages: None,
        }
    }

    pub fn bw(suite: &'static str, backend: impl Into<String>, bytes: usize, gbps: f64, iterations: u64) -> Record {
        Record {
            suite,
            backend: backend.into(),
            metric: "bw",
            bytes: bytes as u64,
            p50_ns: None,
            p99_ns: None,
            gbps: Some(gbps),
            cpu_percent: None,
            per_second: None,
            iterations,
            baseline: String::new(),
            ratio: None,
            stages: None,
        }
    }

    /// A throughput in operations per second.
    pub fn rate(
        suite: &'static str,
        backend: impl Into<String>,
        bytes: usize,
        per_second: f64,
        iterations: u64,
    ) -> Record {
        Record {
            suite,
            backend: backend.into(),
            metric: "rate",
            bytes: bytes as u64,
            p50_ns: None,
            p99_ns: None,
            gbps: None,
            cpu_percent: None,
            per_second: Some(per_second),
            iterations,
            baseline: String::new(),
            ratio: None,
            stages: None,
        }
    }

    /// A compute throughput in GFLOP/s (stored in `per_second`).
    pub fn gflops(suite: &'static str, backend: impl Into<String>, gflops: f64, iterations: u64) -> Record {
        Record {
            metric: "gflops",
            ..Record::rate(suite, backend, 0, gflops, iterations)
        }
    }

    /// Sets the baseline and the ratio against it.
    pub fn against(&mut self, baseline: &Record) {
        self.baseline = format!("{}/{}", baseline.suite, baseline.backend);
        self.ratio = match self.metric {
            "rtt" | "cpu/msg" => Some(self.p50_ns.unwrap_or(0.0) / baseline.p50_ns.unwrap_or(f64::NAN)),
            "rate" | "gflops" => Some(self.per_second.unwrap_or(0.0) / baseline.per_second.unwrap_or(f64::NAN)),
            _ => Some(self.gbps.unwrap_or(0.0) / baseline.gbps.unwrap_or(f64::NAN)),
        };
    }

    pub fn json(&self) -> String {
        serde_json::to_string(self).expect("records serialize")
    }
}

pub fn human_bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

fn human_ns(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.2} µs", ns / 1e3)
    }
}

/// The results as an aligned text table (the backend column as wide as its longest name).
pub fn table(records: &[Record]) -> String {
    let w = records
        .iter()
        .map(|r| r.backend.chars().count())
        .max()
        .unwrap_or(0)
        .max(16);
    let mut out = format!(
        "{:<10} {:<w$} {:<7} {:>9} {:>12} {:>12} {:>10}  {:<24} {:>7}\n",
        "suite", "backend", "metric", "size", "p50", "p99", "GB/s", "baseline", "ratio"
    );
    for r in records {
        let (p50, p99, gbps) = match r.metric {
            "rtt" | "cpu/msg" => (
                human_ns(r.p50_ns.unwrap_or(0.0)),
                r.p99_ns.map(human_ns).unwrap_or_default(),
                String::new(),
            ),
            "cpu" => (
                String::new(),
                String::new(),
                format!("{:.2}% cpu", r.cpu_percent.unwrap_or(0.0)),
            ),
            "rate" => (
                String::new(),
                String::new(),
                format!("{:.0}k/s", r.per_second.unwrap_or(0.0) / 1e3),
            ),
            "gflops" => (
                String::new(),
                String::new(),
                format!("{:.1} GF/s", r.per_second.unwrap_or(0.0)),
            ),
            _ => (String::new(), String::new(), format!("{:.2}", r.gbps.unwrap_or(0.0))),
        };
        let ratio = r.ratio.map(|x| format!("{x:.2}x")).unwrap_or_default();
        out.push_str(&format!(
            "{:<10} {:<w$} {:<7} {:>9} {:>12} {:>12} {:>10}  {:<24} {:>7}\n",
            r.suite,
            r.backend,
            r.metric,
            human_bytes(r.bytes),
            p50,
            p99,
            gbps,
            r.baseline,
            ratio
        ));
    }
    out
}
