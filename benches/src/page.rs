//! `sluice bench --report DIR`: a self-contained `index.html` with the run's figures inline
//! (also written beside it as SVG files), the machine, the commit, the date, the exact command,
//! the table, and what the peers suite skipped.
//!
//! Figures (each drawn only when the run has its data):
//! - `rtt.svg`: round trip against size, log axes, one line per transport/channel/peer, the raw
//!   baselines dashed;
//! - `bw.svg`: bandwidth against size, likewise;
//! - `rpc.svg`: call rates (bars), Sluice's RPC next to PyTorch's;
//! - `step.svg`: the training step (bars), local and distributed, Sluice's and PyTorch's;
//! - `collective.svg` (allreduce), `collective-allgather.svg`, `collective-broadcast.svg`,
//!   `collective-reducescatter.svg`: bandwidth against size, Sluice's, Gloo's, the torch process
//!   group's and OpenMPI's.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::report::{human_bytes, table, Record};

/// What the page says about the run besides its records.
#[derive(Debug, Clone, Default)]
pub struct RunInfo {
    /// The command line, as typed.
    pub command: String,
    /// Lines from the peers suite: what it skipped or lost, and why.
    pub notes: Vec<String>,
}

/// One figure, as SVG text.
pub struct Figure {
    pub file: &'static str,
    pub title: &'static str,
    pub svg: String,
}

/// Writes `DIR/index.html` and the figures; returns the figures' file names. The directory is
/// created if needed; an error names it.
pub fn write(dir: &Path, records: &[Record], info: &RunInfo) -> anyhow::Result<Vec<&'static str>> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create the report directory {}", dir.display()))?;
    let figures = figures(records)?;
    for f in &figures {
        let path = dir.join(f.file);
        std::fs::write(&path, &f.svg).with_context(|| format!("cannot write {}", path.display()))?;
    }
    let html = html(records, info, &figures);
    let path = dir.join("index.html");
    std::fs::write(&path, html).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(figures.iter().map(|f| f.file).collect())
}

/// Every figure the records allow.
pub fn figures(records: &[Record]) -> anyhow::Result<Vec<Figure>> {
    let mut out = Vec::new();
    for (file, title, metric, y) in [
        ("rtt.svg", "Round trip against size", "rtt", "round trip, p50 (µs)"),
        ("bw.svg", "Bandwidth against size", "bw", "bandwidth (GB/s)"),
    ] {
        let series = size_series(records, metric);
        if !series.is_empty() {
            out.push(Figure {
                file,
                title,
                svg: lines(title, y, &series)?,
            });
        }
    }
    // Each collective's bandwidth against size: Sluice's, Gloo's and the "sluice" process
    // group's through torch, OpenMPI's (a peer's buffer over its p50, as ours).
    for (op, file, title) in [
        ("allreduce", "collective.svg", "Allreduce (f32, sum) against size"),
        ("allgather", "collective-allgather.svg", "Allgather (f32) against size"),
        ("broadcast", "collective-broadcast.svg", "Broadcast (f32) against size"),
        (
            "reducescatter",
            "collective-reducescatter.svg",
            "Reduce-scatter (f32, sum) against size",
        ),
    ] {
        let mut lines_of: BTreeMap<String, Series> = BTreeMap::new();
        for r in records.iter().filter(|r| r.backend.contains(&format!("{op}-"))) {
            let point = match (r.suite, r.metric) {
                ("collective", "bw") => r.gbps,
                ("peer", "rtt") => r.p50_ns.map(|ns| r.bytes as f64 / ns),
                _ => None,
            };
            if let Some(y) = point.filter(|y| *y > 0.0 && r.bytes > 0) {
                let name = format!("{} {}", r.suite, r.backend);
                lines_of
                    .entry(name.clone())
                    .or_insert_with(|| Series {
                        name,
                        points: Vec::new(),
                        colour: colour_of(r),
                        dashed: r.suite == "peer",
                    })
                    .points
                    .push((r.bytes as f64, y));
            }
        }
        let series: Vec<Series> = lines_of
            .into_values()
            .filter(|s| s.points.len() > 1)
            .map(|mut s| {
                s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
                s
            })
            .collect();
        if !series.is_empty() {
            out.push(Figure {
                file,
                title,
                svg: lines(title, "bandwidth (GB/s)", &series)?,
            });
        }
    }
    let rates: Vec<(String, f64, RGBColor)> = records
        .iter()
        .filter(|r| r.metric == "rate" && matches!(r.suite, "rpc" | "peer"))
        .map(|r| (r.backend.clone(), r.per_second.unwrap_or(0.0) / 1e3, colour_of(r)))
        .collect();
    if !rates.is_empty() {
        out.push(Figure {
            file: "rpc.svg",
            title: "RPC calls per second, 64 in flight (thousands)",
            svg: bars("RPC calls per second, 64 in flight", "thousand calls/s", &rates)?,
        });
    }
    let steps: Vec<(String, f64, RGBColor)> = records
        .iter()
        .filter(|r| r.metric == "rtt" && (r.suite == "autograd" || (r.suite == "peer" && r.backend.contains("step"))))
        .map(|r| (r.backend.clone(), r.p50_ns.unwrap_or(0.0) / 1e3, colour_of(r)))
        .collect();
    if !steps.is_empty() {
        out.push(Figure {
            file: "step.svg",
            title: "Training step: Linear(1024, 1024), batch 32 (µs, p50)",
            svg: bars("Training step, p50", "µs per step", &steps)?,
        });
    }
    Ok(out)
}

