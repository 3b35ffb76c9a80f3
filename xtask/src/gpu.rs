//! `cargo xtask gpu-bundle`: the hardware tests, the `poolipc` binary and the example, built for
//! release into `target/gpu-bundle/` with a `run.sh` that runs them all on a GPU machine and
//! writes a summary and the logs under `$OUT` (see `docs/gpu.md`).

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

pub(crate) fn gpu_bundle(root: &Path) -> Result<PathBuf> {
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
