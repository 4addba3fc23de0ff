//! `cargo xtask bench`: the benchmark workloads of docs/performance.md (`cluster-bench`), in
//! release mode against the local services.
//!
//! - `bench [W0|W1|…|W9|all]` (default `all`): each workload in its own process, one
//!   JSON line each on standard output. W0 is W1's baseline without the runtime (a bare tokio
//!   mailbox-and-oneshot echo on the same driver), to read W1 against on the same day.
//! - `bench scaling`: W2 and W3 at 1, 16, 64 and 256 requests in flight, W1 with 1,000,
//!   100,000 and 1,000,000 entities; the lines go to `docs/performance/scaling.jsonl` and the
//!   plots to `docs/performance/*.svg`.
//! - `bench plot`: the plots again from `docs/performance/scaling.jsonl`, without running.
//! - `bench soak [options]`: W3 for ten minutes with message retention at one minute
//!   (`cluster-bench soak`, its options passed through); every line goes to
//!   `docs/performance/soak.jsonl` and the curves of throughput, rows and table size over time
//!   to `docs/performance/soak.svg`.
//! - `bench plot-soak`: `soak.svg` again from `soak.jsonl`, without running.

use std::env;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, anyhow, bail};
use plotters::prelude::*;
use serde_json::Value;

/// The workloads `all` runs, in order.
pub(crate) const WORKLOADS: [&str; 14] =
    ["W0", "W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8", "W9", "W2S", "W3S", "W3C", "W6S"];

/// Where `bench scaling` writes its results and plots, under the workspace root.
const OUTPUT: &str = "docs/performance";

/// The scaling runs: `(workload, extra arguments)`.
fn scaling_runs() -> Vec<(&'static str, Vec<String>)> {
    let mut runs = Vec::new();
    for workload in ["W2", "W3"] {
        for in_flight in [1, 16, 64, 256] {
            // One request in flight waits for every commit: fewer requests keep it short.
            let ops = if in_flight == 1 { 2_000 } else { 20_000 };
            let args =
                vec!["--in-flight".into(), in_flight.to_string(), "--ops".into(), ops.to_string()];
            runs.push((workload, args));
        }
    }
    for entities in [1_000, 100_000, 1_000_000] {
        // Every entity gets requests (and stays resident): at least one request each.
        let ops: u32 = entities.max(100_000);
        let args = vec!["--entities".into(), entities.to_string(), "--ops".into(), ops.to_string()];
        runs.push(("W1", args));
    }
    runs
}

/// Runs `cargo xtask bench <args>` from the workspace root.
pub(crate) fn run(root: &Path, args: &[String], service_env: &[(&str, &str)]) -> Result<()> {
    env::set_current_dir(root).with_context(|| format!("cannot enter {}", root.display()))?;
    match args.first().map(String::as_str) {
        None | Some("all") => {
            build()?;
            for workload in WORKLOADS {
                say(&workload_line(workload, &[], service_env)?);
            }
            Ok(())
        }
        Some("scaling") => {
            build()?;
            let mut lines = Vec::new();
            for (workload, extra) in scaling_runs() {
                let line = workload_line(workload, &extra, service_env)?;
                say(&line);
                lines.push(line);
            }
            let output = root.join(OUTPUT);
            fs::create_dir_all(&output)?;
            fs::write(output.join("scaling.jsonl"), lines.join("\n") + "\n")?;
            plot_all(&output)
        }
        Some("plot") => plot_all(&root.join(OUTPUT)),
        Some("soak") => {
            build()?;
            let lines = soak_lines(&args[1..], service_env)?;
            let output = root.join(OUTPUT);
            fs::create_dir_all(&output)?;
            fs::write(output.join("soak.jsonl"), lines.join("\n") + "\n")?;
            plot_soak_file(&output)
        }
        Some("plot-soak") => plot_soak_file(&root.join(OUTPUT)),
        Some(name) if WORKLOADS.iter().any(|w| w.eq_ignore_ascii_case(name)) => {
            build()?;
            say(&workload_line(&name.to_ascii_uppercase(), &args[1..], service_env)?);
            Ok(())
        }
        Some(other) => {
            bail!("unknown benchmark `{other}`: W0 … W9, all, scaling, plot, soak or plot-soak")
        }
    }
}

