//! `cargo xtask gpu-bundle`: the hardware tests, the `poolipc` binary and the example, built for
//! release into `target/gpu-bundle/` with a `run.sh` that runs them all on a GPU machine and
//! writes a summary and the logs under `$OUT` (see `docs/gpu.md`). With `--baseline REV`, the
//! `poolipc` binary of each such revision as well, for run.sh's `regress` part.

use std::path::{Path, PathBuf};

use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{build_wheel, cargo, python_env, run};

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

/// The device machine's carry: the packed bundle must fit in it.
const CARRY_LIMIT: u64 = 64 << 20;

/// The folder of a baseline's binary in the bundle; run.sh's `regress` part finds it by this
/// name.
fn baseline_dir_name(short_rev: &str) -> String {
    format!("baseline-{short_rev}")
}

/// `REV`'s commit, full and short (seven hex digits), or a clear error for a name git does not
/// know.
fn resolve_rev(root: &Path, rev: &str) -> Result<(String, String)> {
    let parse = |args: &[&str]| -> Result<String> {
        let out = Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()
            .context("running git rev-parse")?;
        if !out.status.success() {
            let why = String::from_utf8_lossy(&out.stderr).trim().to_owned();
            bail!(
                "baseline {rev}: no such commit in this repository{}",
                if why.is_empty() {
                    String::new()
                } else {
                    format!(" ({why})")
                }
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    let commit = format!("{rev}^{{commit}}");
    let full = parse(&["rev-parse", "--verify", "--quiet", &commit])?;
    let short = parse(&["rev-parse", "--short=7", &full])?;
    Ok((full, short))
}

/// Builds `rev`'s `poolipc` (release, stripped) in a detached worktree under
/// `target/baselines/<short rev>` with its own target folder there, reusing both when present,
/// and copies it into the bundle as `baseline-<short rev>/poolipc`. Returns the short rev.
fn build_baseline(root: &Path, bundle: &Path, rev: &str) -> Result<String> {
    let (full, short) = resolve_rev(root, rev)?;
    let tree = root.join("target/baselines").join(&short);
    if tree.join(".git").exists() {
        eprintln!("gpu bundle: baseline {short}: reusing {}", tree.display());
        // A reused folder may have been moved to another commit by hand.
        let mut c = Command::new("git");
        c.arg("-C")
            .arg(&tree)
            .args(["checkout", "--quiet", "--detach", &full]);
        run(c).with_context(|| format!("baseline {rev}: checking out {full}"))?;
    } else {
        eprintln!(
            "gpu bundle: baseline {short}: a worktree at {}",
            tree.display()
        );
        std::fs::create_dir_all(root.join("target/baselines"))?;
        let mut c = Command::new("git");
        c.arg("-C")
            .arg(root)
            .args(["worktree", "add", "--detach"])
            .arg(&tree)
            .arg(&full);
        run(c).with_context(|| format!("baseline {rev}: adding a worktree"))?;
    }
    eprintln!("gpu bundle: baseline {short}: building poolipc (release)");
    let target = tree.join("target");
    let mut c = cargo();
    // Stripped whatever that revision's release profile says: the bundle must stay small.
    c.current_dir(&tree).env("CARGO_TARGET_DIR", &target).args([
        "build",
        "--release",
        "--config",
        "profile.release.strip=true",
        "-p",
        "poolipc-cli",
    ]);
    run(c).with_context(|| format!("baseline {rev} ({short}) does not build"))?;
    let dir = bundle.join(baseline_dir_name(&short));
    std::fs::create_dir_all(&dir)?;
    copy(&target.join("release/poolipc"), &dir.join("poolipc"))?;
    let bytes = std::fs::metadata(dir.join("poolipc"))?.len();
    eprintln!(
        "gpu bundle: baseline {short}: {} ({:.1} MiB)",
        dir.join("poolipc").display(),
        mib(bytes)
    );
    Ok(short)
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 20)
}

/// The revisions of `--baseline REV` (repeatable) in `gpu-bundle`'s arguments; anything else
/// is an error.
pub(crate) fn baseline_args(args: &[String]) -> Result<Vec<String>> {
    let mut revs = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--baseline" => revs.push(
                it.next()
                    .filter(|r| !r.starts_with("--"))
                    .context("--baseline needs a revision (--baseline REV)")?
                    .clone(),
            ),
            other => bail!(
                "gpu-bundle: unknown argument {other} (usage: gpu-bundle [--baseline REV]...)"
            ),
        }
    }
    Ok(revs)
}

/// `cargo xtask gpu-bundle [--baseline REV]...`: the bundle, with each baseline's `poolipc`.
pub(crate) fn gpu_bundle(root: &Path, baselines: &[String]) -> Result<PathBuf> {
    let bundle = root.join("target/gpu-bundle");
    if bundle.exists() {
        std::fs::remove_dir_all(&bundle)?;
    }
    std::fs::create_dir_all(bundle.join("tests"))?;
    // The baselines first: a revision that does not build fails the command before the long
    // part.
    let mut shorts = Vec::new();
    for rev in baselines {
        let short = build_baseline(root, &bundle, rev)?;
        if shorts.contains(&short) {
            bail!("baseline {rev} ({short}) is given twice");
        }
        shorts.push(short);
    }
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
        "gpu bundle packed: {} ({:.1} MiB of the carry's {:.0} MiB{}): carry target/gpu-pack, run \
         `tar xJf target/gpu-pack/gpu-bundle.tar.xz -C target && target/gpu-bundle/run.sh`",
        pack.join("gpu-bundle.tar.xz").display(),
        mib(packed),
        mib(CARRY_LIMIT),
        if shorts.is_empty() {
            String::new()
        } else {
            format!(", with baseline {}", shorts.join(", "))
        }
    );
    if packed > CARRY_LIMIT {
        bail!(
            "the packed bundle ({:.1} MiB) does not fit the device's carry ({:.0} MiB): give fewer \
             --baseline revisions",
            mib(packed),
            mib(CARRY_LIMIT)
        );
    }
    Ok(bundle)
}

