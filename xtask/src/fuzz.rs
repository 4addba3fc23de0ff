//! `cargo xtask fuzz [--seconds N] [TARGET...]`: the coverage-guided fuzz targets of `fuzz/`
//! (libFuzzer through `libfuzzer-sys`), each for `N` seconds (60 unless given), all of them
//! unless some are named.
//!
//! - The targets build in release mode with debug assertions and overflow checks, instrumented
//!   for coverage as `cargo fuzz` instruments them, on the stable toolchain, in a target
//!   directory of their own (`<target>-fuzz`).
//! - Each runs on its working corpus (kept in that directory between runs) and the seeds
//!   committed under `fuzz/seeds/<target>`, with the dictionary `fuzz/dicts/<target>.dict` when
//!   there is one.
//! - A crash, a panic, a timeout (10 s for one input) or memory past 2 GiB fails the run; the
//!   input is left under `<target>-fuzz/artifacts/<target>/` and the message says how to run
//!   it again. Every crash found becomes a regression test in the crate at fault.

use std::env;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{report, sibling_target_dir, step};

/// The fuzz targets (`fuzz/fuzz_targets/<name>.rs`).
pub(crate) const TARGETS: [&str; 8] = [
    "rpc_frames",
    "rpc_frame_decode",
    "rpc_handshake",
    "json_forms",
    "parse",
    "config",
    "stored_rows",
    "http_gateway",
];

/// The instrumentation `cargo fuzz` adds (without a sanitizer: the workspace forbids `unsafe`).
const RUSTFLAGS: &str = "-Cpasses=sancov-module \
    -Cllvm-args=-sanitizer-coverage-level=4 \
    -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
    -Cllvm-args=-sanitizer-coverage-pc-table \
    -Cllvm-args=-sanitizer-coverage-trace-compares \
    --cfg fuzzing";

pub(crate) fn run(root: &Path, args: &[String]) -> Result<()> {
    let mut seconds = 60_u64;
    let mut targets = Vec::new();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--seconds" => {
                let value = args.next().context("--seconds needs a number")?;
                seconds = value.parse().with_context(|| format!("--seconds {value:?}"))?;
            }
            name if TARGETS.contains(&name) => targets.push(name),
            other => bail!("unknown fuzz target or flag {other:?}; the targets: {TARGETS:?}"),
        }
    }
    if targets.is_empty() {
        targets.extend(TARGETS);
    }
    env::set_current_dir(root).with_context(|| format!("cannot enter {}", root.display()))?;
    let target_dir = sibling_target_dir("fuzz");
    let target_text = target_dir.display().to_string();
    // With the host's triple named, RUSTFLAGS instrument the targets only, not the build
    // scripts and procedural macros (which would not link without libFuzzer).
    let triple = host_triple()?;
    step(
        "fuzz targets",
        &[
            "build",
            "--release",
            "--locked",
            "--manifest-path",
            "fuzz/Cargo.toml",
            "--bins",
            "--target",
            triple.as_str(),
        ],
        &[("RUSTFLAGS", RUSTFLAGS), ("CARGO_TARGET_DIR", target_text.as_str())],
    )?;
    let binaries = target_dir.join(&triple).join("release");
    for target in targets {
        fuzz_one(root, &target_dir, &binaries, target, seconds)?;
    }
    Ok(())
}

/// The host's target triple, as `rustc -vV` prints it.
fn host_triple() -> Result<String> {
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let output = Command::new(rustc).arg("-vV").output().context("cannot run rustc -vV")?;
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines()
        .find_map(|line| line.strip_prefix("host: "))
        .map(str::to_owned)
        .context("rustc -vV names no host")
}

/// Runs one target for `seconds`.
fn fuzz_one(
    root: &Path,
    target_dir: &Path,
    binaries: &Path,
    target: &str,
    seconds: u64,
) -> Result<()> {
    let binary = binaries.join(target);
    let corpus = target_dir.join("corpus").join(target);
    let artifacts = target_dir.join("artifacts").join(target);
    std::fs::create_dir_all(&corpus)?;
    std::fs::create_dir_all(&artifacts)?;
    let mut command = Command::new(&binary);
    command.arg(&corpus);
    let seeds = root.join("fuzz").join("seeds").join(target);
    if seeds.is_dir() {
        command.arg(&seeds);
    }
    command.args([
        format!("-max_total_time={seconds}"),
        "-timeout=10".to_owned(),
        "-rss_limit_mb=2048".to_owned(),
        "-print_final_stats=1".to_owned(),
        format!("-artifact_prefix={}/", artifacts.display()),
    ]);
    let dict = root.join("fuzz").join("dicts").join(format!("{target}.dict"));
    if dict.is_file() {
        command.arg(format!("-dict={}", dict.display()));
    }
    report(&format!("==> fuzz {target} for {seconds} s"));
    let status = command.status().with_context(|| format!("cannot run {}", binary.display()))?;
    if !status.success() {
        bail!(
            "fuzz target {target} found a failing input ({status}); it is in {}: run it again \
             with `{} <input>` and add it as a regression test in the crate at fault",
            artifacts.display(),
            binary.display()
        );
    }
    Ok(())
}
