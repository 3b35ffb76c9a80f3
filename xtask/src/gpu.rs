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
const RUN_SH: &str = r#"#!/usr/bin/env bash
# Generated by `cargo xtask gpu-bundle`. Runs the hardware tests and the doctor; logs in $OUT.
# `run.sh --mps-pass` (run by run.sh itself inside `poolipc mps`) runs the handoff and facade
# suites again as clients of a private MPS daemon. POOLIPC_PARTS picks parts (default
# "tests,tools,mps,bench,python"; "regress", this tree's bench against each baseline-*/poolipc
# in alternated pairs, "scaling", several workers at once with 1, 2 and 4 IO threads,
# "turns", the plain round trip by allocation size, and "pyscaling", Python's split and torch
# workers at once, run only when named);
# POOLIPC_TEST_BINS names test binaries (default all), so that one machine call stays within
# its time limit.
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
smi=$(command -v nvidia-smi || true)
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
      # A GPU test's processes are gone once it returned: any compute process still on the
      # GPU is one it left behind (a killed worker's kernel that never ends, say), and
      # slows every test after it.
      if [ -n "$smi" ] && [[ "$t" == *on_cuda_driver* || "$note" == *RAN* ]]; then
        local left; left=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null | tr '\n' ';')
        [ -n "$left" ] && note="$note left on the GPU: $left"
      fi
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
# The demo's rows took 13.6-13.9 ms after the test suite (H200 2026-12-05 call 1, H100 stop
# 33) and 0.6 ms in calls without it, the storm tests twice their time: whether something the
# suite leaves on the GPU (a killed worker's kernel that never ends, say) slows what follows.
gpu_state() {
  echo "GPU $1: $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>&1 | tr '\n' ' ')" >> "$summary"
  echo "compute processes $1: $(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>&1 | tr '\n' ';')" >> "$summary"
}
if want tests && want tools; then
  gpu_state "before the tests"
  "$here/poolipc" demo > "$out/demo-before.log" 2>&1; echo "demo before the tests exit: $?" >> "$summary"
  grep -E '^  (f32|bf16|i64|u8) ' "$out/demo-before.log" >> "$summary"
