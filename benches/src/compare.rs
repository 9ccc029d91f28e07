//! `sluice bench compare OLD.jsonl NEW.jsonl`: each row of one recorded run matched with the
//! same row of another (suite, backend, metric, size), its change, and the rows that moved by
//! more than a threshold, so that a speed change is reviewed as a diff.
//!
//! Files are parsed, never trusted: a line that is not JSON, or a JSON object that is not a
//! `sluice bench` record, is an error naming the file and the line.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context as _};
use serde::Deserialize;

use crate::report::human_bytes;

/// A record as read back from a JSON-lines file (the fields `compare` needs; others ignored).
#[derive(Debug, Clone, Deserialize)]
pub struct Recorded {
    pub suite: String,
    pub backend: String,
    pub metric: String,
    pub bytes: u64,
    #[serde(default)]
    pub p50_ns: Option<f64>,
    #[serde(default)]
    pub p99_ns: Option<f64>,
    #[serde(default)]
    pub gbps: Option<f64>,
    #[serde(default)]
    pub per_second: Option<f64>,
    #[serde(default)]
    pub cpu_percent: Option<f64>,
    #[serde(default)]
    pub iterations: Option<u64>,
}

impl Recorded {
    /// The figure the row is judged by, and whether higher is better.
    pub fn figure(&self) -> Option<(f64, bool)> {
        match self.metric.as_str() {
            "rtt" | "cpu/msg" => self.p50_ns.map(|v| (v, false)),
            "bw" => self.gbps.map(|v| (v, true)),
            "rate" | "gflops" => self.per_second.map(|v| (v, true)),
            "cpu" => self.cpu_percent.map(|v| (v, false)),
            _ => None,
        }
    }

    fn key(&self) -> (String, String, String, u64) {
        (
            self.suite.clone(),
            self.backend.clone(),
            self.metric.clone(),
            self.bytes,
        )
    }
}

/// Every record of a `sluice bench --json` file. Blank lines are skipped.
pub fn load(path: &Path) -> anyhow::Result<Vec<Recorded>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        let record: Recorded = serde_json::from_value(value).with_context(|| {
            format!(
                "{}:{}: not a `sluice bench` record (needs suite, backend, metric and bytes)",
                path.display(),
                i + 1
            )
        })?;
        out.push(record);
    }
    if out.is_empty() {
        bail!("{}: no records", path.display());
    }
    Ok(out)
}

/// One matched row.
#[derive(Debug, Clone)]
pub struct Change {
    pub suite: String,
    pub backend: String,
    pub metric: String,
    pub bytes: u64,
    pub old: f64,
    pub new: f64,
    /// Relative change of the figure, in percent (positive: the figure grew).
    pub percent: f64,
    /// Beyond the threshold: `Some(true)` better, `Some(false)` worse.
    pub flagged: Option<bool>,
}

/// The comparison of two runs.
#[derive(Debug, Clone, Default)]
pub struct Comparison {
    pub changes: Vec<Change>,
    /// Rows in only one of the runs, as `suite backend metric size`.
    pub only_old: Vec<String>,
    pub only_new: Vec<String>,
}

impl Comparison {
    pub fn better(&self) -> usize {
        self.changes.iter().filter(|c| c.flagged == Some(true)).count()
    }

    pub fn worse(&self) -> usize {
        self.changes.iter().filter(|c| c.flagged == Some(false)).count()
    }
}

fn label(r: &Recorded) -> String {
    format!("{} {} {} {}", r.suite, r.backend, r.metric, human_bytes(r.bytes))
}

/// Matches `new` against `old`; a row is flagged when its figure moved by more than
/// `threshold_percent`. A key recorded twice in one file uses its last record.
pub fn compare(old: &[Recorded], new: &[Recorded], threshold_percent: f64) -> Comparison {
    let index = |rs: &[Recorded]| -> BTreeMap<_, Recorded> { rs.iter().map(|r| (r.key(), r.clone())).collect() };
    let (old_rows, new_rows) = (index(old), index(new));
    let mut out = Comparison::default();
    // In the new run's order, which is the order the suites ran in.
    let mut seen = std::collections::HashSet::new();
    for r in new {
        let key = r.key();
        if !seen.insert(key.clone()) {
            continue;
        }
        let r = &new_rows[&key];
        let Some(o) = old_rows.get(&key) else {
            out.only_new.push(label(r));
            continue;
        };
        let (Some((a, higher_better)), Some((b, _))) = (o.figure(), r.figure()) else {
            continue;
        };
        let percent = if a == 0.0 { 0.0 } else { (b / a - 1.0) * 100.0 };
        let flagged = (percent.abs() > threshold_percent).then_some((percent > 0.0) == higher_better);
        out.changes.push(Change {
            suite: r.suite.clone(),
            backend: r.backend.clone(),
            metric: r.metric.clone(),
            bytes: r.bytes,
            old: a,
            new: b,
            percent,
            flagged,
        });
    }
    out.only_old = old_rows
        .iter()
        .filter(|(k, _)| !new_rows.contains_key(*k))
        .map(|(_, r)| label(r))
        .collect();
    out
}

