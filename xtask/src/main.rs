//! Automation for this workspace: `cargo xtask <command>`.
//!
//! - `ci`: everything CI checks, in order: formatting, clippy (all targets, then each storage
//!   feature on its own), the database services, all tests, the quickstart, the crash-restart
//!   check, the saga, streaming and cron examples, schemathesis against the HTTP gateway example, a smoke run of the
//!   benchmark workloads, the simulation, the fault test, the three-runner example,
//!   documentation (every feature, then the facade's default, `rpc` and `ops` builds).
//! - `schemathesis`: requests generated from the HTTP gateway example's OpenAPI document
//!   (also run by `ci`); none may answer a 5xx.
//! - `tidy`: the repository rules that are not compiler lints (also run as tests by `ci`).
//! - `chaos`: the fault test across processes on PostgreSQL (`cluster-chaos`; also run by
//!   `ci`): runners killed, frozen, joining and leaving under traffic, with message retention
//!   at 30 s; then failovers after SIGKILL with the default settings, in both lock modes.
//!   `chaos --failover` runs only the failovers (`--kills N` per lock mode, 3 unless given).
//! - `sim`: the simulated cluster over seeds (`--seeds N`, `--from S`) or one seed with its
//!   trace (`--seed S`); each seed runs twice and must give the same history (also run by
//!   `ci`, 200 seeds).
//!
//! - `fuzz [--seconds N] [TARGET...]`: the coverage-guided fuzz targets of `fuzz/` (libFuzzer),
//!   each for `N` seconds (60 unless given); `ci` runs each for 5 s (see the `fuzz` module).
//! - `config-doc`: writes `docs/configuration.md`, the configuration reference, from the
//!   documentation of `ShardingConfig` (a test fails when it is stale).
//! - `bench [W0|…|W9|W2S|W3S|W3C|W6S|all|scaling|plot|soak|plot-soak]`: the benchmark workloads
//!   in release mode against the local services, the scaling runs and their plots, and the
//!   ten-minute soak with retention and its plot (see `bench`, docs/performance.md); not part
//!   of `ci`.
//!
//! Automation is written in Rust so that it runs wherever cargo does.

mod bench;
mod config_doc;
mod fuzz;
mod tidy;

use std::env;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// The storage features of `cluster-storage-sql`; clippy checks each on its own.
const STORAGE_FEATURES: [&str; 3] = ["postgres", "mysql", "sqlite"];

/// Feature sets of `durable-cluster` whose docs `ci` builds besides the workspace's with every
/// feature: the default, the transport without `ops`, and `ops` without `otel`.
const FACADE_DOC_FEATURES: [&str; 3] = ["default", "rpc", "ops"];

/// A database service the test suite uses: its URL variable, default URL and TCP address.
struct Service {
    name: &'static str,
    url_variable: &'static str,
    default_url: &'static str,
    address: &'static str,
}

const SERVICES: [Service; 2] = [
    Service {
        name: "PostgreSQL",
        url_variable: "CLUSTER_TEST_POSTGRES_URL",
        default_url: "postgres://postgres@127.0.0.1:5432/test",
        address: "127.0.0.1:5432",
    },
    Service {
        name: "MySQL (MariaDB)",
        url_variable: "CLUSTER_TEST_MYSQL_URL",
        default_url: "mysql://root@127.0.0.1:3306/test",
        address: "127.0.0.1:3306",
    },
];

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("tidy") => tidy::run(&workspace_root()),
        Some("chaos") => chaos(&args[1..]),
        Some("schemathesis") => env::set_current_dir(workspace_root())
            .context("cannot enter the workspace")
            .and_then(|()| build_binaries())
            .and_then(|()| gateway_schemathesis()),
        Some("sim") => sim(&args[1..]),
        Some("bench") => bench(&args[1..]),
        Some("config-doc") => config_doc::run(&workspace_root()),
        Some("fuzz") => fuzz::run(&workspace_root(), &args[1..]),
        _ => {
            usage();
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            report(&format!("xtask: {error:#}"));
            ExitCode::FAILURE
        }
    }
}

fn usage() {
    report(
        "usage: cargo xtask <ci | tidy | chaos [--failover [--kills N]] | schemathesis | sim [--seeds N] [--from S] [--classic|--extended|--graceful] | sim --seed S [--trace] [--classic|--extended|--graceful] | bench [W0|W1|W2|W3|W4|W5|W6|W7|W8|W9|W2S|W3S|W3C|W6S|all|scaling|plot|soak [--seconds N] [--retention-seconds R] [--sample-seconds S] [--in-flight N] [--entities N] [--no-vacuum]|plot-soak] | fuzz [--seconds N] [TARGET...] | config-doc>",
    );
}

