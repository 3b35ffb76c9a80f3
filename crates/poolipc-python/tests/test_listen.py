"""Workers the parent did not start: `Parent.listen` and `Worker.connect`, on the simulated
driver, across real processes started with `subprocess` (as pyisolate starts its children).

Every test runs in a child pytest of this file: the listener belongs to the process's one
parent, which test_sim.py makes with its own options in the main run.
"""

import functools
import os
import pathlib
import struct
import subprocess
import sys
import time

import pytest

os.environ.setdefault("POOLIPC_DRIVER", "sim")
if os.environ["POOLIPC_DRIVER"] != "sim":
    pytest.skip("test_listen.py runs on the simulated driver only", allow_module_level=True)
if "torch" in sys.modules:
    pytest.skip("torch is imported in this process; run test_listen.py in its own pytest process",
                allow_module_level=True)

import poolipc  # noqa: E402

from conftest import py_worker_argv, run_in_child_pytest  # noqa: E402

CHILD = os.environ.get("POOLIPC_LISTEN_CHILD") == "1"


def own_process(test):
    """Runs the test in a child pytest of this file (a fresh interpreter and parent)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        if CHILD:
            return test(*args, **kwargs)
        run_in_child_pytest(__file__, kwargs["request"], {"POOLIPC_LISTEN_CHILD": "1"})

    return run


@pytest.fixture(scope="module")
def parent():
    if not CHILD:
        return None
    info = poolipc.install_pool(0, stop_timeout=2.0)
    assert info["installed"] and "SIMULATED" in info["driver"]
    return poolipc.Parent(0)


def start_worker(listener, mode="echo"):
    """A worker process started the way pyisolate starts its children: a plain subprocess
    whose environment carries the listener's env, nothing inherited from poolipc."""
    env = dict(os.environ)
    env.pop("POOLIPC_FD", None)
    env.update(listener.env())
    env["POOLIPC_TEST_MODE"] = mode
    return subprocess.Popen(py_worker_argv(), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def f32(parent, values):
    buf = parent.alloc(4 * len(values), dtype="float32", shape=[len(values)])
    parent.write(buf.ptr, struct.pack(f"<{len(values)}f", *values))
    return buf


@own_process
def test_a_worker_connecting_by_path_takes_jobs(parent, request):
    listener = parent.listen()
    assert os.path.exists(listener.path)
    assert oct(os.stat(os.path.dirname(listener.path)).st_mode & 0o777) == "0o700"
    env = listener.env()
    assert env[poolipc.CONNECT_ENV] == listener.path and "POOLIPC_SIM_MACHINE" in env
    proc = start_worker(listener)
    w = listener.accept(timeout=60)
    assert parent.canary_report(w) is not None, "the canary battery ran on the accepted worker"
    assert parent.pid(w) is None, "a worker we did not spawn has no pid of ours"
    vals = [float(i) for i in range(64)]
    buf = f32(parent, vals)
    for _ in range(2):
        (res,) = parent.run(w, [poolipc.TensorRef(buf.ptr, "float32", [64])])
        got = struct.unpack("<64f", parent.read(res.ptr, 256))
        assert got[1:] == tuple(vals[1:])
        assert parent.last_input_rungs == ["pool pointer"]
    parent.stop(w)
    assert proc.wait(timeout=30) == 0, proc.stderr.read().decode()
    listener.close()
    assert not os.path.exists(listener.path), "close removes the socket"
    assert not os.path.exists(os.path.dirname(listener.path)), "and the directory it made"


@own_process
def test_two_workers_connect_to_one_listener_and_are_handed_out_in_turn(parent, request):
    listener = parent.listen()
    procs = [start_worker(listener) for _ in range(2)]
    ids = {listener.accept(timeout=60), listener.accept(timeout=60)}
    assert len(ids) == 2 and ids <= set(parent.workers())
    buf = f32(parent, [1.0, 2.0])
    for w in ids:
        (res,) = parent.run(w, [poolipc.TensorRef(buf.ptr, "float32", [2])])
        assert struct.unpack("<f", parent.read(res.ptr, 8)[4:])[0] == 2.0
        parent.stop(w)
    for p in procs:
        assert p.wait(timeout=30) == 0
    listener.close()


@own_process
def test_accept_without_a_worker_times_out_and_a_closed_listener_says_so(parent, request):
    listener = parent.listen()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no worker connected"):
        listener.accept(timeout=0.3)
    assert time.monotonic() - t0 < 10
    with pytest.raises(ValueError, match="not a timeout"):
        listener.accept(timeout=-1)
    listener.close()
    assert listener.closed
    with pytest.raises(poolipc.PoolipcError, match="closed"):
        listener.accept(timeout=1)


@own_process
def test_connecting_to_a_wrong_path_or_a_closed_listener_is_a_connect_error(parent, request, tmp_path):
    with pytest.raises(poolipc.ConnectError, match="no poolipc parent listens"):
        poolipc.Worker.connect(tmp_path / "nothing.sock")
    listener = parent.listen()
    path = listener.path
    listener.close()
    with pytest.raises(poolipc.ConnectError, match="no poolipc parent listens"):
        poolipc.Worker.connect(path)
    assert issubclass(poolipc.ConnectError, poolipc.PoolipcError)
    with pytest.raises(ValueError, match="longer than a Unix socket path"):
        poolipc.Worker.connect("/" + "x" * 200)
    env = dict(os.environ)
    env.pop(poolipc.CONNECT_ENV, None)
    os.environ.pop(poolipc.CONNECT_ENV, None)
    with pytest.raises(ValueError, match="POOLIPC_CONNECT"):
        poolipc.Worker.connect()


@own_process
def test_a_directory_that_is_not_private_is_refused(parent, request, tmp_path):
    d = tmp_path / "open"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    with pytest.raises(ValueError, match="0700"):
        parent.listen(d)
    p = tmp_path / "private"
    p.mkdir(mode=0o700)
    listener = parent.listen(p)
    assert pathlib.Path(listener.path).parent == p
    listener.close()
    assert p.exists(), "a directory the caller gave is left in place"


@own_process
def test_a_peer_of_another_uid_is_refused_before_the_handshake(parent, request):
    # Only root can connect as another uid; elsewhere the transport's own tests cover the
    # check (crates/poolipc-transport/tests/processes.rs).
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another uid")
    # An interpreter the other user may run (this one may live under root's home).
    python = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)
    if python is None:
        pytest.skip("no system python3 for the other user to run")
    listener = parent.listen()
    os.chmod(os.path.dirname(listener.path), 0o711)
    os.chmod(listener.path, 0o777)
    code = ("import socket,sys,time; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
            "time.sleep(2)")
    proc = subprocess.Popen([python, "-c", code, listener.path], user=65534, cwd="/")
    deadline = time.monotonic() + 30
    while not listener.refused and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.wait(timeout=30)
    assert listener.refused and "uid" in listener.refused[0]
    with pytest.raises(TimeoutError):
        listener.accept(timeout=0.2)
    listener.close()
