"""poolipc.pyisolate on the GPU with real torch under cudaMallocAsync and the real pyisolate
0.10.x: a pyisolate extension (share_torch, its own process started by pyisolate) receives the
host's torch CUDA tensors by pool pointer and returns torch tensors through the return lease,
which arrive in the host as tensors of poolipc's pool.

Not collected by a plain `pytest tests/` (the name does not start with test_): it runs in its
own process, install_pool() before `import torch`:

    PYTHONPATH=/tmp/site python3 -m pytest -v crates/poolipc-python/tests/gpu_pyisolate_test.py

Skips, saying why, without torch, pyisolate, a CUDA driver or GPU, or on POOLIPC_DRIVER=sim.
Where no `uv` is installed (pyisolate looks for one even with nothing to install), a `uv` that
fails if run is put on the PATH (pyiso_harness.uv_dir).
"""

import asyncio
import importlib.util
import logging
import os
import sys
import time

import pytest

for _mod in ("torch", "pyisolate"):
    if importlib.util.find_spec(_mod) is None:
        pytest.skip(f"{_mod} is not installed: these tests need torch and pyisolate on a GPU machine",
                    allow_module_level=True)
if os.environ.get("POOLIPC_DRIVER", "cuda") == "sim":
    pytest.skip("POOLIPC_DRIVER=sim: these tests need the GPU", allow_module_level=True)
if "torch" in sys.modules:
    pytest.skip("torch was imported before this module; run this file in its own pytest process",
                allow_module_level=True)

import poolipc  # noqa: E402

try:
    # A lease is a job: the deadline bounds how long the extension may keep a lent tensor.
    INSTALL = poolipc.install_pool(0, handoff_timeout=120.0)
except poolipc.PoolipcError as e:
    pytest.skip(f"no usable CUDA driver or GPU: {e}", allow_module_level=True)

import torch  # noqa: E402  (after install_pool, as in ComfyUI)

if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

import pyisolate  # noqa: E402

import poolipc.pyisolate as pp  # noqa: E402
import pyiso_harness  # noqa: E402
from conftest import device_pools, pool_of  # noqa: E402

DEV = torch.device("cuda", 0)
MIB = 1 << 20


def current_pool():
    return device_pools()[0]


class Loaded:
    """The extension, loaded once for the module, and a loop to call it on."""

    def __init__(self, tmp):
        pyiso_harness.uv_dir(shim_dir=tmp)
        self.parent = poolipc.Parent(0)
        pyisolate.register_adapter(pp.PoolipcAdapter())
        self.channel = pp.HostChannel(self.parent)
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.manager, self.ext = pyiso_harness.load_extension(
            self.channel, os.path.join(tmp, "venvs"), share_torch=True)

    def call(self, name, *args):
        async def go():
            return await getattr(self.ext, name)(*args)

        return self.loop.run_until_complete(go())

    def close(self):
        # The extension's pyisolate receive thread holds the last message's arguments until
        # the next one arrives: one more call, then every lease has ended.
        self.call("channel_stats")
        deadline = time.monotonic() + 30
        while self.channel.leases_out() and time.monotonic() < deadline:
            time.sleep(0.02)
        lost = self.parent.stats()["workers_lost"]
        t0 = time.monotonic()
        self.channel.close()
        assert time.monotonic() - t0 < 2.0, "the extension closed its side at the goodbye"
        assert self.parent.stats()["workers_lost"] == lost
        self.manager.stop_all_extensions()
        self.loop.close()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    lx = Loaded(str(tmp_path_factory.mktemp("pyiso")))
    yield lx
    lx.close()


def test_the_pool_is_torchs_and_the_extension_connected(loaded):
    assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"
    x = torch.ones(16, device=DEV)
    assert pool_of(x.data_ptr()) == current_pool()
    assert loaded.call("channel_stats")["token"] == loaded.channel.token
    # The extension connected when pyisolate registered its serializers; the host takes the
    # connection at its first tensor, or here.
    w = loaded.channel.connect(timeout=30)
    assert w in loaded.parent.workers() and loaded.parent.canary_report(w) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_torch_tensor_reaches_the_extension_by_pool_pointer(loaded, dtype):
    x = (torch.arange(4096, device=DEV) % 251).to(dtype)
    before = loaded.parent.stats()["pool_pointer_tensors"]
    seen = loaded.call("describe", x)
    assert seen["type"] == "Tensor" and seen["shape"] == [4096] and seen["device"] == "cuda:0"
    assert seen["dtype"] == str(dtype).removeprefix("torch.")
    assert seen["sum"] == float(x.double().sum().item())
    assert loaded.parent.stats()["pool_pointer_tensors"] == before + 1