/// Runs every test of every binary in its own process (the shared pool is per process, as it
/// is for nextest), then `poolipc doctor --probe-limit`, `poolipc demo` and `poolipc bench`,
/// and, when asked, `bench/regress.py` over alternated pairs of benches against each baseline;
/// logs under $OUT, a table last.
const RUN_SH: &str = include_str!("gpu_run.sh");

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn baseline_is_repeatable() {
        let revs = baseline_args(&strings(&["--baseline", "57719ac", "--baseline", "HEAD~3"]));
        assert_eq!(revs.unwrap(), strings(&["57719ac", "HEAD~3"]));
        assert!(baseline_args(&[]).unwrap().is_empty());
    }

    #[test]
    fn baseline_without_a_revision_or_an_unknown_argument_is_refused() {
        assert!(baseline_args(&strings(&["--baseline"])).is_err());
        assert!(baseline_args(&strings(&["--baseline", "--baseline", "x"])).is_err());
        assert!(baseline_args(&strings(&["--base", "x"])).is_err());
    }

    #[test]
    fn run_sh_parses_as_bash() {
        let out = Command::new("bash")
            .args(["-n", "-c", RUN_SH])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn parts_run_only_when_named_are_not_default_parts() {
        let line = RUN_SH
            .lines()
            .find(|l| l.starts_with("parts=${POOLIPC_PARTS:-"))
            .expect("run.sh sets its parts");
        // regress and the measurement parts are asked for by name.
        for part in [
            "regress",
            "scaling",
            "turns",
            "pyscaling",
            "onethread",
            "gputurns",
            "mpsspin",
            "floorscale",
            "torchmp",
            "rogue",
        ] {
            assert!(!line.contains(part), "{part}: {line}");
            assert!(
                RUN_SH.contains(&format!("if want {part}; then")),
                "run.sh has no part {part}"
            );
        }
    }

    #[test]
    fn regress_py_self_test_passes() {
        let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/regress.py");
        let out = Command::new("python3")
            .arg(py)
            .arg("--self-test")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A `poolipc` that writes a bench report whose 4 KiB recycled round trip takes `us`.
    fn fake_poolipc(path: &Path, us: &str) {
        let script = format!(
            "#!/usr/bin/env bash\n\
             out=\"\"\n\
             while [ $# -gt 0 ]; do [ \"$1\" = --json-out ] && out=$2; shift; done\n\
             echo '{{\"round_trip\":[{{\"bytes\":4096,\"recycled_median_us\":{us},\"relend_median_us\":9.0}}],\
             \"batch\":{{\"tensors\":8,\"tensor_bytes\":4096,\"median_s\":0.001}}}}' > \"$out\"\n"
        );
        std::fs::write(path, script).unwrap();
        let mut perms = std::fs::metadata(path).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(path, perms).unwrap();
    }

    #[test]
    fn regress_part_alternates_pairs_and_flags_a_row_slower_in_every_pair() {
        // The layout of a checkout with its bundle: <repo>/target/gpu-bundle, <repo>/bench.
        let repo = std::env::temp_dir().join(format!("xtask-regress-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&repo);
        let bundle = repo.join("target/gpu-bundle");
        std::fs::create_dir_all(bundle.join(baseline_dir_name("abc1234"))).unwrap();
        std::fs::create_dir_all(repo.join("bench")).unwrap();
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/regress.py"),
            repo.join("bench/regress.py"),
        )
        .unwrap();
        std::fs::write(bundle.join("run.sh"), RUN_SH).unwrap();
        fake_poolipc(&bundle.join("poolipc"), "11.0");
        fake_poolipc(&bundle.join("baseline-abc1234/poolipc"), "10.0");
        let out = repo.join("out");
        let status = Command::new("bash")
            .arg(bundle.join("run.sh"))
            .env("POOLIPC_PARTS", "regress")
            .env("POOLIPC_REGRESS_PAIRS", "2")
            .env("OUT", &out)
            .output()
            .unwrap();
        let summary = std::fs::read_to_string(out.join("summary.txt")).unwrap();
        let _ = std::fs::remove_dir_all(&repo);
        assert!(status.status.success(), "{summary}");
        for want in [
            "regress pair 1, main: exit 0",
            "regress pair 1, abc1234: exit 0",
            "regress pair 2, main: exit 0",
            "regress pair 2, abc1234: exit 0",
            "medians over 2 alternated pair(s)",
            "regress.py exit: 2",
        ] {
            assert!(summary.contains(want), "no {want:?} in:\n{summary}");
        }
        let row = |name: &str| {
            summary
                .lines()
                .find(|l| l.trim_start().starts_with(name))
                .unwrap_or_else(|| panic!("no {name} row in:\n{summary}"))
                .to_owned()
        };
        let recycled = row("round trip, recycled");
        assert!(
            recycled.contains("1.10x") && recycled.ends_with("REGRESSION"),
            "{recycled}"
        );
        assert!(row("round trip, re-lend").ends_with(" ok"));
        assert!(row("batch, 8 tensors").ends_with(" ok"));
    }
}