#[expect(clippy::print_stderr, reason = "xtask reports to the terminal")]
pub(crate) fn report(message: &str) {
    eprintln!("{message}");
}

fn workspace_root() -> PathBuf {
    // xtask/Cargo.toml sits one level below the workspace root.
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(|| PathBuf::from("."), Path::to_path_buf)
}

fn ci() -> Result<()> {
    let root = workspace_root();
    env::set_current_dir(&root).with_context(|| format!("cannot enter {}", root.display()))?;
    step("format", &["fmt", "--all", "--", "--check"], &[])?;
    step(
        "clippy",
        &["clippy", "--workspace", "--all-targets", "--all-features", "--", "-D", "warnings"],
        &[],
    )?;
    for feature in STORAGE_FEATURES {
        step(
            &format!("clippy cluster-storage-sql --features {feature}"),
            &[
                "clippy",
                "--package",
                "cluster-storage-sql",
                "--no-default-features",
                "--features",
                feature,
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ],
            &[],
        )?;
    }
    let mut service_env = services()?;
    service_env.extend(browser()?);
    let service_env: Vec<(&str, &str)> =
        service_env.iter().map(|(name, value)| (*name, value.as_str())).collect();
    typescript_packages()?;
    if has_nextest() {
        step(
            "tests",
            &["nextest", "run", "--workspace", "--all-features", "--no-fail-fast"],
            &service_env,
        )?;
        step("doc tests", &["test", "--workspace", "--all-features", "--doc"], &service_env)?;
    } else {
        step("tests", &["test", "--workspace", "--all-features", "--no-fail-fast"], &service_env)?;
    }
    // The README's first command, in a debug build: it asserts its own outcome.
    step("quickstart", &["run", "--example", "quickstart"], &[])?;
    // The other examples, binaries and processes run from one build with every feature, the
    // test build's: a `cargo run` per package would build the workspace again for each
    // package's own set of features.
    build_binaries()?;
    // A runner killed part-way and started again: every request answered exactly once.
    run_built("crash_restart", "examples/crash_restart", &[], &[])?;
    // The workflow issue's example: it asserts the compensations ran in reverse order, once.
    run_built("saga", "examples/saga", &[], &[])?;
    // The streaming and cron examples check their own outcome too.
    run_built("streaming", "examples/streaming", &[], &[])?;
    run_built("cron", "examples/cron_singleton", &[], &[])?;
    gateway_schemathesis()?;
    bench_smoke(&service_env)?;
    sim(&["--seeds".to_owned(), "200".to_owned()])?;
    // Graceful faults only: every handler runs exactly once, in storage order.
    sim(&["--seeds".to_owned(), "100".to_owned(), "--graceful".to_owned()])?;
    chaos_with(&service_env)?;
    three_runners(&service_env)?;
    // A short pass of every fuzz target; `cargo xtask fuzz` runs them longer.
    fuzz::run(&root, &["--seconds".to_owned(), "5".to_owned()])?;
    env::set_current_dir(&root).with_context(|| format!("cannot enter {}", root.display()))?;
    step(
        "docs",
        &["doc", "--workspace", "--all-features", "--no-deps"],
        &[("RUSTDOCFLAGS", "-D warnings")],
    )?;
    // A link to an item behind a feature breaks the docs of a build without it; these are the
    // builds a user's `cargo doc` most often makes.
    for features in FACADE_DOC_FEATURES {
        step(
            &format!("docs of durable-cluster with the features {features}"),
            &["doc", "--package", "durable-cluster", "--no-deps", "--features", features],
            &[("RUSTDOCFLAGS", "-D warnings")],
        )?;
    }
    report("xtask ci: all steps passed");
    Ok(())
}

