"""poolipc.start_mps / mps_status with a stand-in for nvidia-cuda-mps-control (a shell script
that behaves like it); the real daemon runs on the GPU machine. Each scenario runs in a fresh
interpreter: start_mps changes the process environment and keeps its daemon until exit."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

STAND_IN = r"""#!/bin/sh
if [ "$1" = "-d" ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
read cmd rest
echo "$cmd" >> "{record}"
case "$cmd" in
  start_server) echo 7 > "$CUDA_MPS_PIPE_DIRECTORY/server" ;;
  get_server_list) cat "$CUDA_MPS_PIPE_DIRECTORY/server" ;;
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control" ;;
esac
"""


@pytest.fixture
def control(tmp_path):
    record = tmp_path / "record.txt"
    script = tmp_path / "nvidia-cuda-mps-control"
    script.write_text(STAND_IN.format(record=record))
    script.chmod(0o755)
    return script, record


def run(code, tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_start_mps_refuses_without_the_acknowledgement_and_says_what_it_costs(control, tmp_path):
    script, record = control
    got = run(f"""
        import json, poolipc
        try:
            poolipc.start_mps(control={str(script)!r})
            print(json.dumps({{"raised": None}}))
        except poolipc.MpsError as e:
            print(json.dumps({{"raised": type(e).__name__, "text": str(e),
                              "is_poolipc": isinstance(e, poolipc.PoolipcError)}}))
    """, tmp_path)
    assert got["raised"] == "MpsError" and got["is_poolipc"]
    assert "every client" in got["text"] and "accept_shared_gpu_faults" in got["text"]
    assert not record.exists()


def test_start_mps_starts_a_private_daemon_that_workers_inherit_and_that_quits_after_exit(control, tmp_path):
    script, record = control
    got = run(f"""
        import json, os, subprocess, poolipc
        pipe = poolipc.start_mps(accept_shared_gpu_faults=True, control={str(script)!r})
        again = poolipc.start_mps(accept_shared_gpu_faults=True, control={str(script)!r})
        child = subprocess.run(["sh", "-c", "echo $CUDA_MPS_PIPE_DIRECTORY"],
                               capture_output=True, text=True).stdout.strip()
        print(json.dumps({{"pipe": pipe, "again": again, "child": child,
                          "env": os.environ["CUDA_MPS_PIPE_DIRECTORY"],
                          "status": poolipc.mps_status()}}))
    """, tmp_path)
    pipe = got["pipe"]
    assert pipe.startswith(str(tmp_path)), pipe
    assert got["again"] == pipe and got["child"] == pipe and got["env"] == pipe
    assert got["status"]["started_here"] and got["status"]["daemon_reachable"]
    assert got["status"]["pipe_directory"] == pipe
    deadline = time.time() + 10
    while time.time() < deadline and (os.path.exists(pipe) or "quit" not in record.read_text()):
        time.sleep(0.05)
    assert "start_server" in record.read_text()
    assert "quit" in record.read_text(), "the daemon was not told to quit after the process exited"
    assert not os.path.exists(pipe), f"{pipe} left behind"


def test_start_mps_without_the_control_program_says_mps_is_not_available(tmp_path):
    got = run(f"""
        import json, poolipc
        try:
            poolipc.start_mps(accept_shared_gpu_faults=True, control={str(tmp_path / "none")!r})
        except poolipc.MpsError as e:
            print(json.dumps({{"text": str(e)}}))
    """, tmp_path)
    assert "not available" in got["text"], got


def test_mps_status_reads_the_environment_without_touching_cuda(tmp_path):
    (tmp_path / "control").write_text("")
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", "import json, poolipc; print(json.dumps(poolipc.mps_status()))"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    got = json.loads(out.stdout)
    assert got["pipe_directory"] == str(tmp_path) and got["pipe_directory_from_env"]
    assert got["daemon_reachable"] and not got["started_here"]
