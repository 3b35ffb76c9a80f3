//! `cargo xtask`: the project's chores, runnable by a newcomer.
//!
//! - `cargo xtask ci`: what CI runs (fmt, clippy, tests, doc tests, rustdoc, cargo-deny, fuzz
//!   build).
//! - `cargo xtask gpu-bundle`: release builds of the hardware tests and the `poolipc` binary,
//!   with a `run.sh`, into `target/gpu-bundle/` (see `docs/gpu.md`).
//! - `cargo xtask gpu-test`: the bundle, then its `run.sh`, on this machine's GPU.
//! - `cargo xtask fuzz [seconds]`: each fuzz target for a bounded time.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

mod tidy;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = root()?;
    std::env::set_current_dir(&root)?;
    match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("gpu-bundle") => gpu_bundle(&root).map(|_| ()),
        Some("gpu-test") => {
            let bundle = gpu_bundle(&root)?;
            run(Command::new(bundle.join("run.sh")))
        }
        Some("fuzz") => {
            let secs: u64 = args
                .get(1)
                .map_or(Ok(60), |s| s.parse())
                .context("seconds")?;
            fuzz_run(secs)
        }
        _ => {
            eprintln!("usage: cargo xtask <ci | gpu-bundle | gpu-test | fuzz [seconds]>");
            std::process::exit(2);
        }
    }
}

fn root() -> Result<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    Ok(dir
        .parent()
        .context("xtask has no parent directory")?
        .to_path_buf())
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