/// `cargo xtask sim [--seeds N] [--from S] | [--seed S [--trace]] [--classic | --extended |
/// --graceful]`: the simulated cluster
/// (`cluster_testkit::sim`), built with `--cfg tokio_unstable` so that tokio's own random
/// choices follow the seed too, in a target directory of its own (the flag changes every
/// crate's build). Each seed runs twice and the histories must match.
fn sim(args: &[String]) -> Result<()> {
    let root = workspace_root();
    env::set_current_dir(&root).with_context(|| format!("cannot enter {}", root.display()))?;
    let target = sibling_target_dir("sim").display().to_string();
    let mut cargo_args = vec![
        "run",
        "--package",
        "cluster-testkit",
        "--features",
        "workflow",
        "--example",
        "sim",
        "--",
    ];
    cargo_args.extend(args.iter().map(String::as_str));
    // Optimized a little (`opt-level = 1`): the seeds run several times faster than in a
    // plain debug build, and the build of its own directory costs little more.
    step(
        "sim",
        &cargo_args,
        &[
            ("RUSTFLAGS", "--cfg tokio_unstable"),
            ("CARGO_TARGET_DIR", target.as_str()),
            ("CARGO_PROFILE_DEV_OPT_LEVEL", "1"),
        ],
    )
}

/// `cargo xtask chaos`: the fault test across processes, on PostgreSQL.
/// The benchmark workloads, tiny and in a debug build, so that they keep running end to end
/// (the measurements are `cargo xtask bench`'s). The PostgreSQL ones need PostgreSQL.
fn bench_smoke(service_env: &[(&str, &str)]) -> Result<()> {
    let postgres = service_env.iter().any(|(name, _)| *name == "CLUSTER_TEST_POSTGRES_URL");
    for workload in bench::WORKLOADS {
        if !postgres
            && matches!(workload, "W3" | "W5" | "W6" | "W7" | "W8" | "W9" | "W3S" | "W3C" | "W6S")
        {
            report(&format!("==> bench {workload} (smoke): skipped, PostgreSQL is not reachable"));
            continue;
        }
        run_built(
            &format!("bench {workload} (smoke)"),
            "cluster-bench",
            &[workload, "--ops", "200"],
            service_env,
        )?;
    }
    Ok(())
}

/// The three-process cluster example on the PostgreSQL of `service_env` (it checks its own
/// outcome); skipped when PostgreSQL is not reachable outside CI.
fn three_runners(service_env: &[(&str, &str)]) -> Result<()> {
    let Some((_, url)) = service_env.iter().find(|(name, _)| *name == "CLUSTER_TEST_POSTGRES_URL")
    else {
        report("==> three runners: skipped, PostgreSQL is not reachable");
        return Ok(());
    };
    run_built(
        "three runners",
        "examples/three_runners",
        &[],
        &[("CLUSTER_EXAMPLE_POSTGRES_URL", url)],
    )
}

/// `cargo xtask bench …` with the services' URLs (see the `bench` module).
fn bench(args: &[String]) -> Result<()> {
    let service_env = services()?;
    let service_env: Vec<(&str, &str)> =
        service_env.iter().map(|(name, value)| (*name, value.as_str())).collect();
    bench::run(&workspace_root(), args, &service_env)
}

fn chaos(args: &[String]) -> Result<()> {
    let root = workspace_root();
    env::set_current_dir(&root).with_context(|| format!("cannot enter {}", root.display()))?;
    let service_env = services()?;
    let service_env: Vec<(&str, &str)> =
        service_env.iter().map(|(name, value)| (*name, value.as_str())).collect();
    build_binaries()?;
    match args {
        [] => chaos_with(&service_env),
        [flag] if flag == "--failover" => failover_with(&service_env, None),
        [flag, kills, count] if flag == "--failover" && kills == "--kills" => {
            let count: usize =
                count.parse().with_context(|| format!("--kills {count:?} is not a number"))?;
            failover_with(&service_env, Some(count))
        }
        _ => {
            usage();
            bail!("unknown arguments to chaos: {args:?}")
        }
    }
}

/// The failovers after SIGKILL with the default settings (`chaos failover`), on the PostgreSQL
/// of `service_env`; `kills` per lock mode (3 unless given). The chaos binary comes from
/// [`build_binaries`].
fn failover_with(service_env: &[(&str, &str)], kills: Option<usize>) -> Result<()> {
    let Some((_, url)) = service_env.iter().find(|(name, _)| *name == "CLUSTER_TEST_POSTGRES_URL")
    else {
        report("==> chaos failover: skipped, PostgreSQL is not reachable");
        return Ok(());
    };
    let kills = kills.unwrap_or(3).to_string();
    run_built(
        "chaos failover",
        "chaos",
        &["failover"],
        &[("CLUSTER_CHAOS_POSTGRES_URL", url), ("CHAOS_FAILOVER_KILLS", kills.as_str())],
    )
}