fn cargo() -> String {
    env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned())
}

fn build() -> Result<()> {
    crate::step("build cluster-bench", &["build", "--release", "--package", "cluster-bench"], &[])
}

/// Runs one workload in its own process and returns its JSON line.
fn workload_line(workload: &str, extra: &[String], service_env: &[(&str, &str)]) -> Result<String> {
    crate::report(&format!("==> bench {workload} {}", extra.join(" ")));
    let output = Command::new(cargo())
        .args(["run", "--quiet", "--release", "--package", "cluster-bench", "--", workload])
        .args(extra)
        .envs(service_env.iter().copied())
        .output()
        .with_context(|| format!("cannot run cluster-bench {workload}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!("{workload} failed: {}{stdout}", String::from_utf8_lossy(&output.stderr));
    }
    let line = stdout.lines().last().unwrap_or_default().to_owned();
    serde_json::from_str::<Value>(&line)
        .with_context(|| format!("{workload} printed no JSON line: {stdout}"))?;
    Ok(line)
}

/// Runs `cluster-bench soak <extra>` and returns every line it printed, each passed on to
/// standard output as it comes (the run takes minutes).
fn soak_lines(extra: &[String], service_env: &[(&str, &str)]) -> Result<Vec<String>> {
    crate::report(&format!("==> bench soak {}", extra.join(" ")));
    let mut child = Command::new(cargo())
        .args(["run", "--quiet", "--release", "--package", "cluster-bench", "--", "soak"])
        .args(extra)
        .envs(service_env.iter().copied())
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot run cluster-bench soak")?;
    let stdout = child.stdout.take().context("cluster-bench soak has no standard output")?;
    let mut lines = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.context("cannot read cluster-bench soak's output")?;
        if line.trim().is_empty() {
            continue;
        }
        say(&line);
        serde_json::from_str::<Value>(&line)
            .with_context(|| format!("soak printed a line that is not JSON: {line}"))?;
        lines.push(line);
    }
    let status = child.wait().context("cannot wait for cluster-bench soak")?;
    if !status.success() {
        bail!("soak failed ({status}); its errors are above");
    }
    if !lines.iter().any(|line| line.contains("\"summary\"")) {
        bail!("soak printed no summary line");
    }
    Ok(lines)
}

#[expect(clippy::print_stdout, reason = "the benchmark lines are xtask's output")]
fn say(line: &str) {
    println!("{line}");
}

/// Reads `scaling.jsonl` in `dir` and draws its plots there.
fn plot_all(dir: &Path) -> Result<()> {
    let text = read_results(dir, "scaling.jsonl", "cargo xtask bench scaling")?;
    let rows = parse_rows(&text)?;
    plot(dir, &rows)?;
    crate::report(&format!("==> plots written to {}", dir.display()));
    Ok(())
}

/// One result line, the fields the plots use.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Row {
    pub(crate) workload: String,
    pub(crate) in_flight: f64,
    pub(crate) entities: f64,
    pub(crate) ops_per_s: f64,
    pub(crate) p99_ms: f64,
    pub(crate) peak_rss_mb: f64,
}

/// One line of a JSON-lines results file: its number (from 1) and its value.
struct JsonLine {
    number: usize,
    value: Value,
}

impl JsonLine {
    /// The number field `name`.
    fn number(&self, name: &str) -> Result<f64> {
        self.value[name].as_f64().ok_or_else(|| anyhow!("line {}: no number `{name}`", self.number))
    }
}

/// The non-blank lines of a JSON-lines results file, parsed.
fn json_lines(text: &str) -> Result<Vec<JsonLine>> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(index, line)| {
            let value = serde_json::from_str(line)
                .with_context(|| format!("line {} is not JSON", index + 1))?;
            Ok(JsonLine { number: index + 1, value })
        })
        .collect()
}

/// The results file `name` in `dir`; its error names the command that writes it.
fn read_results(dir: &Path, name: &str, command: &str) -> Result<String> {
    let path = dir.join(name);
    fs::read_to_string(&path)
        .with_context(|| format!("cannot read {} (run `{command}`)", path.display()))
}