/// A line of a size chart.
struct Series {
    name: String,
    points: Vec<(f64, f64)>,
    colour: RGBColor,
    dashed: bool,
}

/// Whether a peer's row is a collective or a training step (charted apart, not against the
/// transports' sizes).
fn is_collective(backend: &str) -> bool {
    crate::collective::OPS
        .iter()
        .chain(&["ddp-step"])
        .any(|c| backend.contains(c))
}

/// Which records go on the size charts: transports, pipes, raw baselines, peers, and the RPC
/// echo (bandwidth); each (suite, backend) one line.
fn size_series(records: &[Record], metric: &str) -> Vec<Series> {
    let mut by_line: BTreeMap<(usize, String), Series> = BTreeMap::new();
    for r in records {
        let charted = (matches!(r.suite, "raw" | "transport" | "pipe" | "peer") && !is_collective(&r.backend))
            || (r.suite == "rpc" && metric == "bw" && r.backend.contains("echo"));
        if r.metric != metric || !charted || r.bytes == 0 {
            continue;
        }
        let y = match metric {
            "rtt" => r.p50_ns.map(|ns| ns / 1e3),
            _ => r.gbps,
        };
        let Some(y) = y.filter(|y| *y > 0.0) else { continue };
        let order = ["raw", "transport", "pipe", "rpc", "peer"]
            .iter()
            .position(|s| *s == r.suite)
            .unwrap_or(9);
        let name = format!("{} {}", r.suite, r.backend);
        by_line
            .entry((order, name.clone()))
            .or_insert_with(|| Series {
                name,
                points: Vec::new(),
                colour: colour_of(r),
                dashed: r.suite == "raw",
            })
            .points
            .push((r.bytes as f64, y));
    }
    by_line
        .into_values()
        .filter(|s| s.points.len() > 1 || s.dashed)
        .map(|mut s| {
            s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
            s
        })
        .collect()
}

