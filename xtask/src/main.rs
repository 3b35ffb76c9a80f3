//! `cargo xtask`: the project's chores, runnable by a newcomer.
//!
//! - `cargo xtask ci`: what CI runs (fmt, clippy, tests, doc tests, rustdoc, cargo-deny, the
//!   fuzz targets built and each run for 60 s).
//! - `cargo xtask tidy`: the tidy rules alone (`xtask/src/tidy/`), the first step of `ci`.
//! - `cargo xtask gpu-bundle`: release builds of the hardware tests and the `poolipc` binary,
//!   with a `run.sh`, into `target/gpu-bundle/` (see `docs/gpu.md`). `--baseline REV`
//!   (repeatable) adds that revision's `poolipc`, for run.sh's `regress` part.
//! - `cargo xtask gpu-test`: the bundle, then its `run.sh`, on this machine's GPU.
//! - `cargo xtask public-api [--bless]`: each library crate's public items against the
//!   snapshot in `xtask/public-api/` (the counts; `--bless` writes the snapshots again).
//! - `cargo xtask fuzz [--secs N]`: each fuzz target (the contract's operations, the frame
//!   codec) for N seconds (60 by default); a crash fails it, its input saved under
//!   `fuzz/artifacts/<target>/`.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

mod gpu;
mod public_api;
mod rust_rules;
mod tidy;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = root()?;
    std::env::set_current_dir(&root)?;
    match args.first().map(String::as_str) {
        Some("ci") => ci(),
        Some("tidy") => tidy::check(&root),
        Some("gpu-bundle") => gpu::gpu_bundle(&root, &gpu::baseline_args(&args[1..])?).map(|_| ()),
        Some("gpu-test") => {
            let bundle = gpu::gpu_bundle(&root, &gpu::baseline_args(&args[1..])?)?;
            run(Command::new(bundle.join("run.sh")))
        }
        Some("public-api") if args.get(1).map(String::as_str) == Some("--count") => {
            // The counts of another checkout (an older commit's, for a comparison).
            let other = PathBuf::from(args.get(2).context("--count DIR")?);
            for (krate, lib) in public_api::CRATES {
                let n = public_api::list(&other.join(lib))?.len();
                println!("{krate}: {n} public items");
            }
            Ok(())
        }
        Some("public-api") => {
            let bless = args.get(1).map(String::as_str) == Some("--bless");
            for (krate, n) in public_api::check(&root, bless)? {
                println!("{krate}: {n} public items");
            }
            Ok(())
        }
        Some("fuzz") => {
            // `--secs N`, or N alone.
            let secs = match args.get(1).map(String::as_str) {
                Some("--secs") => args.get(2).map(String::as_str),
                other => other,
            };
            let secs: u64 = secs
                .map_or(Ok(FUZZ_SECS), str::parse)
                .context("fuzz: --secs takes a whole number of seconds")?;
            fuzz_run(secs)
        }
        _ => {
            eprintln!(
                "usage: cargo xtask <ci | tidy | gpu-bundle [--baseline REV]... | gpu-test [--baseline REV]... | public-api [--bless | --count DIR] | fuzz [--secs N]>"
            );
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
    for (krate, n) in public_api::check(&root()?, false)? {
        eprintln!("public API: {krate} {n} items, as in xtask/public-api/{krate}.txt");
    }
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
    let report = std::fs::read_to_string(&junit)
        .with_context(|| format!("reading nextest's report {}", junit.display()))?;
    let not_run = not_run_tests(&report);
    let counts = TestCounts::of(&report, not_run.len());
    // Right under nextest's own line, which counts a body that did not run as passed.
    let gpu = not_run
        .iter()
        .filter(|(_, why)| why.contains("on hardware"))
        .count();
    eprintln!(
        "of which {} test bodies did not run here ({gpu} GPU bodies without a usable GPU, {} others; listed at the end): {counts}",
        not_run.len(),
        not_run.len() - gpu
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
    package_lists(&root()?)?;
    publish_dry_run()?;
    fuzz_run(FUZZ_SECS)?;
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
    // The last line, in the plain form tools and readers expect.
    eprintln!("{counts}");
    Ok(())
}

/// nextest's tests, told apart: a body that printed `NOT RUN` passed without running, and
/// counts as not run here, not as passed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TestCounts {
    passed: usize,
    failed: usize,
    not_run: usize,
}

impl TestCounts {
    /// The counts of nextest's JUnit report, `not_run` of whose passes did not run their body.
    /// A test skipped by nextest counts as not run too.
    fn of(junit: &str, not_run: usize) -> TestCounts {
        let (mut total, mut failed, mut skipped) = (0usize, 0usize, 0usize);
        for case in junit.split("<testcase").skip(1) {
            let body = case.split("</testcase>").next().unwrap_or(case);
            total += 1;
            if body.contains("<failure") || body.contains("<error") {
                failed += 1;
            } else if body.contains("<skipped") {
                skipped += 1;
            }
        }
        let not_run = not_run + skipped;
        TestCounts {
            passed: total.saturating_sub(failed + not_run),
            failed,
            not_run,
        }
    }
}

impl std::fmt::Display for TestCounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} passed, {} failed, {} not run",
            self.passed, self.failed, self.not_run
        )
    }
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