pub(crate) fn parse_rows(text: &str) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    for line in json_lines(text)? {
        let field = |name: &str| line.number(name);
        rows.push(Row {
            workload: line.value["workload"]
                .as_str()
                .ok_or_else(|| anyhow!("line {}: no `workload`", line.number))?
                .to_owned(),
            in_flight: field("in_flight")?,
            entities: field("entities")?,
            ops_per_s: field("ops_per_s")?,
            p99_ms: field("p99_ms")?,
            peak_rss_mb: field("peak_rss_mb")?,
        });
    }
    Ok(rows)
}

/// A line of a plot: its label, colour and points.
struct Series {
    label: &'static str,
    colour: RGBColor,
    points: Vec<(f64, f64)>,
}

/// Draws `inflight-throughput.svg`, `inflight-p99.svg` and `entities-memory.svg` into `dir`.
pub(crate) fn plot(dir: &Path, rows: &[Row]) -> Result<()> {
    let by = |workload: &str, x: fn(&Row) -> f64, y: fn(&Row) -> f64| -> Vec<(f64, f64)> {
        let mut points: Vec<(f64, f64)> = rows
            .iter()
            .filter(|row| row.workload == workload)
            .map(|row| (x(row), y(row)))
            .collect();
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        points
    };
    let persisted = |y: fn(&Row) -> f64| {
        vec![
            Series { label: "W2 SQLite", colour: BLUE, points: by("W2", |r| r.in_flight, y) },
            Series { label: "W3 PostgreSQL", colour: RED, points: by("W3", |r| r.in_flight, y) },
        ]
    };
    draw(
        &dir.join("inflight-throughput.svg"),
        "Persisted requests: throughput",
        ("requests in flight", "requests/s"),
        &persisted(|r| r.ops_per_s),
    )?;
    draw(
        &dir.join("inflight-p99.svg"),
        "Persisted requests: p99 latency",
        ("requests in flight", "p99 (ms)"),
        &persisted(|r| r.p99_ms),
    )?;
    draw(
        &dir.join("entities-memory.svg"),
        "W1: peak resident memory",
        ("resident entities", "peak RSS (MiB)"),
        &[Series {
            label: "W1",
            colour: BLUE,
            points: by("W1", |r| r.entities, |r| r.peak_rss_mb),
        }],
    )
}