/// A colour per line: raw baselines grey, peers in their own strong colours, ours from a
/// palette by name (stable from run to run).
fn colour_of(r: &Record) -> RGBColor {
    if r.suite == "raw" {
        return match r.backend.as_str() {
            "memcpy" => RGBColor(90, 90, 90),
            b if b.starts_with("tcp") => RGBColor(140, 140, 140),
            _ => RGBColor(40, 40, 40),
        };
    }
    if r.suite == "peer" {
        return if r.backend.starts_with("openmpi") {
            RGBColor(200, 30, 30)
        } else {
            RGBColor(238, 120, 0)
        };
    }
    const OURS: [RGBColor; 8] = [
        RGBColor(31, 119, 180),
        RGBColor(44, 160, 44),
        RGBColor(148, 103, 189),
        RGBColor(23, 190, 207),
        RGBColor(140, 86, 75),
        RGBColor(227, 119, 194),
        RGBColor(188, 189, 34),
        RGBColor(0, 70, 140),
    ];
    let h = format!("{}{}", r.suite, r.backend)
        .bytes()
        .fold(5381u32, |h, b| h.wrapping_mul(33) ^ b as u32);
    OURS[h as usize % OURS.len()]
}

fn chart_error<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing a figure: {e:?}")
}

/// A log-log chart of `series` against size.
fn lines(title: &str, y_desc: &str, series: &[Series]) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (960, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(chart_error)?;
        let all = series.iter().flat_map(|s| s.points.iter());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
        for &(x, y) in all {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d((x0 / 1.5..x1 * 1.5).log_scale(), (y0 / 2.0..y1 * 2.0).log_scale())
            .map_err(chart_error)?;
        chart
            .configure_mesh()
            .x_desc("message size")
            .y_desc(y_desc)
            .x_label_formatter(&|x| human_bytes(x.round() as u64))
            .y_label_formatter(&|y| format!("{y:.3}"))
            .light_line_style(RGBColor(235, 235, 235))
            .draw()
            .map_err(chart_error)?;
        for s in series {
            let style = ShapeStyle::from(&s.colour).stroke_width(2);
            let drawn = if s.dashed {
                chart.draw_series(DashedLineSeries::new(s.points.iter().copied(), 6, 5, style))
            } else {
                chart.draw_series(LineSeries::new(s.points.iter().copied(), style))
            }
            .map_err(chart_error)?;
            let (colour, dashed) = (s.colour, s.dashed);
            drawn.label(s.name.clone()).legend(move |(x, y)| {
                let style = ShapeStyle::from(&colour).stroke_width(2);
                if dashed {
                    PathElement::new(vec![(x, y), (x + 8, y)], style)
                } else {
                    PathElement::new(vec![(x, y), (x + 20, y)], style)
                }
            });
            if !s.dashed {
                chart
                    .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, s.colour.filled())))
                    .map_err(chart_error)?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(200, 200, 200))
            .label_font(("sans-serif", 12))
            .draw()
            .map_err(chart_error)?;
        root.present().map_err(chart_error)?;
    }
    Ok(svg)
}

/// Horizontal bars, one per `(name, value, colour)`, each labelled with its value.
fn bars(title: &str, x_desc: &str, items: &[(String, f64, RGBColor)]) -> anyhow::Result<String> {
    let mut svg = String::new();
    {
        let height = 120 + 34 * items.len() as u32;
        let root = SVGBackend::with_string(&mut svg, (960, height)).into_drawing_area();
        root.fill(&WHITE).map_err(chart_error)?;
        draw_bars(&root, title, x_desc, items)?;
        root.present().map_err(chart_error)?;
    }
    Ok(svg)
}

fn draw_bars(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    title: &str,
    x_desc: &str,
    items: &[(String, f64, RGBColor)],
) -> anyhow::Result<()> {
    let max = items.iter().map(|i| i.1).fold(0.0f64, f64::max).max(1e-9);
    let n = items.len() as u32;
    let names: Vec<String> = items.iter().map(|i| i.0.clone()).collect();
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(300)
        .build_cartesian_2d(0.0..max * 1.2, (0u32..n).into_segmented())
        .map_err(chart_error)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc(x_desc)
        .y_labels(items.len())
        .y_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) => names.get(*i as usize).cloned().unwrap_or_default(),
            _ => String::new(),
        })
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(chart_error)?;
    for (i, (_, value, colour)) in items.iter().enumerate() {
        let i = i as u32;
        let bar = Rectangle::new(
            [(0.0, SegmentValue::Exact(i)), (*value, SegmentValue::Exact(i + 1))],
            colour.filled(),
        );
        chart.draw_series(std::iter::once(bar)).map_err(chart_error)?;
        let label = Text::new(
            format!("{value:.1}"),
            (*value + max * 0.01, SegmentValue::CenterOf(i)),
            ("sans-serif", 13),
        );
        chart.draw_series(std::iter::once(label)).map_err(chart_error)?;
    }
    Ok(())
}