/// What every publishable package must carry: a registry shows its own README (whose links
/// must not be relative: they would point into a repository the page is not in), and the
/// licence texts travel with the code.
const PACKAGE_MUST_CARRY: &[&str] = &["README.md", "LICENSE-MIT", "LICENSE-APACHE", "Cargo.toml"];

/// `cargo package --list` of every publishable crate: each carries [`PACKAGE_MUST_CARRY`],
/// its licence files are the repository's own (copies, not links, the same bytes), and its
/// README links only by full address.
fn package_lists(root: &Path) -> Result<()> {
    let mut problems = Vec::new();
    let root_licences = ["LICENSE-MIT", "LICENSE-APACHE"]
        .map(|l| std::fs::read(root.join(l)).with_context(|| format!("reading {l}")));
    for krate in std::iter::once("poolipc").chain(WORKSPACE_PACKAGES.iter().copied()) {
        let out = cargo()
            .args(["package", "--list", "--allow-dirty", "-p", krate])
            .current_dir(root)
            .output()
            .context("cargo package --list")?;
        if !out.status.success() {
            bail!(
                "cargo package --list -p {krate}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let listed = String::from_utf8_lossy(&out.stdout);
        for must in PACKAGE_MUST_CARRY {
            if !listed.lines().any(|l| l == *must) {
                problems.push(format!("{krate}: its package lacks {must}"));
            }
        }
        let dir = root.join("crates").join(krate);
        for (name, want) in ["LICENSE-MIT", "LICENSE-APACHE"].iter().zip(&root_licences) {
            let path = dir.join(name);
            let link = std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink());
            match (std::fs::read(&path), want) {
                _ if link => problems.push(format!("{krate}/{name} is a link: copy the file")),
                (Ok(got), Ok(want)) if &got == want => {}
                (Ok(_), Ok(_)) => {
                    problems.push(format!("{krate}/{name} differs from the repository's"))
                }
                (Err(e), _) => problems.push(format!("{krate}/{name}: {e}")),
                (_, Err(e)) => problems.push(format!("{name} at the root: {e}")),
            }
        }
        let readme = std::fs::read_to_string(dir.join("README.md")).unwrap_or_default();
        for (n, line) in readme.lines().enumerate() {
            let mut rest = line;
            while let Some(at) = rest.find("](") {
                rest = &rest[at + 2..];
                let target = rest.split(')').next().unwrap_or("");
                if !target.contains("://") {
                    problems.push(format!(
                        "{krate}/README.md:{}: the link `{target}` is relative; a registry page cannot follow it",
                        n + 1
                    ));
                }
            }
        }
    }
    if !problems.is_empty() {
        bail!(
            "packages not ready for a registry:\n{}",
            problems.join("\n")
        );
    }
    eprintln!(
        "cargo package --list: every publishable crate carries its README and the licence files"
    );
    Ok(())
}

/// The workspace's publishable packages (their unpacked dry-run copies are removed first).
const WORKSPACE_PACKAGES: &[&str] = &[
    "poolipc-types",
    "poolipc-driver",
    "poolipc-pool",
    "poolipc-contract",
    "poolipc-transport",
    "poolipc-mps",
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

/// How long CI (and `cargo xtask fuzz` by default) runs each fuzz target.
const FUZZ_SECS: u64 = 60;

/// Builds the fuzz targets, then runs each for `secs` seconds. cargo-fuzz saves a crashing
/// input under `fuzz/artifacts/<target>/` and exits non-zero: that fails this, naming the file
/// to replay with `cargo fuzz run <target> <file>`.
fn fuzz_run(secs: u64) -> Result<()> {
    fuzz_build()?;
    for target in ["contract_ops", "frame_decode"] {
        let mut c = fuzz_command("run");
        c.args([target, "--", &format!("-max_total_time={secs}")]);
        run(c).with_context(|| {
            format!(
                "fuzz target {target} found a crash: its input is under fuzz/artifacts/{target}/ \
                 (replay: cargo fuzz run --sanitizer none {target} <that file>, with RUSTC_BOOTSTRAP=1 on stable)"
            )
        })?;
    }
    Ok(())
}

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
    fn every_publishable_package_carries_its_readme_and_licences() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the workspace root");
        package_lists(root).expect("ready for a registry");
    }

    #[test]
    fn a_body_that_did_not_run_is_not_counted_as_passed() {
        let junit = r#"<testsuites tests="4"><testsuite name="t">
<testcase name="gpu" classname="t"><system-out>NOT RUN on hardware: gpu (no usable GPU: none)</system-out></testcase>
<testcase name="sim" classname="t"><system-out>ok</system-out></testcase>
<testcase name="bad" classname="t"><failure message="x"/></testcase>
<testcase name="off" classname="t"><skipped/></testcase>
</testsuite></testsuites>"#;
        let counts = TestCounts::of(junit, not_run_tests(junit).len());
        assert_eq!(
            counts,
            TestCounts {
                passed: 1,
                failed: 1,
                not_run: 2
            }
        );
        assert_eq!(counts.to_string(), "1 passed, 1 failed, 2 not run");
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