fi
want tests && suite "" "${bins[@]}"
want tests && gpu_state "after the tests"
repo=$(cd "$here/../.." && pwd)
if want tools; then
echo "--- poolipc doctor --probe-limit" >> "$summary"
"$here/poolipc" doctor --probe-limit > "$out/doctor.log" 2>&1; echo "doctor exit: $?" >> "$summary"
cat "$out/doctor.log" >> "$summary"
echo "--- poolipc demo" >> "$summary"
"$here/poolipc" demo > "$out/demo.log" 2>&1; echo "demo exit: $?" >> "$summary"
grep -v ' INFO ' "$out/demo.log" >> "$summary"
# Its rows took 13.6-13.9 ms on a fresh machine (H200 2026-12-05 call 1, H100 stop 33) and
# 0.6 ms elsewhere, the bench's round trips 0.3 ms in the same call: where a row's time goes.
rm -rf "$out/demo-probe"
echo "--- poolipc demo again under POOLIPC_PROBE: where its rows' time goes" >> "$summary"
POOLIPC_PROBE="$out/demo-probe" "$here/poolipc" demo > "$out/demo-probe.log" 2>&1; echo "demo (probe) exit: $?" >> "$summary"
grep -E '^  (f32|bf16|i64|u8) ' "$out/demo-probe.log" >> "$summary"
python3 "$repo/bench/probe_report.py" "$out/demo-probe" --skip 0 --count 8 --keep-waits --title "demo, its first rows" >> "$summary" 2>&1
rm -rf "$out/demo-probe"
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
if want regress; then
# This tree's bench against each baseline in the bundle (gpu-bundle --baseline REV), in
# alternated pairs in this one call: the card's run-to-run spread hides a 5% criterion in a
# single pair. POOLIPC_REGRESS_ARGS adds arguments to both (--sim tries it without a GPU).
npairs=${POOLIPC_REGRESS_PAIRS:-3}
found=0
for base in "$here"/baseline-*/poolipc; do
  [ -x "$base" ] || continue
  found=1
  rev=$(basename "$(dirname "$base")"); rev=${rev#baseline-}
  echo "--- regress: poolipc bench --max-mib 64 --copy-max-mib 64 --result-max-mib 64 --iterations 100 ${POOLIPC_REGRESS_ARGS:-}, this tree then $rev, $npairs pair(s)" >> "$summary"
  pairs=()
  for i in $(seq 1 "$npairs"); do
    ok=1
    for side in main "$rev"; do
      bin="$here/poolipc"; [ "$side" = main ] || bin="$base"
      f="$out/regress-$rev-$i-$side.json"
      start=$(date +%s)
      RUST_LOG=warn timeout "${POOLIPC_REGRESS_TIMEOUT_S:-150}" "$bin" bench --max-mib 64 --copy-max-mib 64 --result-max-mib 64 --iterations 100 ${POOLIPC_REGRESS_ARGS:-} --json-out "$f" > "$out/regress-$rev-$i-$side.log" 2>&1
      r=$?
      echo "regress pair $i, $side: exit $r ($(( $(date +%s) - start )) s)" >> "$summary"
      [ "$r" -eq 0 ] && [ -s "$f" ] || ok=0
    done
    if [ "$ok" -eq 1 ]; then pairs+=(--pair "$out/regress-$rev-$i-main.json" "$out/regress-$rev-$i-$rev.json"); else echo "regress pair $i: left out" >> "$summary"; fi
  done
  if [ ${#pairs[@]} -gt 0 ]; then
    python3 "$repo/bench/regress.py" --labels main "$rev" "${pairs[@]}" >> "$summary" 2>&1
    echo "regress.py exit: $? (0: no regression, 2: a regression)" >> "$summary"
  else
    echo "regress: no pair completed against $rev" >> "$summary"
  fi
done
[ "$found" -eq 1 ] || echo "regress: NOT RUN (no baseline in the bundle: cargo xtask gpu-bundle --baseline REV)" >> "$summary"
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
    # The Python round trip under MPS, beside the Rust bench's MPS table: issue 24's
    # "Python within 15 us of Rust" is read under MPS, where the turn-taking is gone.
    echo "--- bench/pybench.py under a private MPS daemon" >> "$summary"
    ( cd "$repo" && PYTHONPATH=/tmp/poolipc-site timeout 600 "$here/poolipc" mps --accept-shared-gpu-faults -- python3 bench/pybench.py --json ) > "$out/pybench-mps.log" 2>&1
    echo "pybench (MPS) exit: $?" >> "$summary"
    grep -v '^{' "$out/pybench-mps.log" | grep -v ' INFO ' | tail -12 >> "$summary"
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
if want scaling; then
# Issue 24: what stops several workers at once (the IO threads' busy share, 1, 2 and 4 IO
# threads), plainly and under MPS. Only when named.
mps=""; command -v nvidia-cuda-mps-control >/dev/null && mps="--mps"
echo "--- poolipc bench --workers 8 --io-threads 1,2,4 $mps (jobs/s, IO busy per thread, IO us per job)" >> "$summary"
RUST_LOG=warn timeout 240 "$here/poolipc" bench --workers 8 --io-threads 1,2,4 $mps > "$out/scaling-workers.log" 2>&1; echo "bench --workers --io-threads exit: $?" >> "$summary"
grep -vE " (INFO|WARN|DEBUG) " "$out/scaling-workers.log" >> "$summary"
# Which spinning threads compete for the cores with 8 workers (callers, IO threads, workers):
# under MPS (where the scaling is asked for), 1 and 4 IO threads, each spin turned off alone
# and all together.
inmps=""; [ -n "$mps" ] && inmps="$here/poolipc mps --accept-shared-gpu-faults --"
for v in "POOLIPC_SPIN_IN_FLIGHT_US=0 POOLIPC_WORKER_SPIN_US=0" "POOLIPC_SPIN_IN_FLIGHT_US=0" "POOLIPC_WORKER_SPIN_US=0"; do
  echo "--- ${mps:+under MPS: }poolipc bench --workers 8 --io-threads 1,4 with $v" >> "$summary"
  timeout 80 $inmps env RUST_LOG=warn $v "$here/poolipc" bench --workers 8 --io-threads 1,4 > "$out/scaling-spin.log" 2>&1; echo "bench --workers ($v) exit: $?" >> "$summary"
  grep -vE " (INFO|WARN|DEBUG) " "$out/scaling-spin.log" >> "$summary"
  cat "$out/scaling-spin.log" >> "$out/scaling-spin-all.log"
done
rm -f "$out/scaling-spin.log"
# Where each IO thread's time goes with 1, 2 and 4 workers under MPS (one IO thread, then
# four): the probe's marks per thread (`probe_report.py --threads`), the whole report in the
# logs, the IO threads' part in the summary.
if [ -n "$mps" ]; then
  rm -rf "$out/scaling-probe"
  echo "--- POOLIPC_PROBE poolipc bench --workers 4 --io-threads 1,4 --iterations 1000 under MPS: where the IO threads' time goes" >> "$summary"
  timeout 90 "$here/poolipc" mps --accept-shared-gpu-faults -- env RUST_LOG=warn POOLIPC_PROBE="$out/scaling-probe" "$here/poolipc" bench --workers 4 --io-threads 1,4 --iterations 1000 > "$out/scaling-probe.log" 2>&1; echo "bench --workers (probe) exit: $?" >> "$summary"
  grep -vE " (INFO|WARN|DEBUG) " "$out/scaling-probe.log" >> "$summary"
  python3 "$repo/bench/probe_report.py" "$out/scaling-probe" --threads --top 14 > "$out/scaling-probe-threads.txt" 2>&1
  python3 "$repo/bench/probe_report.py" "$out/scaling-probe" --threads --only io --top 14 >> "$summary" 2>&1
  rm -rf "$out/scaling-probe"
fi
fi
if want turns; then
# Without MPS a 4 KiB or 1 MiB lend took ~290 us and a 64 MiB one ~19 us (the same 4 KiB write
# by the worker; the floor paid ~300 us at every size): which allocation sizes pay the two
# processes' GPU turn-taking, and in which step (the probe's split at 4 KiB and at 64 MiB).
small="--copy-max-mib 0 --result-max-mib 0 --iterations 100"
echo "--- poolipc bench --sizes 4K,64K,1M,2M,4M,8M,16M,32M,64M,256M (plain): the round trip by allocation size" >> "$summary"
RUST_LOG=warn timeout 150 "$here/poolipc" bench --sizes 4K,64K,1M,2M,4M,8M,16M,32M,64M,256M $small > "$out/turns.log" 2>&1; echo "bench --sizes exit: $?" >> "$summary"
sed -n '/one tensor/,/^  re-lend:/p' "$out/turns.log" >> "$summary"
echo "--- the same at 4K,1M,64M with --worker-mode noop: the worker takes each job and finishes it (no memset of its own)" >> "$summary"
RUST_LOG=warn timeout 90 "$here/poolipc" bench --sizes 4K,1M,64M --worker-mode noop $small > "$out/turns-noop.log" 2>&1; echo "bench --sizes --worker-mode noop exit: $?" >> "$summary"
sed -n '/one tensor/,/^  re-lend:/p' "$out/turns-noop.log" >> "$summary"
# The bare driver's round trip (bench/floor.c) as it is, with the child writing nothing, and
# with the child freeing its import synchronously: which of its GPU steps the turn-taking is.
if [ -x /tmp/poolipc-floor ] || nvcc -O2 -o /tmp/poolipc-floor "$repo/bench/floor.c" -lcuda > "$out/turns-floor-build.txt" 2>&1; then
  for mode in "async stream wait import" "async stream wait skip" "sync stream wait import"; do
    echo "--- floor.c $mode (free, parent wait, READY, child target)" >> "$summary"
    timeout 60 /tmp/poolipc-floor $mode 2>&1 | grep handoff_round_trip | sed -E 's/.*"bytes": ([0-9]+).*"us_median": ([0-9.]+), "child_import_us": ([0-9.]+), "child_total_us": ([0-9.]+), "parent_gate_us": ([0-9.]+).*/  bytes \1: round trip \2 us, child import \3, child total \4, parent gate \5/' >> "$summary"
  done
else
  echo "floor.c did not build: $(tail -1 "$out/turns-floor-build.txt")" >> "$summary"
fi
for size in 4K 64M; do
  rm -rf "$out/turns-$size"
  RUST_LOG=warn POOLIPC_PROBE="$out/turns-$size" timeout 90 "$here/poolipc" bench --sizes $size $small > "$out/turns-$size.log" 2>&1; echo "bench --sizes $size (probe) exit: $?" >> "$summary"
  python3 "$repo/bench/probe_report.py" "$out/turns-$size" --skip 1 --count 100 --title "plain, $size recycled" >> "$summary" 2>&1
  python3 "$repo/bench/probe_report.py" "$out/turns-$size" --skip 102 --count 100 --title "plain, $size lent again" >> "$summary" 2>&1
  rm -rf "$out/turns-$size"
done
fi
if want pyscaling; then
# Python's share of a round trip (pysplit) and torch workers at once with 1 and 4 IO threads,
# plainly and under MPS. Only when named (with scaling, one call may pass its time limit).
mps=""; command -v nvidia-cuda-mps-control >/dev/null && mps="--mps"
if [ -n "$wheel" ] && python3 -c 'import torch' 2>/dev/null; then
  [ -d /tmp/poolipc-site/poolipc ] || python3 -m pip install -q --no-index --no-deps --target /tmp/poolipc-site "$wheel" $(ls "$here"/pywheels/*.whl 2>/dev/null) > "$out/scaling-pip.log" 2>&1
  # The torch suite first: the Python worker's calls on the caller's thread (pushing the
  # worker's device) under torch, a worker serving each job on a fresh thread among them.
  echo "--- python: tests/gpu_torch_test.py (the binding under torch, cudaMallocAsync)" >> "$summary"
  ( cd "$repo/crates/poolipc-python" && PYTHONPATH=/tmp/poolipc-site timeout 240 python3 -m pytest -v -rs tests/gpu_torch_test.py ) > "$out/scaling-torch.log" 2>&1
  r=$?; echo "python torch suite exit: $r" >> "$summary"
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$out/scaling-torch.log" | sed 's/^tests\/gpu_torch_test.py:://' | tail -45 >> "$summary"
  [ "$r" -eq 0 ] || echo "0 1" >> "$out/counts"
  for m in plain mps; do
    run=""; [ "$m" = mps ] && { [ -n "$mps" ] || continue; run="$here/poolipc mps --accept-shared-gpu-faults --"; }
    echo "--- bench/pysplit.py ($m)" >> "$summary"
    ( cd "$repo" && PYTHONPATH=/tmp/poolipc-site POOLIPC_BIN="$here/poolipc" timeout 130 $run python3 bench/pysplit.py --probe "$out/pysplit-$m" ) > "$out/scaling-pysplit-$m.log" 2>&1
    echo "pysplit ($m) exit: $?" >> "$summary"
    grep -v ' INFO ' "$out/scaling-pysplit-$m.log" | tail -45 >> "$summary"
    rm -rf "$out/pysplit-$m"
    echo "--- bench/pybench.py --results ($m)" >> "$summary"
    ( cd "$repo" && PYTHONPATH=/tmp/poolipc-site timeout 60 $run python3 bench/pybench.py --results ) > "$out/scaling-results-$m.log" 2>&1
    echo "pybench --results ($m) exit: $?" >> "$summary"
    grep -v ' INFO ' "$out/scaling-results-$m.log" | tail -8 >> "$summary"
    for n in 1 4; do
      echo "--- bench/pybench.py --workers 8 ($m, POOLIPC_IO_THREADS=$n)" >> "$summary"
      ( cd "$repo" && PYTHONPATH=/tmp/poolipc-site POOLIPC_IO_THREADS=$n timeout 110 $run python3 bench/pybench.py --workers 8 ) > "$out/scaling-pybench-$m-$n.log" 2>&1
      echo "pybench --workers ($m, $n IO threads) exit: $?" >> "$summary"
      grep -v ' INFO ' "$out/scaling-pybench-$m-$n.log" | tail -12 >> "$summary"
    done
  done
else
  echo "pyscaling: NOT RUN (no wheel in the bundle, or no torch here)" >> "$summary"
fi
fi
if want hog; then
# Whether a killed process's kernel that never ends keeps the GPU busy for the others (the
# hang tests SIGKILL workers spinning in one; the demo after the suite was 20x slower). Only
# when named.
echo "--- bench/probes/killed_kernel.py: a tiny GPU job's time before, beside and after a killed never-ending kernel" >> "$summary"
( cd "$repo" && timeout 90 python3 bench/probes/killed_kernel.py 30 ) > "$out/hog.log" 2>&1; echo "killed_kernel exit: $?" >> "$summary"
python3 - "$out/hog.log" >> "$summary" 2>&1 <<'PY'
import json, sys
lines = open(sys.argv[1]).read().strip().splitlines()
try:
    d = json.loads(lines[-1])
except (IndexError, ValueError):
    print("  no result; the probe's last lines:")
    print("\n".join("    " + line for line in lines[-6:]))
    sys.exit(0)
print(f"  alone {d['alone_us']} us, beside the spinner {d['beside_spinner_us']} us, child reaped after {d['child_reaped_after_s']} s")
print(f"  processes beside the spinner: {d['processes_beside_spinner']}")
for x in d["after_kill"][::4]:
    print(f"  {x['t']:6.2f} s after the kill: {x['us']:9.1f} us, processes {x['processes']}")
print(f"  {d['verdict']}")
PY
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
    fn regress_is_not_a_default_part() {
        let line = RUN_SH
            .lines()
            .find(|l| l.starts_with("parts=${POOLIPC_PARTS:-"))
            .expect("run.sh sets its parts");
        assert!(!line.contains("regress"), "{line}");
        assert!(RUN_SH.contains("if want regress; then"));
        // The scaling part (issue 24's tables) is asked for by name too.
        assert!(!line.contains("scaling"), "{line}");
        assert!(RUN_SH.contains("if want scaling; then"));
        assert!(!line.contains("turns"), "{line}");
        assert!(RUN_SH.contains("if want turns; then"));
        assert!(RUN_SH.contains("if want pyscaling; then"));
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