/// Runs the fault test on the PostgreSQL of `service_env`; skipped (with a message) when
/// PostgreSQL is not reachable outside CI (`services` already failed the run under CI). The
/// chaos binary comes from [`build_binaries`].
fn chaos_with(service_env: &[(&str, &str)]) -> Result<()> {
    let Some((_, url)) = service_env.iter().find(|(name, _)| *name == "CLUSTER_TEST_POSTGRES_URL")
    else {
        report("==> chaos: skipped, PostgreSQL is not reachable");
        return Ok(());
    };
    run_built("chaos", "chaos", &["run"], &[("CLUSTER_CHAOS_POSTGRES_URL", url)])?;
    failover_with(service_env, None)
}

/// Runs `cargo <args>` with extra environment variables; a non-zero exit fails the step.
pub(crate) fn step(name: &str, args: &[&str], envs: &[(&str, &str)]) -> Result<()> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    run_step(name, Path::new(&cargo), args, envs)
}

/// Runs `program` with `args` and extra environment variables as the step `name`, reporting
/// the command and its time; a non-zero exit fails the step.
fn run_step(name: &str, program: &Path, args: &[&str], envs: &[(&str, &str)]) -> Result<()> {
    report(&format!("==> {name}: {} {}", program.display(), args.join(" ")));
    let began = started();
    let status = Command::new(program)
        .args(args)
        .envs(envs.iter().copied())
        .status()
        .with_context(|| format!("cannot run {} for step `{name}`", program.display()))?;
    if !status.success() {
        bail!("step `{name}` failed ({status})");
    }
    report(&format!("<== {name}: {:.0} s", began.elapsed().as_secs_f64()));
    Ok(())
}

/// Now, for a step's duration (the workspace's clock rule is for the runtime's determinism;
/// automation times its own steps).
#[expect(clippy::disallowed_methods, reason = "a step's wall-clock duration, for its report")]
fn started() -> std::time::Instant {
    std::time::Instant::now()
}

/// The target directory cargo builds into (`CARGO_TARGET_DIR`, or `target` at the root).
fn target_dir() -> PathBuf {
    env::var_os("CARGO_TARGET_DIR").map_or_else(|| workspace_root().join("target"), PathBuf::from)
}

/// A target directory of its own for builds with other flags, beside the usual one:
/// `<CARGO_TARGET_DIR>-<name>`, or `target/<name>` at the root.
pub(crate) fn sibling_target_dir(name: &str) -> PathBuf {
    match env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(format!("{}-{name}", PathBuf::from(dir).display())),
        None => workspace_root().join("target").join(name),
    }
}

/// Builds every binary and example of the workspace with every feature, in the debug build
/// the tests use: the same features as the test build, so nothing is compiled twice.
fn build_binaries() -> Result<()> {
    step(
        "binaries and examples",
        &["build", "--quiet", "--workspace", "--all-features", "--bins", "--examples"],
        &[],
    )
}

/// Runs `target/debug/<path>` (built by [`build_binaries`]) with `args` and extra environment
/// variables; a non-zero exit fails the step.
fn run_built(name: &str, path: &str, args: &[&str], envs: &[(&str, &str)]) -> Result<()> {
    run_step(name, &target_dir().join("debug").join(path), args, envs)
}

/// The version of schemathesis that `gateway_schemathesis` installs.
const SCHEMATHESIS: &str = "4.32.5";

