"""The simulated GPU's race checker from Python: a parent that writes an input its worker is
reading fails the job with SimViolationError naming both calls; the same program written
right, and a result read on the legacy stream after its job, report nothing; the pytest
fixture of poolipc.testing fails a test on a violation.

Run: POOLIPC_DRIVER=sim python -m pytest crates/poolipc-python/tests/test_sim_race_check.py
(the module sets it too).
"""

import os
import struct
import sys
import time

import pytest

os.environ.setdefault("POOLIPC_DRIVER", "sim")
if os.environ["POOLIPC_DRIVER"] != "sim":
    pytest.skip("test_sim_race_check.py runs on the simulated driver only", allow_module_level=True)

import poolipc  # noqa: E402
import poolipc.testing  # noqa: E402

from conftest import py_worker_argv  # noqa: E402

pytest_plugins = ["poolipc.testing"]

N = 64


@pytest.fixture(scope="module")
def parent():
    if not poolipc._native.is_installed():
        poolipc.install_pool(0)
    return poolipc.Parent(0)


def f32_buffer(parent, value, stream):
    buf = parent.alloc(4 * N, dtype="float32", shape=[N])
    parent.write(buf.ptr, struct.pack(f"<{N}f", *([value] * N)), stream=stream)
    return buf


def mistake(parent, tmp_path):
    """A parent that writes an input while its worker (which writes its inputs) holds the
    job: the job, the worker, the input."""
    gate, report = tmp_path / "gate", tmp_path / "report"
    w = parent.spawn(py_worker_argv(), {"POOLIPC_TEST_MODE": "gate-write",
                                        "POOLIPC_TEST_GATE": str(gate),
                                        "POOLIPC_TEST_REPORT": str(report)})
    buf = f32_buffer(parent, 1.0, 0)
    job = parent.submit(w, [poolipc.TensorRef(buf.ptr, "float32", [N])])
    # The worker holds the job (READY was recorded and waited for) ...
    deadline = time.monotonic() + 30
    while not (report.exists() and "entered" in report.read_text()):
        assert time.monotonic() < deadline, "the worker never took the job"
        time.sleep(0.01)
    # ... and the mistake: the input is the worker's until the job ends, and nothing orders
    # this write with the worker's.
    parent.fill(buf.ptr, 4 * N, 0, stream=0)
    gate.touch()
    return job, w, buf


def test_a_parent_writing_an_input_during_its_job_fails_it_naming_both_calls(parent, tmp_path):
    used_before = poolipc.memory_stats()["used_current"]
    job, w, buf = mistake(parent, tmp_path)
    with pytest.raises(poolipc.SimViolationError) as caught:
        job.wait()
    # The job's echoed result is freed with the error: once the input goes too, the pool's
    # used bytes are back where they were.
    buf.free()
    deadline = time.monotonic() + 5
    while poolipc.memory_stats()["used_current"] > used_before:
        assert time.monotonic() < deadline, (
            f"{poolipc.memory_stats()['used_current'] - used_before} bytes still used "
            "after the failed job and its input were freed")
        time.sleep(0.01)
    e = caught.value
    text = str(e)
    print(text)
    assert e.worker == w
    assert isinstance(e.seed, int)
    assert f"POOLIPC_SIM_SEED={e.seed}" in text
    assert any("input 0 of job" in v and "cuMemsetD8Async" in v and "the parent (pid" in v
               and f"worker {w} (pid" in v and "unordered access" in v
               for v in e.violations), text
    assert parent.stop(w) == 0


def test_the_program_written_right_reports_nothing_and_a_legacy_read_after_wait_is_ordered(
        parent):
    before = poolipc.sim_report()
    seen = len(before.violations)
    w = parent.spawn(py_worker_argv(), {"POOLIPC_TEST_MODE": "write-inputs"})
    stream = 0
    start, jobs = time.monotonic(), 0
    while jobs < 200 and time.monotonic() - start < 10:
        buf = f32_buffer(parent, float(jobs), stream)
        (result,) = parent.run(w, [poolipc.TensorRef(buf.ptr, "float32", [N])])
        # After the job ended, the legacy stream (no stream given) is ordered after the
        # worker's DONE: the parent's IO thread saw it complete on the host.
        got = parent.read(result.ptr, 4 * N)
        assert got[4:8] == struct.pack("<f", float(jobs))
        result.free()
        buf.free()
        jobs += 1
    assert parent.stop(w) == 0
    report = poolipc.sim_report()
    assert report.violations[seen:] == [], report.text
    print(f"{jobs} jobs, nothing reported")
    assert jobs >= 20


def test_assert_no_violations_fails_with_the_report(parent, tmp_path):
    seen = len(poolipc.sim_report().violations)
    job, w, _buf = mistake(parent, tmp_path)
    with pytest.raises(poolipc.SimViolationError):
        job.wait()
    parent.stop(w)
    with pytest.raises(AssertionError, match="(?s)race checker found 1 violation .*POOLIPC_SIM_SEED=.*cuMemsetD8Async"):
        poolipc.testing.assert_no_violations(seen)


def test_the_fixture_passes_a_program_written_right(parent, sim_checked):
    w = parent.spawn(py_worker_argv(), {"POOLIPC_TEST_MODE": "write-inputs"})
    buf = f32_buffer(parent, 2.5, 0)
    (result,) = parent.run(w, [poolipc.TensorRef(buf.ptr, "float32", [N])])
    result.free()
    assert parent.stop(w) == 0
    assert sim_checked() is not None


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