/// One chart with a logarithmic x axis.
fn draw(path: &Path, title: &str, axes: (&str, &str), series: &[Series]) -> Result<()> {
    let points = || series.iter().flat_map(|series| series.points.iter());
    let x_max = points().map(|p| p.0).fold(1.0, f64::max);
    let y_max = points().map(|p| p.1).fold(0.0, f64::max) * 1.1;
    if points().next().is_none() {
        bail!("no data for {}", path.display());
    }
    let fail = |error: &dyn std::fmt::Display| anyhow!("cannot draw {}: {error}", path.display());
    let area = SVGBackend::new(path, (720, 420)).into_drawing_area();
    area.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut chart = ChartBuilder::on(&area)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((1f64..x_max * 1.2).log_scale(), 0f64..y_max.max(1.0))
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc(axes.0)
        .y_desc(axes.1)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(|e| fail(&e))?;
    for line in series {
        let colour = line.colour;
        chart
            .draw_series(LineSeries::new(line.points.clone(), colour.stroke_width(2)))
            .map_err(|e| fail(&e))?
            .label(line.label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
        let marks = line.points.iter().map(|point| Circle::new(*point, 3, colour.filled()));
        chart.draw_series(marks).map_err(|e| fail(&e))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(|e| fail(&e))?;
    area.present().map_err(|e| fail(&e))?;
    Ok(())
}

/// Reads `soak.jsonl` in `dir` and draws `soak.svg` there.
fn plot_soak_file(dir: &Path) -> Result<()> {
    let text = read_results(dir, "soak.jsonl", "cargo xtask bench soak")?;
    let samples = parse_soak(&text)?;
    let svg = dir.join("soak.svg");
    plot_soak(&svg, &samples)?;
    crate::report(&format!("==> plot written to {}", svg.display()));
    Ok(())
}

/// One sample line of a soak run, the fields its plot uses.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct SoakSample {
    pub(crate) t_s: f64,
    pub(crate) ops_per_s: f64,
    pub(crate) messages: f64,
    pub(crate) replies: f64,
    pub(crate) table_bytes: f64,
}

/// The sample lines of a soak run (`"kind":"sample"`); the summary line is checked to be
/// one and skipped.
pub(crate) fn parse_soak(text: &str) -> Result<Vec<SoakSample>> {
    let mut samples = Vec::new();
    for line in json_lines(text)? {
        let field = |name: &str| line.number(name);
        match line.value["kind"].as_str() {
            Some("sample") => samples.push(SoakSample {
                t_s: field("t_s")?,
                ops_per_s: field("ops_per_s")?,
                messages: field("messages")?,
                replies: field("replies")?,
                table_bytes: field("table_bytes")?,
            }),
            Some("summary") => {}
            _ => bail!("line {}: neither a sample nor the summary", line.number),
        }
    }
    if samples.is_empty() {
        bail!("no sample lines");
    }
    Ok(samples)
}

/// Draws the soak's three charts, one above the other, into the SVG file `path`: throughput,
/// rows, and the tables' size on disk, each against time.
pub(crate) fn plot_soak(path: &Path, samples: &[SoakSample]) -> Result<()> {
    let points = |y: fn(&SoakSample) -> f64| -> Vec<(f64, f64)> {
        samples.iter().map(|sample| (sample.t_s, y(sample))).collect()
    };
    let fail = |error: &dyn std::fmt::Display| anyhow!("cannot draw {}: {error}", path.display());
    let area = SVGBackend::new(path, (720, 960)).into_drawing_area();
    area.fill(&WHITE).map_err(|e| fail(&e))?;
    let panels = area.split_evenly((3, 1));
    let [throughput, rows, size] = panels.as_slice() else {
        bail!("cannot draw {}: three panels expected", path.display());
    };
    draw_over_time(
        throughput,
        "Soak: W3 with retention, throughput",
        "requests/s",
        &[Series { label: "requests/s", colour: BLUE, points: points(|s| s.ops_per_s) }],
    )
    .map_err(|e| fail(&e))?;
    draw_over_time(
        rows,
        "Rows",
        "rows",
        &[
            Series { label: "messages", colour: RED, points: points(|s| s.messages) },
            Series { label: "replies", colour: GREEN, points: points(|s| s.replies) },
        ],
    )
    .map_err(|e| fail(&e))?;
    draw_over_time(
        size,
        "Size on disk (messages and replies, with indexes)",
        "MiB",
        &[Series {
            label: "MiB",
            colour: MAGENTA,
            points: points(|s| s.table_bytes / (1024.0 * 1024.0)),
        }],
    )
    .map_err(|e| fail(&e))?;
    area.present().map_err(|e| fail(&e))?;
    Ok(())
}

/// One chart on `area` with a linear time axis in seconds.
fn draw_over_time(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    title: &str,
    y_desc: &str,
    series: &[Series],
) -> Result<()> {
    let points = || series.iter().flat_map(|series| series.points.iter());
    let x_max = points().map(|p| p.0).fold(1.0, f64::max);
    let y_max = points().map(|p| p.1).fold(0.0, f64::max) * 1.1;
    let fail = |error: &dyn std::fmt::Display| anyhow!("{title}: {error}");
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(0f64..x_max, 0f64..y_max.max(1.0))
        .map_err(|e| fail(&e))?;
    chart
        .configure_mesh()
        .x_desc("time (s)")
        .y_desc(y_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(|e| fail(&e))?;
    for line in series {
        let colour = line.colour;
        chart
            .draw_series(LineSeries::new(line.points.clone(), colour.stroke_width(2)))
            .map_err(|e| fail(&e))?
            .label(line.label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(|e| fail(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINES: &str = r#"{"entities":1000,"in_flight":1,"ops":2000,"ops_per_s":900.0,"p50_ms":1.0,"p99_ms":2.5,"peak_rss_mb":20.0,"seconds":2.2,"storage":"sqlite","workload":"W2"}
{"entities":1000,"in_flight":64,"ops":20000,"ops_per_s":7000.0,"p50_ms":8.0,"p99_ms":20.0,"peak_rss_mb":26.0,"seconds":2.8,"storage":"sqlite","workload":"W2"}
{"entities":1000,"in_flight":64,"ops":20000,"ops_per_s":3000.0,"p50_ms":17.0,"p99_ms":50.0,"peak_rss_mb":23.0,"seconds":6.6,"storage":"postgres","workload":"W3"}

{"entities":1000000,"in_flight":256,"ops":1000000,"ops_per_s":250000.0,"p50_ms":0.2,"p99_ms":3.0,"peak_rss_mb":900.0,"seconds":4.0,"storage":"memory","workload":"W1"}
"#;

    #[test]
    fn result_lines_are_read_and_bad_ones_named() {
        let rows = parse_rows(LINES).unwrap();
        assert_eq!(rows.len(), 4);
        assert_eq!(rows[3].workload, "W1");
        assert!((rows[3].peak_rss_mb - 900.0).abs() < 1e-9);
        let error = parse_rows("{\"workload\":\"W1\"}").unwrap_err().to_string();
        assert!(error.contains("line 1: no number `in_flight`"), "{error}");
        assert!(parse_rows("not json").unwrap_err().to_string().contains("line 1 is not JSON"));
    }

    #[test]
    fn the_plots_are_svg_files_with_their_series() {
        let dir = env::temp_dir().join(format!("xtask-bench-plot-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        plot(&dir, &parse_rows(LINES).unwrap()).unwrap();
        let throughput = fs::read_to_string(dir.join("inflight-throughput.svg")).unwrap();
        assert!(throughput.starts_with("<svg"));
        assert!(throughput.contains("W2 SQLite") && throughput.contains("W3 PostgreSQL"));
        let memory = fs::read_to_string(dir.join("entities-memory.svg")).unwrap();
        assert!(memory.contains("peak RSS (MiB)"));
        fs::remove_dir_all(&dir).unwrap();
    }

    const SOAK: &str = r#"{"kind":"sample","t_s":10.0,"ops":90000,"ops_per_s":9000.0,"p99_ms":20.1,"messages":90000,"replies":90000,"table_bytes":52428800,"dead_rows":0,"rss_mb":40.2}
{"kind":"sample","t_s":20.0,"ops":88000,"ops_per_s":8800.0,"p99_ms":21.0,"messages":178000,"replies":178000,"table_bytes":104857600,"dead_rows":12,"rss_mb":41.0}

{"kind":"summary","workload":"soak","ops":178000,"ops_per_s":8900.0}
"#;

    #[test]
    fn soak_lines_are_read_and_drawn_into_one_svg() {
        let samples = parse_soak(SOAK).unwrap();
        assert_eq!(samples.len(), 2);
        assert!((samples[1].messages - 178_000.0).abs() < 1e-9);
        assert!((samples[0].table_bytes - 52_428_800.0).abs() < 1e-9);
        let error = parse_soak("{\"kind\":\"sample\",\"t_s\":1}").unwrap_err().to_string();
        assert!(error.contains("line 1: no number `ops_per_s`"), "{error}");
        let error = parse_soak("{\"workload\":\"W3\"}").unwrap_err().to_string();
        assert!(error.contains("neither a sample nor the summary"), "{error}");
        assert!(parse_soak("").unwrap_err().to_string().contains("no sample lines"));

        let dir = env::temp_dir().join(format!("xtask-bench-soak-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("soak.svg");
        plot_soak(&path, &samples).unwrap();
        let svg = fs::read_to_string(&path).unwrap();
        assert!(svg.starts_with("<svg"));
        for text in ["requests/s", "messages", "replies", "MiB", "time (s)"] {
            assert!(svg.contains(text), "no `{text}` in the plot");
        }
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn every_scaling_run_names_a_workload_the_binary_knows() {
        let runs = scaling_runs();
        assert_eq!(runs.len(), 11);
        assert!(runs.iter().all(|(workload, _)| WORKLOADS.contains(workload)));
        // The million-entity run sends at least a request to each entity.
        let (_, last) = runs.last().unwrap();
        assert_eq!(last, &["--entities", "1000000", "--ops", "1000000"]);
    }
}