fn figure_text(metric: &str, v: f64) -> String {
    match metric {
        "rtt" | "cpu/msg" if v >= 1e6 => format!("{:.2} ms", v / 1e6),
        "rtt" | "cpu/msg" => format!("{:.2} µs", v / 1e3),
        "bw" => format!("{v:.2} GB/s"),
        "rate" => format!("{:.1}k/s", v / 1e3),
        "gflops" => format!("{v:.1} GF/s"),
        "cpu" => format!("{v:.2}%"),
        _ => format!("{v}"),
    }
}

/// The comparison as an aligned table, flagged rows marked, and a summary line.
pub fn table(c: &Comparison, threshold_percent: f64) -> String {
    let w = c
        .changes
        .iter()
        .map(|ch| ch.backend.chars().count())
        .max()
        .unwrap_or(0)
        .max(16);
    let mut out = format!(
        "{:<10} {:<w$} {:<7} {:>9} {:>12} {:>12} {:>9}\n",
        "suite", "backend", "metric", "size", "old", "new", "change"
    );
    for ch in &c.changes {
        let flag = match ch.flagged {
            Some(true) => "  better",
            Some(false) => "  WORSE",
            None => "",
        };
        out.push_str(&format!(
            "{:<10} {:<w$} {:<7} {:>9} {:>12} {:>12} {:>+8.1}%{flag}\n",
            ch.suite,
            ch.backend,
            ch.metric,
            human_bytes(ch.bytes),
            figure_text(&ch.metric, ch.old),
            figure_text(&ch.metric, ch.new),
            ch.percent
        ));
    }
    out.push_str(&format!(
        "\n{} rows compared; {} moved by more than {threshold_percent}%: {} better, {} worse\n",
        c.changes.len(),
        c.better() + c.worse(),
        c.better(),
        c.worse()
    ));
    for (which, rows) in [("OLD", &c.only_old), ("NEW", &c.only_new)] {
        if rows.is_empty() {
            continue;
        }
        let shown: Vec<&str> = rows.iter().take(8).map(String::as_str).collect();
        let more = rows.len().saturating_sub(shown.len());
        let tail = if more > 0 {
            format!("; and {more} more")
        } else {
            String::new()
        };
        out.push_str(&format!(
            "only in {which} ({} rows): {}{tail}\n",
            rows.len(),
            shown.join("; ")
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(metric: &str, bytes: u64, v: f64) -> Recorded {
        Recorded {
            suite: "pipe".into(),
            backend: "cma/shm".into(),
            metric: metric.into(),
            bytes,
            p50_ns: (metric == "rtt").then_some(v),
            p99_ns: None,
            gbps: (metric == "bw").then_some(v),
            per_second: None,
            cpu_percent: None,
            iterations: None,
        }
    }

    #[test]
    fn flags_what_moved_beyond_the_threshold_in_the_right_direction() {
        let old = vec![
            rec("rtt", 64, 1000.0),
            rec("bw", 1 << 20, 10.0),
            rec("bw", 64 << 20, 5.0),
        ];
        let new = vec![
            rec("rtt", 64, 1300.0),
            rec("bw", 1 << 20, 13.0),
            rec("bw", 64 << 20, 5.2),
            rec("rtt", 8, 1.0),
        ];
        let c = compare(&old, &new, 10.0);
        assert_eq!(c.changes.len(), 3);
        // A slower round trip is worse; more bandwidth is better; 4% is within the threshold.
        assert_eq!(c.changes[0].flagged, Some(false));
        assert_eq!(c.changes[1].flagged, Some(true));
        assert_eq!(c.changes[2].flagged, None);
        assert!((c.changes[0].percent - 30.0).abs() < 1e-9);
        assert_eq!((c.better(), c.worse()), (1, 1));
        assert_eq!(c.only_new, vec!["pipe cma/shm rtt 8 B".to_owned()]);
        assert!(c.only_old.is_empty());
        let t = table(&c, 10.0);
        assert!(t.contains("WORSE") && t.contains("better") && t.contains("only in NEW"));
    }

    #[test]
    fn foreign_and_malformed_files_are_errors_naming_the_file_and_line() {
        let dir = std::env::temp_dir().join(format!("sluice-compare-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good =
            r#"{"suite":"raw","backend":"memcpy","metric":"bw","bytes":8,"gbps":1.0,"iterations":3,"baseline":""}"#;
        let cases = [
            ("broken.jsonl", format!("{good}\n{{\"suite\": ")),
            ("foreign.jsonl", format!("{good}\n{{\"name\":\"x\",\"value\":3}}")),
            ("empty.jsonl", String::new()),
        ];
        for (name, text) in cases {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            let e = format!("{:#}", load(&path).unwrap_err());
            assert!(e.contains(name), "{e}");
            if name != "empty.jsonl" {
                assert!(e.contains(":2:"), "names the line: {e}");
            }
        }
        let e = format!("{:#}", load(&dir.join("missing.jsonl")).unwrap_err());
        assert!(e.contains("missing.jsonl"), "{e}");
        std::fs::write(dir.join("good.jsonl"), good).unwrap();
        assert_eq!(load(&dir.join("good.jsonl")).unwrap().len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