fn run(mut cmd: Command) -> Result<()> {
    eprintln!("$ {cmd:?}");
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// The Python tools, from PyPI into the venv `target/pyenv`: maturin builds the wheel and the
/// sdist, `ziglang` is the linker that lets it target glibc 2.17 (manylinux2014) from any
/// machine, auditwheel says which manylinux policy the wheel meets, twine checks the metadata
/// PyPI will read; pytest, mypy and pyisolate run the suites. Returns the venv's Python.
fn python_env(root: &Path) -> Result<PathBuf> {
    let venv = root.join("target/pyenv");
    let py = venv.join("bin/python");
    if !py.exists() {
        let mut c = Command::new("python3");
        c.args(["-m", "venv"]).arg(&venv);
        run(c)?;
    }
    let mut c = Command::new(&py);
    c.args([
        "-m",
        "pip",
        "install",
        "-q",
        "maturin>=1.5,<2",
        "ziglang",
        "auditwheel",
        "twine",
        "pytest",
        "mypy",
        // poolipc.pyisolate's tests run the real pyisolate (it brings uv and packaging).
        "pyisolate>=0.10,<0.11",
    ]);
    run(c)?;
    Ok(py)
}

/// The wheel as released: abi3 (Python 3.10 and later), linked by zig against glibc 2.17 and
/// tagged manylinux2014 (Ubuntu 20.04 and RHEL 8 install it, not only glibc 2.34 and newer).
/// Built into `out`, which holds nothing else afterwards; returns the wheel's path.
fn build_wheel(root: &Path, py: &Path, out: &Path) -> Result<PathBuf> {
    let _ = std::fs::remove_dir_all(out);
    let mut c = Command::new(py.with_file_name("maturin"));
    c.args([
        "build",
        "--release",
        "--zig",
        "--compatibility",
        "manylinux2014",
        "-m",
        "crates/poolipc-python/Cargo.toml",
        "-o",
    ])
    .arg(out)
    // maturin finds zig as `python -m ziglang` through the venv's Python on the PATH.
    .env(
        "PATH",
        path_with(py.parent().context("the venv has no bin")?),
    )
    .current_dir(root);
    run(c)?;
    std::fs::read_dir(out)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .context("maturin built no wheel")
}

/// `PATH` with `dir` first.
fn path_with(dir: &Path) -> std::ffi::OsString {
    let mut paths = vec![dir.to_path_buf()];
    paths.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    std::env::join_paths(paths).unwrap_or_default()
}

/// The Python binding: the release wheel built (manylinux2014, [`build_wheel`]), its policy
/// shown by auditwheel (CI fails unless it is manylinux_2_17), an sdist beside it, both
/// checked by `twine check`; the wheel installed in `target/pyenv` and the pytest suite run on
/// SimDriver (mypy checks the stubs against the module and a typed use of it), then the
/// ComfyUI pack's tests.
fn python_suite() -> Result<()> {
    let root = root()?;
    let py = python_env(&root)?;
    let wheels = root.join("target/wheels");
    let wheel = build_wheel(&root, &py, &wheels)?;
    eprintln!("$ auditwheel show {}", wheel.display());
    let out = Command::new(&py)
        .args(["-m", "auditwheel", "show"])
        .arg(&wheel)
        .output()
        .context("auditwheel show")?;
    let shown = String::from_utf8_lossy(&out.stdout);
    eprintln!("{shown}");
    if !out.status.success() || !shown.contains("manylinux_2_17") {
        bail!(
            "auditwheel does not place the wheel under manylinux_2_17 (manylinux2014):\n{shown}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut c = Command::new(py.with_file_name("maturin"));
    c.args(["sdist", "-m", "crates/poolipc-python/Cargo.toml", "-o"])
        .arg(&wheels)
        .current_dir(&root);
    run(c)?;
    let mut c = Command::new(&py);
    c.args(["-m", "twine", "check", "--strict"]);
    for e in std::fs::read_dir(&wheels)? {
        c.arg(e?.path());
    }
    run(c)?;
    let mut c = Command::new(&py);
    c.args([
        "-m",
        "pip",
        "install",
        "-q",
        "--force-reinstall",
        "--no-deps",
    ])
    .arg(&wheel);
    run(c)?;
    let mut c = Command::new(&py);
    // The Rust worker test finds the `poolipc` binary nextest built under target/debug.
    c.args(["-m", "pytest", "-q", "-rs", "tests"])
        .current_dir(root.join("crates/poolipc-python"));
    run(c)?;
    // The ComfyUI pack: fake ComfyUI modules, fresh interpreters, the binding on SimDriver.
    let mut c = Command::new(&py);
    c.args(["-m", "pytest", "-q", "-rs", "comfyui-poolipc/tests"])
        .env("POOLIPC_DRIVER", "sim")
        .current_dir(&root);
    run(c)
}

fn has_subcommand(name: &str) -> bool {
    cargo()
        .args([name, "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The tools the test command installs where they are missing, each pinned to a version whose
/// `rust-version` is at most the workspace's (1.88), so that they build on the oldest toolchain
/// poolipc claims: cargo-nextest 0.9.114 is the last needing 1.88 (0.9.115 needs 1.89),
/// cargo-deny 0.20.2 needs 1.88, cargo-fuzz 0.13.2 says nothing and builds on 1.95. nextest
/// is built without its self-updater, as its docs recommend for CI: fewer crates to build on a
/// fresh machine, and a CI install has no use for it. `.ci/run` installs through this too.
const TOOLS: &[(&str, &str, &[&str])] = &[
    (
        "nextest",
        "0.9.114",
        &["--no-default-features", "--features", "default-no-update"],
    ),
    ("deny", "0.20.2", &[]),
    ("fuzz", "0.13.2", &[]),
];

/// Installs `cargo-<name>` (from crates.io, `--locked`, the version [`TOOLS`] pins) when this
/// machine lacks it, so the README's test command works on a fresh machine with only Rust and
/// Python. A tool already installed is used whatever its version.
fn ensure_tool(name: &str) -> Result<()> {
    if has_subcommand(name) {
        return Ok(());
    }
    let (_, version, features) = TOOLS
        .iter()
        .find(|(n, _, _)| *n == name)
        .with_context(|| format!("cargo-{name} is not one of the tools xtask installs"))?;
    let krate = format!("cargo-{name}");
    eprintln!(
        "cargo-{name} is not installed: installing it (cargo install --locked {krate} --version {version} {})",
        features.join(" ")
    );
    let mut c = cargo();
    c.args(["install", "--locked", &krate, "--version", version])
        .args(*features);
    run(c)
}

fn ci() -> Result<()> {
    // What the final summary says besides "green": checks that could not run here.
    let mut warnings: Vec<String> = Vec::new();
    let mut c = Command::new("rustup");
    c.args(["component", "add", "rustfmt", "clippy"]);
    if let Err(e) = run(c) {
        eprintln!("rustup component add rustfmt clippy: {e} (going on with what is installed)");
    }
    for (tool, _, _) in TOOLS {
        ensure_tool(tool)?;
    }
    tidy::check(&root()?)?;
    let mut c = cargo();
    c.args(["fmt", "--all", "--check"]);
    run(c)?;
    // Clippy with the workspace's lints, `incompatible_msrv` among them (rust-version 1.88).
    let mut c = cargo();
    c.args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--all-features",
        "--",
        "-D",
        "warnings",
    ]);
    run(c)?;
    // nextest's JUnit report keeps every test's output (.config/nextest.toml, profile `ci`):
    // the bodies that printed NOT RUN are read back from it, counted and listed below.
    let mut c = cargo();
    c.args([
        "nextest",
        "run",
        "--workspace",
        "--no-fail-fast",
        "--profile",
        "ci",
    ]);
    run(c)?;
    let junit = root()?.join("target/nextest/ci/junit.xml");
    let not_run = not_run_tests(
        &std::fs::read_to_string(&junit)
            .with_context(|| format!("reading nextest's report {}", junit.display()))?,
    );
    let mut c = cargo();
    c.args(["test", "--workspace", "--doc"]);
    run(c)?;
    let mut c = cargo();
    c.args(["doc", "--workspace", "--no-deps"])
        .env("RUSTDOCFLAGS", "-D warnings");
    run(c)?;
    // The Rust example, as a user runs it (SimDriver here: no GPU).
    let mut c = cargo();
    c.args(["run", "-p", "poolipc", "--example", "handoff"]);
    run(c)?;
    let mut c = cargo();
    c.args([
        "deny",
        "--log-level",
        "error",
        "check",
        "bans",
        "licenses",
        "sources",
    ]);
    run(c)?;
    // The advisory database comes from GitHub; where that is unreachable the check says so
    // and CI goes on, rather than failing on a network it does not have, and the summary
    // says it was not checked.
    eprintln!("$ cargo deny check advisories");
    let out = cargo()
        .args(["deny", "--log-level", "error", "check", "advisories"])
        .output()?;
    let text = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        eprintln!("advisories ok");
    } else if text.contains("failed to fetch advisory database") {
        warnings.push(
            "advisories NOT CHECKED: cargo-deny could not fetch the RustSec database from here"
                .into(),
        );
    } else {
        bail!("cargo deny check advisories failed:\n{text}");
    }
    publish_dry_run()?;
    fuzz_build()?;
    python_suite()?;
    eprintln!();
    eprintln!("xtask ci: summary");
    if not_run.is_empty() {
        eprintln!("  every test body ran");
    } else {
        eprintln!(
            "  {} test bodies NOT RUN on this machine (they passed without running their body; a GPU machine runs them: docs/gpu.md):",
            not_run.len()
        );
        for (test, _) in &not_run {
            eprintln!("    {test}");
        }
        eprintln!("  why:");
        for (why, n) in not_run_reasons(&not_run) {
            eprintln!("    {n} × {why}");
        }
        warnings.push(format!(
            "{} test bodies NOT RUN (listed above)",
            not_run.len()
        ));
    }
    if warnings.is_empty() {
        eprintln!("xtask ci: all green");
    } else {
        for w in &warnings {
            eprintln!("  WARNING: {w}");
        }
        eprintln!(
            "xtask ci: passed, with {} warning(s) above: not all green",
            warnings.len()
        );
    }
    Ok(())
}

/// `cargo publish --dry-run --workspace`: every publishable crate packaged and its package
/// built, in dependency order, against the others' packages (a local registry under
/// `target/package`), which is how path-and-version dependencies between unpublished crates
/// can be checked at all: `cargo publish --dry-run -p poolipc` alone looks for
/// `poolipc-types` on crates.io. `--allow-dirty`: a dry run of a working tree.
///
/// Cargo unpacks each package of that local registry into `$CARGO_HOME/registry/src/<hash>/`
/// and reuses an unpacked `name-version` on the next run, and it keeps registry builds: with
/// the version unchanged, a second dry run would build against the first run's sources (a
/// trait method added since is then "not found"). So the unpacked copies and the builds of
/// this workspace's packages go first.
fn publish_dry_run() -> Result<()> {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    if let Some(src) = home.map(|h| h.join("registry/src"))
        && let Ok(registries) = std::fs::read_dir(&src)
    {
        for reg in registries.flatten() {
            for pkg in std::fs::read_dir(reg.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let name = pkg.file_name().to_string_lossy().into_owned();
                let ours = name.starts_with("poolipc-0.")
                    || WORKSPACE_PACKAGES
                        .iter()
                        .any(|p| name.starts_with(&format!("{p}-")));
                if ours {
                    let _ = std::fs::remove_dir_all(pkg.path());
                }
            }
        }
    }
    // Cargo takes registry packages as immutable: a build of `poolipc-driver 0.1.0` from the
    // last dry run counts as up to date whatever the package holds now. The dry run builds in
    // a target directory of its own, and this workspace's packages are rebuilt there every
    // time (their fingerprints and outputs go; third-party builds stay).
    let check = root()?.join("target/publish-check");
    for profile in ["debug", "release"] {
        for sub in [".fingerprint", "deps", "build"] {
            let dir = check.join(profile).join(sub);
            for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with("poolipc") || name.starts_with("libpoolipc") {
                    let path = e.path();
                    let _ = if path.is_dir() {
                        std::fs::remove_dir_all(&path)
                    } else {
                        std::fs::remove_file(&path)
                    };
                }
            }
        }
    }
    let mut c = cargo();
    c.args([
        "publish",
        "--dry-run",
        "--workspace",
        "--allow-dirty",
        "--target-dir",
    ]);
    c.arg(&check);
    run(c)
}

/// The workspace's publishable packages (their unpacked dry-run copies are removed first).
const WORKSPACE_PACKAGES: &[&str] = &[
    "poolipc-types",
    "poolipc-driver",
    "poolipc-pool",
    "poolipc-contract",
    "poolipc-transport",
    "poolipc-cli",
];

/// The tests whose output in nextest's JUnit report says `NOT RUN`, with the line that says
/// why: `binary::test` and the reason, in the report's order.
fn not_run_tests(junit: &str) -> Vec<(String, String)> {
    let attr = |tag: &str, name: &str| -> Option<String> {
        let start = tag.find(&format!(" {name}=\""))? + name.len() + 3;
        let end = start + tag[start..].find('"')?;
        Some(unescape(&tag[start..end]))
    };
    let mut out = Vec::new();
    for case in junit.split("<testcase").skip(1) {
        let body = case.split("</testcase>").next().unwrap_or(case);
        let Some(line) = body.lines().find(|l| l.contains("NOT RUN")) else {
            continue;
        };
        let tag = body.split('>').next().unwrap_or("");
        let name = attr(tag, "name").unwrap_or_default();
        let class = attr(tag, "classname").unwrap_or_default();
        let why = unescape(&line[line.find("NOT RUN").unwrap_or(0)..]);
        out.push((format!("{class}::{name}"), why.trim().to_string()));
    }
    out
}

/// How many NOT RUN bodies gave each reason: `NOT RUN on hardware: <test> (why)` counts under
/// `(why)`, which many share; a line without brackets counts as it is.
fn not_run_reasons(not_run: &[(String, String)]) -> std::collections::BTreeMap<&str, usize> {
    let mut reasons = std::collections::BTreeMap::new();
    for (_, why) in not_run {
        let why = why.find(" (").map_or(why.as_str(), |i| &why[i + 1..]);
        *reasons.entry(why).or_default() += 1;
    }
    reasons
}

fn unescape(s: &str) -> String {
    s.replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&amp;", "&")
}

/// The fuzz targets, built with cargo-fuzz on the stable toolchain (RUSTC_BOOTSTRAP lets it
/// pass the `-Z` flags it needs; no sanitizer, which stable does not ship).
fn fuzz_command(sub: &str) -> Command {
    let mut c = cargo();
    c.args(["fuzz", sub, "--sanitizer", "none"])
        .env("RUSTC_BOOTSTRAP", "1");
    c
}

fn fuzz_build() -> Result<()> {
    ensure_tool("fuzz")?;
    run(fuzz_command("build"))
}

fn fuzz_run(secs: u64) -> Result<()> {
    fuzz_build()?;
    for target in ["frame_decode", "contract_ops"] {
        let mut c = fuzz_command("run");
        c.args([target, "--", &format!("-max_total_time={secs}")]);
        run(c)?;
    }
    Ok(())
}

/// Test executables cargo reports for `cargo test --no-run --message-format=json`.
fn test_executables(json: &str) -> Vec<PathBuf> {
    json.lines()
        .filter(|l| l.contains("\"reason\":\"compiler-artifact\"") && l.contains("\"test\":true"))
        .filter_map(|l| {
            let start = l.find("\"executable\":\"")? + "\"executable\":\"".len();
            let end = start + l[start..].find('"')?;
            Some(PathBuf::from(&l[start..end]))
        })
        .collect()
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .with_context(|| format!("copy {} -> {}", from.display(), to.display()))?;
    Ok(())
}

fn gpu_bundle(root: &Path) -> Result<PathBuf> {
    let bundle = root.join("target/gpu-bundle");
    if bundle.exists() {
        std::fs::remove_dir_all(&bundle)?;
    }
    std::fs::create_dir_all(bundle.join("tests"))?;
    let mut c = cargo();
    c.args([
        "build",
        "--release",
        "-p",
        "poolipc-cli",
        "-p",
        "poolipc-tests",
        "--bins",
    ]);
    run(c)?;
    let release = root.join("target/release");
    copy(&release.join("poolipc"), &bundle.join("poolipc"))?;
    // The crate docs' parent-and-worker example, run on the GPU as a user would run it.
    let mut c = cargo();
    c.args([
        "build",
        "--release",
        "-p",
        "poolipc",
        "--example",
        "handoff",
    ]);
    run(c)?;
    copy(
        &release.join("examples/handoff"),
        &bundle.join("example-handoff"),
    )?;
    copy(
        &release.join("poolipc-test-child"),
        &bundle.join("tests/poolipc-test-child"),
    )?;
    copy(
        &release.join("poolipc-test-worker"),
        &bundle.join("tests/poolipc-test-worker"),
    )?;
    copy(
        &release.join("poolipc-test-parent"),
        &bundle.join("tests/poolipc-test-parent"),
    )?;
    copy(
        &release.join("poolipc-test-rogue"),
        &bundle.join("tests/poolipc-test-rogue"),
    )?;
    let out = cargo()
        .args([
            "test",
            "--release",
            "--no-run",
            "--message-format=json",
            "-p",
            "poolipc-tests",
            "-p",
            "poolipc-driver",
            "-p",
            "poolipc-pool",
            "-p",
            "poolipc-cli",
            "-p",
            "poolipc",
        ])
        .output()?;
    if !out.status.success() {
        bail!(
            "building the test binaries failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let exes = test_executables(&String::from_utf8_lossy(&out.stdout));
    if exes.is_empty() {
        bail!("cargo reported no test executables");
    }
    for exe in &exes {
        let name = exe
            .file_name()
            .context("test executable has no name")?
            .to_string_lossy();
        // `foundation-0123abcd` -> `foundation`
        let short = name.rsplit_once('-').map_or(name.as_ref(), |(a, _)| a);
        // A harness with no tests (a binary target's) only takes room in the carry (64 MiB).
        let listed = Command::new(exe)
            .args(["--list", "--format", "terse"])
            .output()
            .with_context(|| format!("listing the tests of {}", exe.display()))?;
        if !String::from_utf8_lossy(&listed.stdout)
            .lines()
            .any(|l| l.ends_with(": test"))
        {
            eprintln!("gpu bundle: {short} has no tests; left out");
            continue;
        }
        copy(exe, &bundle.join("tests").join(short))?;
    }
    // The Python wheel as released (abi3, manylinux2014), built as CI builds it.
    let py = python_env(root)?;
    let wheel = build_wheel(root, &py, &root.join("target/wheels"))?;
    copy(
        &wheel,
        &bundle.join(wheel.file_name().context("the wheel has no name")?),
    )?;
    // pyisolate (pure Python) and packaging, for poolipc.pyisolate's GPU test: the GPU
    // machine has no package index. uv, its other dependency, is a 20 MB binary and is left
    // out (the test puts a uv that fails if run on the PATH; pyisolate only looks for it).
    let pywheels = bundle.join("pywheels");
    let _ = std::fs::remove_dir_all(&pywheels);
    let mut c = Command::new("python3");
    c.args([
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary",
        ":all:",
        "pyisolate==0.10.2",
        "packaging",
        "-d",
    ])
    .arg(&pywheels);
    if let Err(e) = run(c) {
        eprintln!("gpu bundle: no pyisolate wheel ({e}); the pyisolate GPU test will skip");
    }
    let script = bundle.join("run.sh");
    std::fs::write(&script, RUN_SH)?;
    let mut perms = std::fs::metadata(&script)?.permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&script, perms)?;
    eprintln!(
        "gpu bundle: {} ({} test binaries)",
        bundle.display(),
        exes.len()
    );
    // The device machine takes at most 64 MiB with the tree; the binaries alone pass it.
    // One xz archive of the bundle travels instead: carry `target/gpu-pack` and run
    // `tar xJf target/gpu-pack/gpu-bundle.tar.xz -C target && target/gpu-bundle/run.sh`.
    let pack = root.join("target/gpu-pack");
    let _ = std::fs::remove_dir_all(&pack);
    std::fs::create_dir_all(&pack)?;
    let mut c = Command::new("tar");
    c.arg("cJf")
        .arg(pack.join("gpu-bundle.tar.xz"))
        .arg("-C")
        .arg(root.join("target"))
        .arg("gpu-bundle")
        .env("XZ_OPT", "-6 -T0");
    run(c).context("packing the bundle")?;
    let packed = std::fs::metadata(pack.join("gpu-bundle.tar.xz"))?.len();
    eprintln!(
        "gpu bundle packed: {} ({:.1} MiB): carry target/gpu-pack, run \
         `tar xJf target/gpu-pack/gpu-bundle.tar.xz -C target && target/gpu-bundle/run.sh`",
        pack.join("gpu-bundle.tar.xz").display(),
        packed as f64 / f64::from(1u32 << 20)
    );
    Ok(bundle)
}

/// Runs every test of every binary in its own process (the shared pool is per process, as it
/// is for nextest), then `poolipc doctor --probe-limit`, `poolipc demo` and `poolipc bench`;
/// logs under $OUT, a table last.
const RUN_SH: &str = r#"#!/usr/bin/env bash
# Generated by `cargo xtask gpu-bundle`. Runs the hardware tests and the doctor; logs in $OUT.
# `run.sh --mps-pass` (run by run.sh itself inside `poolipc mps`) runs the handoff and facade
# suites again as clients of a private MPS daemon. POOLIPC_PARTS picks parts (default
# "tests,tools,mps,bench,python"); POOLIPC_TEST_BINS names test binaries (default all), so
# that one machine call stays within its time limit.
set -u
parts=${POOLIPC_PARTS:-tests,tools,mps,bench,python}
want() { case ",$parts," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$here/out}
mkdir -p "$out"
export POOLIPC_TEST_CHILD="$here/tests/poolipc-test-child"
export POOLIPC_BIN="$here/poolipc"
export POOLIPC_TEST_WORKER="$here/tests/poolipc-test-worker"
export POOLIPC_TEST_ROGUE_BIN="$here/tests/poolipc-test-rogue"
export RUST_BACKTRACE=1
summary="$out/summary.txt"
log="$out/tests.log"
# suite LABEL BINARY...: every test of each binary in its own process; counts in $out/counts.
suite() {
  local label=$1; shift
  local pass=0 fail=0
  for bin in "$@"; do
    local name; name=$(basename "$bin")
    for t in $("$bin" --list --format terse 2>/dev/null | sed -n 's/: test$//p'); do
      local start; start=$(date +%s%N)
      if "$bin" --exact "$t" --nocapture --test-threads=1 >"$out/one.log" 2>&1; then r=ok; pass=$((pass+1)); else r=FAILED; fail=$((fail+1)); fi
      local ms=$(( ($(date +%s%N) - start) / 1000000 ))
      local note; note=$(grep -hoE 'RAN on CudaDriver|NOT RUN on hardware[^(]*|first [0-9.]+ µs, recycled [0-9.]+ µs, ratio [0-9]+×|keeps_mappings=[a-z]+|mps client: [a-z]+' "$out/one.log" | head -2 | tr '\n' ' ')
      { echo "=== $label$name::$t: $r (${ms} ms)"; cat "$out/one.log"; } >> "$log"
      printf '%-7s %-100s %7d ms %s\n' "$r" "$label$name::$t" "$ms" "$note" >> "$summary"
    done
  done
  rm -f "$out/one.log"
  echo "$pass $fail" >> "$out/counts"
}
if [ "${1:-}" = "--mps-pass" ]; then
  suite "mps:" "$here/tests/handoff" "$here/tests/faults" $(ls "$here"/tests/arena* 2>/dev/null)
  exit 0
fi
: > "$summary"
: > "$log"
: > "$out/counts"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >> "$summary" 2>&1 || echo "nvidia-smi: not available" >> "$summary"
bins=()
for bin in "$here"/tests/*; do
  name=$(basename "$bin")
  case "$name" in poolipc-test-child|poolipc-test-worker|poolipc-test-parent|poolipc-test-rogue) continue ;; esac
  if [ -n "${POOLIPC_TEST_BINS:-}" ]; then case ",$POOLIPC_TEST_BINS," in *",$name,"*) ;; *) continue ;; esac; fi
  bins+=("$bin")
done
want tests && suite "" "${bins[@]}"
if want tools; then
echo "--- poolipc doctor --probe-limit" >> "$summary"
"$here/poolipc" doctor --probe-limit > "$out/doctor.log" 2>&1; echo "doctor exit: $?" >> "$summary"
cat "$out/doctor.log" >> "$summary"
echo "--- poolipc demo" >> "$summary"
"$here/poolipc" demo > "$out/demo.log" 2>&1; echo "demo exit: $?" >> "$summary"
grep -v ' INFO ' "$out/demo.log" >> "$summary"
if [ -x "$here/example-handoff" ]; then
  echo "--- examples/handoff.rs (POOLIPC_DRIVER=auto)" >> "$summary"
  POOLIPC_DRIVER=auto "$here/example-handoff" > "$out/example.log" 2>&1; r=$?; echo "example exit: $r" >> "$summary"
  grep -v ' INFO ' "$out/example.log" >> "$summary"
  [ "$r" -eq 0 ] || echo "0 1" >> "$out/counts"
fi
fi
if ! want mps; then :
elif command -v nvidia-cuda-mps-control >/dev/null; then
  echo "--- the handoff and facade suites again, under a private MPS daemon (poolipc mps)" >> "$summary"
  "$here/poolipc" mps --accept-shared-gpu-faults -- bash "$here/run.sh" --mps-pass > "$out/mps-pass.log" 2>&1
  echo "mps pass exit: $?" >> "$summary"
  "$here/poolipc" mps --accept-shared-gpu-faults -- "$here/poolipc" doctor --json > "$out/doctor-mps.json" 2>>"$out/mps-pass.log"
  echo "doctor under MPS: $(grep -o '"mps":{[^}]*}' "$out/doctor-mps.json")" >> "$summary"
else
  echo "MPS: NOT RUN (nvidia-cuda-mps-control is not installed here)" >> "$summary"
fi
repo=$(cd "$here/../.." && pwd)
if want bench; then
echo "--- poolipc bench --mps (plain, then under a private MPS daemon; peers in the same run)" >> "$summary"
peers=""
if nvcc -O2 -o /tmp/poolipc-floor "$repo/bench/floor.c" -lcuda > "$out/floor-build.txt" 2>&1; then peers="--floor /tmp/poolipc-floor"; else echo "floor.c did not build: $(tail -1 "$out/floor-build.txt")" >> "$summary"; fi
python3 -c 'import torch' 2>/dev/null && peers="$peers --torchmp $repo/bench/torchmp.py"
rm -f "$out/floor-build.txt"
mps=""; command -v nvidia-cuda-mps-control >/dev/null && mps="--mps"
plot=""; "$here/poolipc" bench --help | grep -q -- --plot && plot="--plot $out/bench.svg"
RUST_LOG=warn timeout 900 "$here/poolipc" bench $mps $peers --json-out "$out/bench.json" $plot > "$out/bench.log" 2>&1; echo "bench exit: $?" >> "$summary"
cat "$out/bench.log" >> "$summary"
echo "--- same run, plain, with the old spin (POOLIPC_SPIN_US=50 POOLIPC_SPIN_IN_FLIGHT_US=0): what the spin saves" >> "$summary"
POOLIPC_SPIN_US=50 POOLIPC_SPIN_IN_FLIGHT_US=0 RUST_LOG=warn timeout 300 "$here/poolipc" bench $peers --max-mib 64 --copy-max-mib 0 --result-max-mib 64 > "$out/bench-oldspin.log" 2>&1; echo "bench (old spin) exit: $?" >> "$summary"
grep -E "^ +(4 KiB|1 MiB|64 MiB) .*[0-9]\.[0-9][0-9] |split" "$out/bench-oldspin.log" >> "$summary"
echo "--- poolipc bench --workers 8 $mps (jobs/s with 1..8 workers at once, one parent)" >> "$summary"
RUST_LOG=warn timeout 600 "$here/poolipc" bench --workers 8 $mps > "$out/bench-workers.log" 2>&1; echo "bench --workers exit: $?" >> "$summary"
grep -vE " (INFO|WARN|DEBUG) " "$out/bench-workers.log" >> "$summary"
fi
want python && echo "--- python: the binding under torch (cudaMallocAsync), then on SimDriver" >> "$summary"
wheel=$(ls "$here"/poolipc-*.whl 2>/dev/null | head -1)
if ! want python; then :
elif [ -n "$wheel" ] && python3 -c 'import torch' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/poolipc-site "$wheel" $(ls "$here"/pywheels/*.whl 2>/dev/null) > "$out/python.log" 2>&1
  ( cd "$repo/crates/poolipc-python" && PYTHONPATH=/tmp/poolipc-site python3 -m pytest -v -rs tests/gpu_torch_test.py ) >> "$out/python.log" 2>&1
  r1=$?
  # poolipc.pyisolate with the real pyisolate (its wheel in the bundle), in its own process.
  ( cd "$repo/crates/poolipc-python" && PYTHONPATH=/tmp/poolipc-site python3 -m pytest -v -rs tests/gpu_pyisolate_test.py ) >> "$out/python.log" 2>&1
  r1=$(( r1 | $? ))
  ( cd "$repo/crates/poolipc-python" && PYTHONPATH=/tmp/poolipc-site POOLIPC_DRIVER=sim python3 -m pytest -q tests/test_sim.py tests/test_mps.py ) >> "$out/python.log" 2>&1
  r2=$?
  echo "python torch suite exit: $r1, sim suite exit: $r2" >> "$summary"
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$out/python.log" | sed 's/^tests\/gpu_\(torch\|pyisolate\)_test.py:://' | tail -60 >> "$summary"
  [ "$r1" -eq 0 ] && [ "$r2" -eq 0 ] || echo "0 1" >> "$out/counts"
  echo "--- bench/pybench.py: the Python binding against torch.multiprocessing, same run" >> "$summary"
  ( cd "$repo" && PYTHONPATH=/tmp/poolipc-site timeout 900 python3 bench/pybench.py --json ) > "$out/pybench.log" 2>&1
  echo "pybench exit: $?" >> "$summary"
  grep -v '^{' "$out/pybench.log" | grep -v ' INFO ' | tail -12 >> "$summary"
  echo "--- bench/pybench.py --workers 8 (jobs/s, torch workers, plain)" >> "$summary"
  ( cd "$repo" && PYTHONPATH=/tmp/poolipc-site timeout 300 python3 bench/pybench.py --workers 8 ) > "$out/pybench-workers.log" 2>&1
  echo "pybench --workers exit: $?" >> "$summary"
  grep -v ' INFO ' "$out/pybench-workers.log" | tail -12 >> "$summary"
  if command -v nvidia-cuda-mps-control >/dev/null; then
    echo "--- bench/pybench.py --workers 8 under a private MPS daemon" >> "$summary"
    ( cd "$repo" && PYTHONPATH=/tmp/poolipc-site timeout 300 "$here/poolipc" mps --accept-shared-gpu-faults -- python3 bench/pybench.py --workers 8 ) > "$out/pybench-workers-mps.log" 2>&1
    echo "pybench --workers (MPS) exit: $?" >> "$summary"
    grep -v ' INFO ' "$out/pybench-workers-mps.log" | tail -12 >> "$summary"
  fi
  echo "--- bench/vram.py: VRAM back after empty_cache (never lent, arena copy, pool pointer)" >> "$summary"
  ( cd "$repo" && PYTHONPATH=/tmp/poolipc-site timeout 300 python3 bench/vram.py --gib 24 ) > "$out/vram.log" 2>&1
  echo "vram.py exit: $?" >> "$summary"
  grep -v ' INFO ' "$out/vram.log" | tail -20 >> "$summary"
else
  echo "python: NOT RUN (no wheel in the bundle, or no torch here)" >> "$summary"
fi
pass=$(awk '{p+=$1} END {print p+0}' "$out/counts"); fail=$(awk '{f+=$2} END {print f+0}' "$out/counts")
echo "--- tests: $pass passed, $fail failed" >> "$summary"
# The device machine gives back only a few files from $OUT: the summary, the chart and one
# archive of every log.
( cd "$out" && logs=$(ls | grep -vxE 'summary.txt|bench.svg|logs.tar.gz') \
  && [ -n "$logs" ] && tar czf logs.tar.gz $logs && rm -f $logs )
cat "$summary"
[ "$fail" -eq 0 ]
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_run_reasons_are_counted_without_the_tests_names() {
        let lines = [
            ("a", "NOT RUN on hardware: a (no usable GPU: none)"),
            ("b", "NOT RUN on hardware: b (no usable GPU: none)"),
            ("c", "NOT RUN on sim: 15 GiB is host memory"),
        ]
        .map(|(t, w)| (t.to_string(), w.to_string()));
        let got: Vec<_> = not_run_reasons(&lines).into_iter().collect();
        assert_eq!(
            got,
            [
                ("(no usable GPU: none)", 2),
                ("NOT RUN on sim: 15 GiB is host memory", 1)
            ]
        );
    }

    #[test]
    fn not_run_bodies_are_read_from_nextests_junit_report() {
        let junit = r#"<testsuites><testsuite name="poolipc-tests::handoff">
<testcase name="a::on_cuda_driver" classname="poolipc-tests::handoff" timestamp="x" time="0.1">
<system-out>running 1 test
NOT RUN on hardware: a (no usable GPU: cudarc&apos;s candidates)
test a::on_cuda_driver ... ok
</system-out></testcase>
<testcase name="a::on_sim_driver" classname="poolipc-tests::handoff" time="0.1"><system-out>ok</system-out></testcase>
</testsuite></testsuites>"#;
        assert_eq!(
            not_run_tests(junit),
            vec![(
                "poolipc-tests::handoff::a::on_cuda_driver".to_string(),
                "NOT RUN on hardware: a (no usable GPU: cudarc's candidates)".to_string()
            )]
        );
    }
}
