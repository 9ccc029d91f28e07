//! `sluice bench` as its users run it: a quick run with the peers suite writing a report page,
//! the page opened in headless Chromium (a screenshot that is not blank, every figure an
//! `<svg>` in the rendered page), and `sluice bench compare` on good and bad files.
//!
//! Chromium is Debian's `chromium` package (CI installs it); without it the browser half prints
//! `SKIPPED` with the reason. OpenMPI and PyTorch (`$SLUICE_BENCH_PYTHON`, on TensorPipe and on
//! Sluice's backend) are used when installed and skipped with their reason otherwise; the test
//! checks that the page says which and what each branch adds. CI runs it a second time with its
//! torch venv and `SLUICE_REQUIRE_TORCH=1`, so the measured branch runs there too.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const WATCHDOG: Duration = Duration::from_secs(300);

/// Runs `cmd` to completion under the watchdog. Its output goes to files while it runs (a
/// browser dumping a large page would block on a full pipe nobody reads yet).
fn run(cmd: &mut Command) -> Output {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let base = std::env::temp_dir().join(format!("sluice-report-test-out-{}-{n}", std::process::id()));
    let (out, err) = (base.with_extension("stdout"), base.with_extension("stderr"));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > WATCHDOG {
            let _ = child.kill();
            panic!("watchdog: {cmd:?} still running after {WATCHDOG:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = Output {
        status,
        stdout: std::fs::read(&out).unwrap_or_default(),
        stderr: std::fs::read(&err).unwrap_or_default(),
    };
    let _ = (std::fs::remove_file(&out), std::fs::remove_file(&err));
    output
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn sluice(args: &[&str]) -> Output {
    run(Command::new(env!("CARGO_BIN_EXE_sluice")).args(args))
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("sluice-report-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |d| d.join(name)))
        .find(|p| p.is_file())
}

fn browser(exe: &Path, args: &[&str], page: &Path) -> Output {
    run(Command::new(exe)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"])
        .args(args)
        .arg(format!("file://{}", page.display())))
}

/// Whether the screenshot shows something: enough non-white pixels and several colours.
fn not_blank(png_path: &Path) -> (f64, usize) {
    let decoder = png::Decoder::new(std::fs::File::open(png_path).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    let channels = info.color_type.samples();
    let pixels = &buf[..info.buffer_size()];
    let mut inked = 0usize;
    let mut colours = std::collections::HashSet::new();
    for px in pixels.chunks(channels) {
        if px[..3.min(channels)].iter().any(|&c| c < 200) {
            inked += 1;
        }
        colours.insert(px[..3.min(channels)].to_vec());
    }
    (inked as f64 / (pixels.len() / channels) as f64, colours.len())
}

/// Whether the peer `name` was measured (a record of `backend` in the run's JSON): measured
/// and a note saying it was skipped are exclusive, one of them must hold, and any other note
/// about it (a crash, a timeout) fails the test.
fn peer_branch(html: &str, jsonl: &str, name: &str, backend: &str) -> bool {
    let measured = jsonl.contains(&format!("\"backend\":\"{backend}\""));
    let skipped = html.contains(&format!("<li>{name}: skipped: "));
    let failed: Vec<&str> = html
        .lines()
        .filter(|l| l.starts_with(&format!("<li>{name}: ")) && !l.contains(": skipped: "))
        .collect();
    assert!(failed.is_empty(), "{name} failed: {failed:?}");
    assert!(
        measured != skipped,
        "{name} measured or skipped with a reason, not both or neither"
    );
    measured
}

#[test]
fn a_quick_run_writes_a_report_the_browser_renders() {
    let dir = scratch("page");
    let report = dir.join("out");
    let json = dir.join("run.jsonl");
    let o = sluice(&[
        "bench",
        "--quick",
        "raw",
        "transport",
        "pipe",
        "peers",
        "--report",
        report.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let page = report.join("index.html");
    let html = std::fs::read_to_string(&page).unwrap();
    let jsonl = std::fs::read_to_string(&json).unwrap();
    for must in ["CPU", "kernel", "commit", "command", "--report", "raw/shm-pingpong"] {
        assert!(html.contains(must), "the page names {must}");
    }
    // Each peer is measured, or the page says why not; a peer that failed fails the test.
    let mpi_rows = html.contains("peer       openmpi");
    let mpi_note = html.contains("openmpi: skipped");
    assert!(
        mpi_rows != mpi_note,
        "OpenMPI measured or skipped with a reason, not both or neither"
    );
    let torch = peer_branch(&html, &jsonl, "pytorch-rpc", "pytorch-rpc");
    let on_sluice = peer_branch(&html, &jsonl, "pytorch-sluice", "pytorch-sluice-rpc");
    // Under CI's torch venv both must have been measured (SLUICE_REQUIRE_TORCH=1).
    for (name, measured) in [("pytorch-rpc", torch), ("pytorch-sluice", on_sluice)] {
        let probe = if measured {
            Ok(())
        } else {
            Err(format!("{name} was skipped"))
        };
        sluice::channel::cuda::gate::require(&format!("the report's {name} rows"), "SLUICE_REQUIRE_TORCH", probe);
    }
    // PyTorch's rows add the RPC-rate and training-step figures to the size charts.
    let figures: &[&str] = if torch {
        &["rtt.svg", "bw.svg", "rpc.svg", "step.svg"]
    } else {
        &["rtt.svg", "bw.svg"]
    };
    for figure in figures {
        assert!(report.join(figure).is_file(), "{figure} written");
        let id = format!("<figure id=\"{}\">", figure.trim_end_matches(".svg"));
        assert!(html.contains(&id), "{figure} inlined in the page");
    }
    assert_eq!(
        html.matches("<svg").count(),
        figures.len(),
        "one inline <svg> per figure"
    );
    if torch {
        for row in [
            "pytorch-rpc_async-64",
            "pytorch-dist-step-linear1024-b32",
            "pytorch-remote-to_here",
        ] {
            assert!(html.contains(row), "the page's table holds {row}");
        }
    }
    if on_sluice {
        // Each row on Sluice's backend is set against the same row on TensorPipe.
        let compared = jsonl
            .lines()
            .filter(|l| l.contains("\"backend\":\"pytorch-sluice-"))
            .all(|l| l.contains("\"baseline\":\"pytorch-") && l.contains("\"ratio\":"));
        assert!(
            compared,
            "a pytorch-sluice row without its TensorPipe baseline:\n{jsonl}"
        );
    }

    // Compare the run with itself: nothing moved. Then with a copy in which one bandwidth
    // doubled and one row is gone: that row is flagged better, the missing one named.
    let j = json.to_str().unwrap();
    let o = sluice(&["bench", "compare", j, j]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("0 moved by more than 10%"), "{}", text(&o));
    let mut rows: Vec<serde_json::Value> = jsonl.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let bw = rows
        .iter()
        .position(|r| r["metric"] == "bw" && r["gbps"].as_f64().is_some_and(|g| g > 0.0))
        .expect("a bandwidth row");
    let faster = rows[bw]["gbps"].as_f64().unwrap() * 2.0;
    rows[bw]["gbps"] = serde_json::json!(faster);
    let gone = rows.remove(rows.len() - 1);
    let changed = dir.join("changed.jsonl");
    let lines: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
    std::fs::write(&changed, lines.join("\n") + "\n").unwrap();
    let o = sluice(&["bench", "compare", j, changed.to_str().unwrap()]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("1 moved by more than 10%: 1 better, 0 worse"), "{out}");
    let flagged: Vec<&str> = out.lines().filter(|l| l.ends_with("better")).collect();
    assert_eq!(flagged.len(), 1, "{out}");
    assert!(flagged[0].contains(rows[bw]["backend"].as_str().unwrap()), "{out}");
    assert!(flagged[0].contains("+100.0%"), "{out}");
    let only_old = out
        .lines()
        .find(|l| l.starts_with("only in OLD (1 rows): "))
        .unwrap_or_else(|| panic!("{out}"));
    assert!(only_old.contains(gone["backend"].as_str().unwrap()), "{out}");

    let Some(exe) = chromium() else {
        sluice::channel::cuda::gate::skipped(
            "the report's browser half",
            "no chromium on PATH (Debian: apt install chromium)",
        );
        return;
    };
    let shot = dir.join("shot.png");
    let o = browser(
        &exe,
        &[&format!("--screenshot={}", shot.display()), "--window-size=1100,2600"],
        &page,
    );
    assert!(shot.is_file(), "no screenshot: {}", text(&o));
    let (inked, colours) = not_blank(&shot);
    assert!(
        inked > 0.02 && colours > 8,
        "a blank page? {inked:.3} of pixels inked, {colours} colours"
    );
    let o = browser(&exe, &["--dump-dom"], &page);
    let dom = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        dom.matches("<svg").count(),
        figures.len(),
        "the browser's DOM holds every figure"
    );
    eprintln!(
        "screenshot {}: {:.1}% of pixels inked, {colours} colours",
        shot.display(),
        inked * 100.0
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_gets_a_clear_error_naming_it() {
    let dir = scratch("bad");
    let good = dir.join("good.jsonl");
    std::fs::write(
        &good,
        r#"{"suite":"raw","backend":"memcpy","metric":"bw","bytes":8,"gbps":1.0,"iterations":3,"baseline":""}"#,
    )
    .unwrap();
    let foreign = dir.join("foreign.json");
    std::fs::write(&foreign, r#"{"name": "not a bench record"}"#).unwrap();
    let o = sluice(&["bench", "compare", good.to_str().unwrap(), foreign.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(text(&o).contains("foreign.json:1"), "{}", text(&o));
    let o = sluice(&["bench", "compare", good.to_str().unwrap()]);
    assert!(!o.status.success() && text(&o).contains("usage"), "{}", text(&o));

    // A report directory that cannot be created: the error names it, and the JSON asked for
    // is written first.
    let blocker = dir.join("file");
    std::fs::write(&blocker, b"x").unwrap();
    let json = dir.join("kept.jsonl");
    let o = sluice(&[
        "bench",
        "--quick",
        "raw",
        "--report",
        blocker.join("out").to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains(&blocker.display().to_string()), "{}", text(&o));
    assert!(
        std::fs::read_to_string(&json).unwrap().lines().count() > 3,
        "measured results kept"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
