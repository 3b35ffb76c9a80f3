"""poolipc.torch_sharing without torch, on the simulated driver: the pool FD rendezvous over
the sender's abstract socket, the keep-alive accounting, a receiver killed while holding
shares, a mapping sent on to a third process, memory outside the pool refused, and
malformed handles refused. Each scenario runs in fresh processes (workers/sharing_sim.py),
since the pool is per process."""

import os
import subprocess
import sys

import pytest

os.environ.setdefault("POOLIPC_DRIVER", "sim")
if os.environ["POOLIPC_DRIVER"] != "sim":
    pytest.skip("runs on the simulated driver only", allow_module_level=True)

import poolipc  # noqa: E402
from conftest import WORKERS  # noqa: E402


@pytest.mark.parametrize("name", ["basic", "again", "channels", "dying", "relay", "copy", "unpooled"])
def test_sharing_scenario(name):
    env = dict(os.environ, POOLIPC_DRIVER="sim")
    # A simulated machine of this pytest process (another suite installed a pool here) is
    # not the scenario's: its parent makes its own.
    env.pop("POOLIPC_SIM_MACHINE", None)
    r = subprocess.run([sys.executable, str(WORKERS / "sharing_sim.py"), name], env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"PASS {name}" in r.stdout, r.stdout + r.stderr


def test_malformed_handles_are_value_errors():
    with pytest.raises(ValueError, match="malformed share handle"):
        poolipc._native._open(b"torch's own bytes", 0, 16, None, 0)
    with pytest.raises(ValueError, match="malformed share reference"):
        poolipc._native._release(b"POOLIPC-R1\x05ab")


def test_a_sender_that_is_gone_is_a_clear_error():
    import struct

    name = b"poolipc-torch.0.nobody"
    handle = b"POOLIPC-H1" + bytes([len(name)]) + name + bytes([1]) + struct.pack("<Q", 1) + bytes(64) + struct.pack("<Q", 4096)
    with pytest.raises(poolipc.PoolipcError, match="cannot reach the process that shared"):
        poolipc._native._open(handle, 0, 16, None, 0)
    with pytest.raises(ValueError, match="passes the end"):
        poolipc._native._open(handle, 4000, 200, None, 0)


def test_stats_before_any_sharing():
    s = poolipc.torch_sharing.stats()
    assert set(s) == {"kept", "receivers", "address", "imports", "mappings", "pools", "pending_releases"}


def test_the_receivers_early_work_is_queued_and_never_raises():
    # In a process of its own, with a pool (its simulated machine): a memset of the process's
    # scratch word on the legacy stream is queued, the word made once; on a device that does
    # not exist nothing is queued and nothing raised (the early work is an optimization).
    code = (
        "import poolipc\n"
        "poolipc.install_pool()\n"
        "k = poolipc._native._kick\n"
        "print(k(0, 0), k(0, 0), k(99, 0))\n"
    )
    env = dict(os.environ, POOLIPC_DRIVER="sim")
    env.pop("POOLIPC_SIM_MACHINE", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "True True False", r.stdout + r.stderr