/// Requests generated from the OpenAPI document of the `http_gateway` example (built by
/// [`build_binaries`]) by schemathesis (from PyPI, installed in a virtual environment under the
/// cache folder) against the running example: none may answer a 5xx. Without Python or PyPI the step is reported and skipped,
/// except under `CI=true`, where it fails.
fn gateway_schemathesis() -> Result<()> {
    let schemathesis = match schemathesis_venv() {
        Ok(schemathesis) => schemathesis,
        Err(error) if env::var("CI").as_deref() != Ok("true") => {
            report(&format!("==> schemathesis: skipped, {error:#}"));
            return Ok(());
        }
        Err(error) => bail!("CI=true and schemathesis cannot be installed: {error:#}"),
    };
    let binary = target_dir().join("debug/examples/http_gateway");
    let mut gateway = Command::new(&binary)
        .envs([
            ("CLUSTER_HTTP_BEARER_TOKEN", SCHEMATHESIS_TOKEN),
            ("GATEWAY_LISTEN", "127.0.0.1:0"),
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {}", binary.display()))?;
    let address = listening_address(&mut gateway);
    let outcome = address.and_then(|address| {
        let url = format!("http://{address}/api");
        report(&format!("==> schemathesis {SCHEMATHESIS} against {url}"));
        // Its own state (`.hypothesis`) goes to a temporary folder, not the checkout.
        let work = env::temp_dir().join(format!("schemathesis-{}", std::process::id()));
        std::fs::create_dir_all(&work)?;
        let run = Command::new(&schemathesis)
            .current_dir(&work)
            .args(["run", &format!("{url}/openapi.json"), "--url", &url])
            .args(["-H", &format!("Authorization: Bearer {SCHEMATHESIS_TOKEN}")])
            .args(["--checks", "not_a_server_error", "--max-examples", "100", "--seed", "1"])
            .spawn()
            .context("cannot run schemathesis")
            .and_then(|child| wait_within(child, SCHEMATHESIS_DEADLINE, "schemathesis"));
        let _ = std::fs::remove_dir_all(&work);
        let status = run?;
        if !status.success() {
            bail!("schemathesis found answers with a 5xx status ({status})");
        }
        Ok(())
    });
    // Ctrl-C: the example stops its runner and removes its database file.
    let _ = Command::new("kill").args(["-INT", &gateway.id().to_string()]).status();
    wait_within(gateway, std::time::Duration::from_secs(30), "the http_gateway example")?;
    outcome
}

/// How long the `http_gateway` example may take to listen.
const GATEWAY_START_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);
/// The example gateway's bearer token during schemathesis' run (a token has at least 32
/// characters).
const SCHEMATHESIS_TOKEN: &str = "schemathesis-token-0123456789abcdef";

/// How long schemathesis may run (it takes seconds).
const SCHEMATHESIS_DEADLINE: std::time::Duration = std::time::Duration::from_secs(600);

/// The address the `http_gateway` example prints once it listens, within
/// `GATEWAY_START_DEADLINE`.
fn listening_address(gateway: &mut std::process::Child) -> Result<String> {
    use std::io::BufRead;
    let stdout = gateway.stdout.take().context("no output from the example")?;
    let (sender, receiver) = std::sync::mpsc::sync_channel(1);
    // The reader ends with the example's output; it is not joined.
    std::thread::spawn(move || {
        let address =
            std::io::BufReader::new(stdout).lines().map_while(Result::ok).find_map(|line| {
                line.strip_prefix("http_gateway: listening on ").map(|a| a.trim().to_owned())
            });
        let _ = sender.send(address);
    });
    match receiver.recv_timeout(GATEWAY_START_DEADLINE) {
        Ok(Some(address)) => Ok(address),
        Ok(None) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            bail!("the http_gateway example stopped before it listened")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            bail!("the http_gateway example did not listen within {GATEWAY_START_DEADLINE:?}")
        }
    }
}

/// Waits for `child` to exit, killing it after `deadline` (counted in polls of 100 ms).
fn wait_within(
    mut child: std::process::Child,
    deadline: std::time::Duration,
    what: &str,
) -> Result<std::process::ExitStatus> {
    let poll = std::time::Duration::from_millis(100);
    for _ in 0..deadline.as_millis().div_ceil(poll.as_millis()) {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        std::thread::sleep(poll);
    }
    let _ = child.kill();
    let _ = child.wait();
    bail!("{what} did not end within {deadline:?}")
}

/// The schemathesis command of a virtual environment under the cache folder, installed there
/// first if it is not.
fn schemathesis_venv() -> Result<PathBuf> {
    let home = env::var_os("HOME").context("HOME is not set")?;
    let venv =
        PathBuf::from(home).join(format!(".cache/durable-cluster/schemathesis-{SCHEMATHESIS}"));
    let command = venv.join("bin/schemathesis");
    if command.is_file() {
        return Ok(command);
    }
    report(&format!("==> schemathesis: installing {SCHEMATHESIS} into {}", venv.display()));
    let created = Command::new("python3").args(["-m", "venv"]).arg(&venv).status();
    if !created.is_ok_and(|status| status.success()) {
        bail!("python3 -m venv failed");
    }
    let pip = venv.join("bin/pip");
    let installed = Command::new(&pip)
        .args(["install", "--quiet", "--disable-pip-version-check"])
        .arg(format!("schemathesis=={SCHEMATHESIS}"))
        .status();
    if !installed.is_ok_and(|status| status.success()) {
        let _ = std::fs::remove_dir_all(&venv);
        bail!("pip install schemathesis=={SCHEMATHESIS} failed");
    }
    Ok(command)
}