/// What the page says about this machine.
pub fn machine() -> Vec<(&'static str, String)> {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let cpu = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .and_then(|r| r.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let memory = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or_else(|| "unknown".into(), |kb| format!("{:.1} GiB", kb / (1024.0 * 1024.0)));
    let kernel = format!(
        "{} {}",
        read("/proc/sys/kernel/ostype").trim(),
        read("/proc/sys/kernel/osrelease").trim()
    );
    let gpus = match sluice_channel::cuda::runtime() {
        _ if sluice_channel::cuda::driver::model().is_some() => "none (the CUDA driver model is loaded)".into(),
        Ok(cuda) if !cuda.gpus.is_empty() => cuda.gpus.iter().map(|g| g.name.clone()).collect::<Vec<_>>().join(", "),
        Ok(_) => "none".into(),
        Err(e) => format!("none ({e})"),
    };
    let rdma = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    vec![
        ("CPU", cpu),
        ("cores", cores.to_string()),
        ("memory", memory),
        ("kernel", kernel),
        ("GPUs", gpus),
        (
            "RDMA devices",
            if rdma.is_empty() {
                "none".into()
            } else {
                rdma.join(", ")
            },
        ),
    ]
}

/// The commit of the checkout this binary was built from (`git describe`, "-dirty" with local
/// changes), or "unknown" where that checkout is not at hand (a binary copied elsewhere).
pub fn commit() -> String {
    let checkout = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    std::process::Command::new("git")
        .args(["-C", checkout, "describe", "--always", "--dirty", "--abbrev=12"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// The time now, UTC, as `2026-11-24T22:30:00Z`.
pub fn now() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The page: everything inline, nothing fetched.
pub fn html(records: &[Record], info: &RunInfo, figures: &[Figure]) -> String {
    let date = now();
    let mut h = String::new();
    h.push_str(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>sluice bench</title>\n<style>\
         body{font-family:sans-serif;margin:24px;max-width:1000px;color:#222}\
         table.m td{padding:2px 12px 2px 0}pre{font-size:12px;overflow-x:auto;background:#f6f6f6;padding:8px}\
         figure{margin:24px 0}figcaption{font-weight:bold;margin-bottom:6px}</style></head><body>\n",
    );
    h.push_str("<h1>sluice bench</h1>\n<table class=\"m\">\n");
    let mut row = |k: &str, v: &str| {
        let _ = writeln!(h, "<tr><td>{}</td><td>{}</td></tr>", escape(k), escape(v));
    };
    for (k, v) in machine() {
        row(k, &v);
    }
    row("commit", &commit());
    row("date", &date);
    row("command", &info.command);
    h.push_str("</table>\n");
    if !info.notes.is_empty() {
        h.push_str("<h2>Peers not measured</h2>\n<ul>\n");
        for n in &info.notes {
            let _ = writeln!(h, "<li>{}</li>", escape(n));
        }
        h.push_str("</ul>\n");
    }
    for f in figures {
        let _ = writeln!(
            h,
            "<figure id=\"{}\"><figcaption>{}</figcaption>\n{}\n</figure>",
            f.file.trim_end_matches(".svg"),
            escape(f.title),
            strip_xml_declaration(&f.svg)
        );
    }
    h.push_str(
        "<h2>All results</h2>\n<p>Ratios compare with the baseline of the same size and medium measured in \
         the same run: for rtt ours over the baseline's p50 (lower is better), for bw ours over the \
         baseline (higher is better).</p>\n<pre>",
    );
    h.push_str(&escape(&table(records)));
    h.push_str("</pre>\n</body></html>\n");
    h
}

fn strip_xml_declaration(svg: &str) -> &str {
    match svg.strip_prefix("<?xml") {
        Some(rest) => rest.split_once("?>").map_or(svg, |(_, body)| body.trim_start()),
        None => svg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Record> {
        let mut out = Vec::new();
        for &size in &[64usize, 65536, 64 << 20] {
            out.push(Record::rtt("raw", "shm-pingpong", size, vec![300.0, 310.0, 320.0]));
            out.push(Record::rtt("transport", "shm", size, vec![700.0, 710.0, 720.0]));
            out.push(Record::rtt("peer", "openmpi", size, vec![250.0, 260.0, 270.0]));
            out.push(Record::bw("raw", "memcpy", size, 20.0, 3));
            out.push(Record::bw("pipe", "cma/shm", size, 9.0, 3));
            out.push(Record::bw("peer", "openmpi", size, 4.0, 3));
            out.push(Record::bw("collective", "allreduce-f32-2p", size, 3.0, 3));
            out.push(Record::rtt("peer", "gloo-allreduce-f32-2p", size, vec![5e3, 5e3, 5e3]));
            out.push(Record::bw("collective", "allgather-f32-2p", size, 2.0, 3));
            out.push(Record::rtt("peer", "torch-sluice-allgather-f32-2p", size, vec![4e3; 3]));
        }
        out.push(Record::rtt("peer", "ddp-step-sluice", 4 << 20, vec![5e6; 3]));
        out.push(Record::rate("rpc", "rpc_async-64/cma/shm", 0, 530_000.0, 100));
        out.push(Record::rate("peer", "pytorch-rpc_async-64", 0, 30_000.0, 100));
        out.push(Record::rtt("autograd", "local-step-linear1024-b32", 0, vec![900e3; 4]));
        out.push(Record::rtt("autograd", "dist-step-linear1024-b32", 0, vec![1100e3; 4]));
        out
    }

    #[test]
    fn every_figure_is_drawn_and_inlined() {
        let records = sample();
        let figures = figures(&records).unwrap();
        let files: Vec<_> = figures.iter().map(|f| f.file).collect();
        assert_eq!(
            files,
            [
                "rtt.svg",
                "bw.svg",
                "collective.svg",
                "collective-allgather.svg",
                "rpc.svg",
                "step.svg"
            ]
        );
        for f in &figures {
            assert!(f.svg.contains("<svg") && f.svg.contains("</svg>"), "{}", f.file);
        }
        // Lines are named in the legend, the baseline among them; peers are there too.
        assert!(figures[1].svg.contains("raw memcpy") && figures[1].svg.contains("peer openmpi"));
        // Allreduce lines have their own figure, Gloo's beside ours, and stay off the others.
        assert!(figures[2].svg.contains("collective allreduce-f32-2p") && figures[2].svg.contains("gloo-allreduce"));
        assert!(!figures[0].svg.contains("gloo") && !figures[1].svg.contains("allreduce"));
        // Each collective its own figure; the DDP step stays off the size charts.
        assert!(figures[3].svg.contains("collective allgather-f32-2p") && !figures[3].svg.contains("allreduce"));
        assert!(figures[3].svg.contains("torch-sluice-allgather"));
        assert!(!figures[0].svg.contains("ddp-step") && !figures[2].svg.contains("allgather"));
        let page = html(&records, &RunInfo::default(), &figures);
        assert_eq!(page.matches("<svg").count(), 6);
        assert!(page.contains("kernel") && page.contains("commit") && page.contains("CPU"));
    }

    #[test]
    fn a_report_directory_that_cannot_be_written_is_an_error_naming_it() {
        let file = std::env::temp_dir().join(format!("sluice-report-file-{}", std::process::id()));
        std::fs::write(&file, b"not a directory").unwrap();
        let e = format!(
            "{:#}",
            write(&file.join("out"), &sample(), &RunInfo::default()).unwrap_err()
        );
        assert!(e.contains(&file.display().to_string()), "{e}");
        let _ = std::fs::remove_file(&file);
    }
}
