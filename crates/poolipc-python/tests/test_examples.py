"""The Python examples run as written (examples/handoff_parent.py and its worker,
examples/fan_out.py), and the benches' control flow runs here."""

import os
import pathlib
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def test_the_handoff_example_runs_on_the_simulated_driver():
    env = dict(os.environ, POOLIPC_DRIVER="sim")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "handoff_parent.py")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "got them doubled" in out.stdout
    assert "by pool pointer" in out.stdout


def test_the_fan_out_example_runs_on_the_simulated_driver():
    """examples/fan_out.py: one thread, three workers, each job's answer checked, every job
    taken through poolipc.wait_any."""
    env = dict(os.environ, POOLIPC_DRIVER="sim")
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "fan_out.py")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "one thread, 3 workers: 15 jobs, every answer right" in out.stdout, out.stdout


def test_pysplit_runs_on_the_simulated_driver_and_prints_every_row():
    """`bench/pysplit.py` (Python split and scaling) runs as its docstring says, on
    SimDriver, with a handful of jobs: every pair at both sizes, then the --workers table (Python
    workers, the same threads with Rust workers, one thread driving them all, and Rust's own)."""
    import pytest

    from conftest import poolipc_binary

    binary = poolipc_binary()
    if binary is None:
        pytest.skip("no poolipc binary built (cargo build -p poolipc-cli)")
    script = EXAMPLES.parent.parent.parent / "bench" / "pysplit.py"
    env = dict(os.environ, POOLIPC_DRIVER="sim", POOLIPC_BIN=binary)
    env.pop("POOLIPC_PROBE", None)
    out = subprocess.run([sys.executable, str(script), "--jobs", "20"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for pair in ("rust -> rust", "rust -> rust, own stream", "python -> rust", "python -> python"):
        for size in ("4 KiB", "64 MiB"):
            assert any(line.split()[:len(pair.split())] == pair.split() and size in line
                       and line.split()[-1].replace(".", "").lstrip("+-").isdigit()
                       for line in out.stdout.splitlines()), (pair, size, out.stdout)
    out = subprocess.run([sys.executable, str(script), "--workers", "2", "--jobs", "10"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    # workers, then jobs/s and "x one" for python -> python, python -> rust, one thread to
    # every worker, and rust -> rust.
    assert [r[0] for r in rows] == ["1", "2"] and all(len(r) == 9 for r in rows), out.stdout
    assert all(float(v) > 0 for r in rows for v in r[1::2]), out.stdout
    bad = subprocess.run([sys.executable, str(script), "--workers", "0"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--workers 0: give 1 to 64" in bad.stderr


def test_pybench_runs_its_tables_over_stand_ins():
    """`bench/pybench.py` needs torch and a GPU; over stand-ins for torch and poolipc
    (tests/bench_fakes: each job 0.2 ms) its control flow runs here: the --workers tables in
    three rounds (a range column, one worker 1.00-1.00x) and the one-thread table, and the
    main table with its written column (torch.multiprocessing not measured without torch)."""
    script = EXAMPLES.parent.parent.parent / "bench" / "pybench.py"
    fakes = pathlib.Path(__file__).parent / "bench_fakes"
    env = dict(os.environ, PYTHONPATH=str(fakes), POOLIPC_BENCH_WINDOW_MS="20", POOLIPC_BENCH_ROUNDS="3")
    out = subprocess.run([sys.executable, str(script), "--workers", "2"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    threads = lines.index("  the same torch workers driven by one thread (submit to each, then wait the oldest, or with")
    assert lines[threads + 2].split() == ["size", "workers", "oldest/s", "x", "one", "any/s", "x", "one"], out.stdout
    for size in ("4KiB", "64MiB"):
        for n in ("1", "2"):
            row = [ln.split() for ln in lines[:threads] if ln.split()[:2] == [size, n]]
            assert len(row) == 1 and len(row[0]) == 7, out.stdout
            lo, hi = (float(x) for x in row[0][6].rstrip("x").split("-"))
            assert 0 < lo <= hi and (n != "1" or lo == hi == 1.0), row
            one = [ln.split() for ln in lines[threads:] if ln.split()[:2] == [size, n]]
            assert len(one) == 1 and len(one[0]) == 6, out.stdout
            # Oldest first and wait_any, each with its ratio to one worker: the stand-in's
            # jobs (0.2 ms of sleep each) overlap, so two workers give more than one.
            assert float(one[0][2]) > 0 and float(one[0][4]) > 0, one
            assert n == "1" or (float(one[0][3].rstrip("x")) > 1.2 and float(one[0][5].rstrip("x")) > 1.2), one
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "torch.multiprocessing: NOT MEASURED" in out.stdout, out.stdout
    rows = [ln.split() for ln in out.stdout.splitlines() if ln.split()[:1] in (["4KiB"], ["4GiB"])]
    assert len(rows) == 2 and all(len(r) == 7 and r[4].endswith("x") for r in rows), out.stdout


def test_pyturns_runs_on_the_simulated_driver_and_prints_its_rows():
    """`bench/pyturns.py` (which of a Python worker's steps brings the GPU's turn-taking back)
    runs on SimDriver: the worker that does nothing, and the torch rows where torch is here;
    a bad --jobs is refused."""
    script = EXAMPLES.parent.parent.parent / "bench" / "pyturns.py"
    env = dict(os.environ, POOLIPC_DRIVER="sim")
    out = subprocess.run([sys.executable, str(script), "--jobs", "10"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line[:20].strip(): line[20:].split() for line in out.stdout.splitlines()
            if line.startswith("  ") and not line.startswith("  the worker")}
    assert float(rows["nothing"][0]) > 0 and rows["nothing"][1:] == ["pool", "pointer"], out.stdout
    try:
        import torch  # noqa: F401
    except ImportError:
        assert "no torch here" in out.stderr and len(rows) == 1, out.stdout + out.stderr
    else:
        assert len(rows) == 5, out.stdout
    bad = subprocess.run([sys.executable, str(script), "--jobs", "0"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--jobs 0: give 1 or more" in bad.stderr