/// Installs the TypeScript reference's packages (`interop/typescript`, exact versions from its
/// lock file) for the interop test against a real TypeScript runner. When `npm` is missing or
/// fails (no registry, say) the step is reported and the interop test skips, as a missing
/// database's tests do, except under `CI=true`, where it fails: the interop test must not pass
/// by skipping.
fn typescript_packages() -> Result<()> {
    let folder = "interop/typescript";
    report(&format!("==> typescript packages: npm ci --prefix {folder}"));
    let status = Command::new("npm")
        .args(["ci", "--prefix", folder, "--no-audit", "--no-fund", "--loglevel=error"])
        .status();
    let failure = match status {
        Ok(status) if status.success() => return Ok(()),
        Ok(status) => format!("npm ci failed ({status})"),
        Err(error) => format!("npm cannot run ({error})"),
    };
    if env::var("CI").as_deref() == Ok("true") {
        bail!("CI=true and {failure}: the TypeScript interop test needs Node.js and its packages");
    }
    report(&format!("{failure}; the TypeScript interop test will skip"));
    Ok(())
}

fn has_nextest() -> bool {
    Command::new("cargo")
        .args(["nextest", "--version"])
        .output()
        .is_ok_and(|output| output.status.success())
}

/// Checks the database services and returns the URL variables for the tests.
///
/// Under `CI=true` a missing service fails the run loudly: the suite must never pass by
/// skipping its Postgres and MySQL tests. Locally a missing service is reported and its URL
/// variable left unset, so that those tests skip with a message.
fn services() -> Result<Vec<(&'static str, String)>> {
    let in_ci = env::var("CI").is_ok_and(|value| value == "true");
    let mut envs = Vec::new();
    for service in &SERVICES {
        let url = env::var(service.url_variable).unwrap_or_else(|_| service.default_url.to_owned());
        if is_reachable(service.address) {
            report(&format!("==> service {}: reachable at {}", service.name, service.address));
            envs.push((service.url_variable, url));
        } else if in_ci {
            bail!(
                "{} is not reachable at {} and CI=true: its tests cannot be skipped",
                service.name,
                service.address
            );
        } else {
            report(&format!(
                "==> service {}: NOT reachable at {}; its tests will be skipped",
                service.name, service.address
            ));
        }
    }
    Ok(envs)
}

/// Finds Chromium and chromedriver for the console's browser test, installing Debian's
/// `chromium` and `chromium-driver` with `apt-get` when they are missing, and returns their
/// paths as the test's variables.
///
/// Under `CI=true` a browser that cannot be installed fails the run; locally the browser test
/// then skips with a message.
fn browser() -> Result<Vec<(&'static str, String)>> {
    let find = || {
        let chromium = which("chromium").or_else(|| which("chromium-browser"));
        Some((chromium?, which("chromedriver")?))
    };
    let found = find().or_else(|| {
        report("==> browser: installing chromium and chromium-driver with apt-get");
        let installed = Command::new("sh")
            .args([
                "-c",
                "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
                 chromium chromium-driver",
            ])
            .status()
            .is_ok_and(|status| status.success());
        if installed { find() } else { None }
    });
    match found {
        Some((chromium, driver)) => {
            report(&format!("==> browser: {chromium} and {driver}"));
            Ok(vec![("CLUSTER_TEST_CHROMIUM", chromium), ("CLUSTER_TEST_CHROMEDRIVER", driver)])
        }
        None if env::var("CI").as_deref() == Ok("true") => {
            bail!(
                "CI=true and chromium or chromedriver cannot be installed: the console's browser test needs them"
            )
        }
        None => {
            report("==> browser: chromium or chromedriver missing; the browser test will skip");
            Ok(Vec::new())
        }
    }
}

/// The path of `program` on `PATH`, if it is there.
fn which(program: &str) -> Option<String> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|folder| folder.join(program))
        .find(|candidate| candidate.is_file())
        .map(|found| found.display().to_string())
}

fn is_reachable(address: &str) -> bool {
    address
        .parse::<SocketAddr>()
        .is_ok_and(|address| TcpStream::connect_timeout(&address, Duration::from_secs(3)).is_ok())
}