@pytest.mark.parametrize("mib", [0, 1, 256])
def test_a_tensor_the_extension_makes_comes_back_as_pool_memory_of_the_host(loaded, mib):
    n = max(1, mib * MIB // 4)
    x = torch.rand(n, device=DEV)
    y = loaded.call("scaled", x, 3.0)
    assert isinstance(y, torch.Tensor) and y.is_cuda and y.shape == x.shape
    assert pool_of(y.data_ptr()) == current_pool(), "the result is the host's own pool memory"
    torch.cuda.current_stream().synchronize()
    assert torch.equal(y, x * 3.0)


def test_a_view_with_an_offset_crosses_as_it_is(loaded):
    base = torch.arange(1000, dtype=torch.float32, device=DEV)
    x = base[100:600]
    seen = loaded.call("describe", x)
    assert seen["shape"] == [500] and seen["sum"] == float(x.double().sum().item())
    back = loaded.call("echo", x)
    assert torch.equal(back, x)


def test_leases_end_once_the_extension_dropped_the_tensors(loaded):
    xs = [torch.full((1024,), float(i), device=DEV) for i in range(4)]
    for x in xs:
        loaded.call("describe", x)
    loaded.call("channel_stats")
    deadline = time.monotonic() + 30
    while loaded.channel.leases_out() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loaded.channel.leases_out() == 0


def test_a_cpu_tensor_takes_pyisolates_own_path(loaded):
    x = torch.arange(10, dtype=torch.float32)
    seen = loaded.call("describe", x)
    assert seen["device"] == "cpu" and seen["sum"] == 45.0


def test_a_cuda_tensor_no_channel_serves_goes_as_a_cpu_copy_and_says_so_once(loaded, caplog):
    other = pp.HostChannel(loaded.parent)
    try:
        x = torch.full((8,), 2.0, device=DEV)
        with caplog.at_level(logging.WARNING, logger="poolipc.pyisolate"):
            seen = [loaded.call("describe", x) for _ in range(2)]
        # pyisolate's CUDA path cannot share cudaMallocAsync memory: a CPU copy arrives.
        assert all(s["device"] == "cpu" and s["sum"] == 16.0 for s in seen), seen
        said = [r.getMessage() for r in caplog.records if "poolipc.pyisolate" in r.getMessage()]
        assert len(said) == 1, said
        assert "2 poolipc channels exist" in said[0] and "CPU copy" in said[0]
        with loaded.channel.sending():
            assert loaded.call("describe", x)["device"] == "cuda:0"
    finally:
        other.close()


def test_round_trip_times_beside_pyisolates_cpu_path(loaded):
    """Not a benchmark: medians of a call that sends one tensor and gets its sum back, by
    pool pointer and, for comparison, as a CPU tensor (what pyisolate does with a CUDA
    tensor when its CUDA IPC is off, as it must be under cudaMallocAsync). Printed."""
    rows = []
    for mib in (0, 64, 1024):
        n = max(1024, mib * MIB // 4)
        x = torch.rand(n, device=DEV)
        by_pointer, by_cpu = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loaded.call("describe", x)
            by_pointer.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            loaded.call("describe", x.cpu())
            by_cpu.append(time.perf_counter() - t0)
        med = lambda v: sorted(v)[len(v) // 2] * 1e3  # noqa: E731
        rows.append((n * 4, med(by_pointer), med(by_cpu)))
    for nbytes, p, c in rows:
        print(f"pyisolate call with {nbytes / MIB:8.2f} MiB: by pool pointer {p:8.2f} ms, "
              f"as a CPU tensor {c:8.2f} ms")
    assert all(p > 0 and c > 0 for _, p, c in rows)
