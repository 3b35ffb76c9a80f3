"""The binding on the H200 with real torch under cudaMallocAsync: the swap, torch's memory
figures reporting the pool (and ComfyUI's free-memory lines counting its reserve), torch tensors lent
to a Python worker (DLPack into torch, CuPy by __cuda_array_interface__) and to a Rust worker,
results from torch.empty, dtypes, odd sizes, views with offsets, a worker killed mid-job, the
ComfyUI prestartup script in fresh interpreters, and results through the result arena
(torch.from_dlpack over arena memory, in fresh interpreters whose parent has the arena).

Not collected by a plain `pytest tests/` (the name does not start with test_): it must run in
its own process, since install_pool() has to come before `import torch`:

    PYTHONPATH=/tmp/site python3 -m pytest -v crates/poolipc-python/tests/gpu_torch_test.py

Skips, saying why, without torch, without a CUDA driver or GPU, or on POOLIPC_DRIVER=sim.
"""

import importlib.util
import os
import struct
import subprocess
import sys
import textwrap

import pytest

if importlib.util.find_spec("torch") is None:
    pytest.skip("torch is not installed: these tests need torch on a GPU machine", allow_module_level=True)
if os.environ.get("POOLIPC_DRIVER", "cuda") == "sim":
    pytest.skip("POOLIPC_DRIVER=sim: these tests need the GPU", allow_module_level=True)
if "torch" in sys.modules:
    pytest.skip("torch was imported before this module; run this file in its own pytest process",
                allow_module_level=True)

import poolipc  # noqa: E402

try:
    INSTALL = poolipc.install_pool(0)
except poolipc.PoolipcError as e:
    pytest.skip(f"no usable CUDA driver or GPU: {e}", allow_module_level=True)

import torch  # noqa: E402  (after install_pool, as in ComfyUI)

if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

from conftest import device_pools, pool_of, poolipc_binary  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_WORKER = os.path.join(HERE, "workers", "torch_worker.py")
PRESTARTUP = os.path.join(HERE, "..", "..", "..", "comfyui-poolipc", "prestartup_script.py")
DEV = torch.device("cuda", 0)
MIB = 1 << 20

@pytest.fixture(scope="module")
def parent():
    return poolipc.Parent(0)


@pytest.fixture(scope="module")
def py_worker(parent):
    w = parent.spawn([sys.executable, TORCH_WORKER], {"POOLIPC_TEST_MODE": "torch"})
    yield w
    parent.stop(w)


def poisoned(shape, dtype):
    """A tensor of known, non-zero values (never test on zeros)."""
    n = 1
    for d in shape:
        n *= d
    base = torch.arange(n, device=DEV, dtype=torch.float64).remainder_(1000).add_(1)
    return base.to(dtype).reshape(shape)


# --- the swap -----------------------------------------------------------------------------


def test_install_pool_swapped_torchs_pool_and_said_so():
    assert INSTALL["installed"] and INSTALL["effective"], INSTALL
    assert "CUDA" in INSTALL["driver"]
    assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"


def test_torch_tensors_come_from_our_pool_and_torchs_default_pool_reads_zero():
    before = poolipc.memory_stats()["used_current"]
    x = torch.empty(64 * MIB, dtype=torch.uint8, device=DEV)
    torch.cuda.synchronize()
    cur, dflt = device_pools()
    assert cur != dflt, "the device's current pool is still the default pool"
    assert pool_of(x.data_ptr()) == cur
    # torch's own figures (its native call, which poolipc does not wrap) ask the default pool.
    own = torch._C._cuda_memoryStats(0)
    assert own["allocated_bytes"]["all"]["current"] == 0
    assert own["reserved_bytes"]["all"]["current"] == 0
    stats = poolipc.memory_stats()
    assert stats["used_current"] >= before + 64 * MIB
    assert stats["reserved_current"] >= stats["used_current"]
    del x


# --- torch's figures report the pool (placed before any test lends a tensor: no allocation of
# this process has been exported yet, so empty_cache can give all of the pool's reserve back) --

GIB = 1 << 30


def torch_matches_the_pool():
    """torch's reserved and allocated bytes for the pool's device, each within 2 MiB of the
    pool's; returns the pool's figures."""
    reserved, allocated = torch.cuda.memory_reserved(DEV), torch.cuda.memory_allocated(DEV)
    pool = poolipc.memory_stats()
    assert abs(reserved - pool["reserved_current"]) <= 2 * MIB, (reserved, pool)
    assert abs(allocated - pool["used_current"]) <= 2 * MIB, (allocated, pool)
    stats = torch.cuda.memory_stats(DEV)
    assert stats["active_bytes.all.current"] == stats["allocated_bytes.all.current"]
    return pool


def comfy_free_memory(dev):
    """ComfyUI's free-VRAM figure: get_free_memory's CUDA branch (the one cudaMallocAsync
    takes), copied unchanged from comfy/model_management.py of comfyanonymous/ComfyUI at
    commit 00184d155ba67ba6e9579bd7ef2ede93217a3520; (mem_free_total, mem_free_torch)."""
    # --- ComfyUI's lines ---
    stats = torch.cuda.memory_stats(dev)
    mem_active = stats['active_bytes.all.current']
    mem_reserved = stats['reserved_bytes.all.current']
    mem_free_cuda, _ = torch.cuda.mem_get_info(dev)
    mem_free_torch = mem_reserved - mem_active
    mem_free_total = mem_free_cuda + mem_free_torch
    # --- end of ComfyUI's lines ---
    return (mem_free_total, mem_free_torch)


def test_torchs_figures_match_the_pool_while_a_gib_tensor_lives_and_after_it_dies():
    torch.cuda.synchronize()
    x = torch.empty(GIB, dtype=torch.uint8, device=DEV)
    x.fill_(7)
    torch.cuda.synchronize()
    living = torch_matches_the_pool()
    assert living["used_current"] >= GIB, living
    assert torch.cuda.max_memory_allocated(DEV) == poolipc.memory_stats()["used_high"] >= GIB
    del x
    torch.cuda.synchronize()
    dead = torch_matches_the_pool()
    assert dead["used_current"] <= living["used_current"] - GIB + 2 * MIB, (living, dead)
    # The pool keeps what was freed (torch's release threshold): reserved, not used.
    assert dead["reserved_current"] - dead["used_current"] >= GIB - 2 * MIB, dead


def test_comfyuis_free_memory_counts_the_pools_unused_reserve():
    x = torch.empty(GIB, dtype=torch.uint8, device=DEV)
    x.fill_(7)
    del x
    torch.cuda.synchronize()
    total, from_torch = comfy_free_memory(DEV)
    pool = poolipc.memory_stats()
    predicted = torch.cuda.mem_get_info(DEV)[0] + pool["reserved_current"] - pool["used_current"]
    assert abs(total - predicted) <= 64 * MIB, (total, predicted, pool)
    assert from_torch >= GIB - 2 * MIB, (from_torch, pool)


def test_the_reserve_comfyui_counts_as_free_comes_back_with_empty_cache():
    x = torch.empty(GIB, dtype=torch.uint8, device=DEV)
    x.fill_(7)
    del x
    torch.cuda.synchronize()
    counted, _ = comfy_free_memory(DEV)
    torch.cuda.empty_cache()  # trims the pool too
    pool = poolipc.memory_stats()
    free_now = torch.cuda.mem_get_info(DEV)[0]
    assert pool["reserved_current"] - pool["used_current"] < GIB, pool
    assert abs(free_now + pool["reserved_current"] - pool["used_current"] - counted) <= 64 * MIB, (
        free_now, counted, pool)


def test_torchs_reset_peak_memory_stats_restarts_the_pools_peaks():
    x = torch.empty(GIB, dtype=torch.uint8, device=DEV)
    del x
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated(DEV) >= torch.cuda.memory_allocated(DEV) + GIB
    torch.cuda.reset_peak_memory_stats(DEV)
    pool = poolipc.memory_stats()
    assert pool["used_high"] == pool["used_current"], pool
    assert pool["reserved_high"] == pool["reserved_current"], pool
    assert torch.cuda.max_memory_allocated(DEV) == torch.cuda.memory_allocated(DEV)
    assert torch.cuda.max_memory_reserved(DEV) == torch.cuda.memory_reserved(DEV)


# --- torch tensors to a Python worker, results from torch.empty ----------------------------

CASES = [
    ("float32", (7,)),
    ("float32", (1023, 1021)),
    ("bfloat16", (3, 5, 7)),
    ("bfloat16", (4097,)),
    ("int64", (13,)),
    ("int64", (999, 3)),
]


@pytest.mark.parametrize("dtype,shape", CASES, ids=[f"{d}-{'x'.join(map(str, s))}" for d, s in CASES])
def test_a_python_worker_takes_torch_tensors_by_dlpack(parent, py_worker, dtype, shape):
    x = poisoned(shape, getattr(torch, dtype))
    (y,) = parent.run(py_worker, [x])
    assert isinstance(y, torch.Tensor) and y.device == DEV
    assert y.dtype == x.dtype and y.shape == x.shape
    assert pool_of(y.data_ptr()) == device_pools()[0]  # torch.empty, from the shared pool
    torch.testing.assert_close(y, x * 2 + 1)
    assert parent.last_input_rungs == ["pool pointer"]


def test_a_worker_serving_each_job_on_a_new_thread_gets_them_right(parent):
    # The worker's calls run on the calling thread, which may never have had a CUDA context.
    w = parent.spawn([sys.executable, TORCH_WORKER], {"POOLIPC_TEST_MODE": "fresh-threads"})
    for n in (1, 4099, 1 << 20):
        x = poisoned((n,), torch.float32)
        (y,) = parent.run(w, [x])
        torch.testing.assert_close(y, x * 2 + 1)
    assert parent.stop(w) == 0


def test_views_with_offsets_and_strides_cross_as_they_are(parent, py_worker):
    m = poisoned((256, 300), torch.float32)
    views = [m[5:], m[3:9, 7:111], m.t(), m[::2, 1::3], m.view(-1)[17:17 + 4099]]
    out = parent.run(py_worker, views)
    for v, y in zip(views, out):
        assert y.is_contiguous() and y.shape == v.shape
        torch.testing.assert_close(y, v * 2 + 1)


def test_results_are_ordered_on_torchs_stream(parent, py_worker):
    s = torch.cuda.Stream(DEV)
    with torch.cuda.stream(s):
        x = poisoned((1 << 20,), torch.float32)
        (y,) = parent.run(py_worker, [x])  # READY on s, s waits on DONE
        z = y.sum()
    s.synchronize()
    assert z.item() == pytest.approx((x * 2 + 1).sum().item(), rel=1e-4)


def test_a_cupy_worker_takes_views_by_cuda_array_interface(parent):
    pytest.importorskip("cupy", reason="CuPy is not installed")
    w = parent.spawn([sys.executable, TORCH_WORKER], {"POOLIPC_TEST_MODE": "cupy"})
    x = poisoned((333, 7), torch.float32)
    (y,) = parent.run(w, [x])
    torch.testing.assert_close(y, x * 2 + 1)
    parent.stop(w)


def test_jax_takes_a_view_by_dlpack(parent, tmp_path):
    if importlib.util.find_spec("jax") is None:
        pytest.skip("JAX is not installed")
    script = tmp_path / "jax_worker.py"
    script.write_text(textwrap.dedent("""
        import os
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import jax, jax.numpy as jnp, poolipc
        w = poolipc.Worker()
        for job in w:
            with job:
                v = job.inputs[0]
                x = jax.dlpack.from_dlpack(v)
                s = float(jnp.sum(x))
                (o,) = job.request_results([("float64", [1])])
                import struct
                o.write_bytes(struct.pack("<d", s))
    """))
    w = parent.spawn([sys.executable, str(script)])
    x = poisoned((1000,), torch.float32)
    (y,) = parent.run(w, [x])
    assert y.item() == pytest.approx(x.sum().item(), rel=1e-5)
    parent.stop(w)


# --- a Rust worker ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,shape", [("float32", (4096, 3)), ("bfloat16", (1001,)), ("int64", (77,))])
def test_a_rust_worker_takes_torch_tensors(parent, dtype, shape):
    exe = poolipc_binary()
    if exe is None:
        pytest.skip("no poolipc binary (set POOLIPC_BIN)")
    w = parent.spawn([exe, "__demo-worker"])
    x = poisoned(shape, getattr(torch, dtype))
    (y,) = parent.run(w, [x])
    raw_x, raw_y = x.view(torch.uint8).reshape(-1), y.view(torch.uint8).reshape(-1)
    assert struct.unpack("<I", bytes(raw_y[:4].cpu().tolist()))[0] == 0xEC400000
    assert torch.equal(raw_y[4:], raw_x[4:])
    assert parent.stop(w) == 0


# --- a worker killed mid-job --------------------------------------------------------------


@pytest.mark.parametrize("mode", ["die-after-import", "die-after-grant"])
def test_a_worker_killed_mid_job_fails_that_job_only(parent, py_worker, mode):
    dying = parent.spawn([sys.executable, TORCH_WORKER], {"POOLIPC_TEST_MODE": mode})
    x = poisoned((1 << 20,), torch.float32)
    with pytest.raises(poolipc.JobFailedError):
        parent.run(dying, [x])
    # the parent goes on: the other worker serves, torch goes on allocating
    for _ in range(3):
        (y,) = parent.run(py_worker, [x])
        torch.testing.assert_close(y, x * 2 + 1)
        more = [torch.empty(1 << 20, device=DEV) for _ in range(8)]
        del more
    torch.cuda.synchronize()


# --- the prestartup script, in fresh interpreters ------------------------------------------

FRESH = textwrap.dedent("""
    import importlib.util, os, sys
    sys.argv = {argv!r}
    spec = importlib.util.spec_from_file_location("prestartup_script", {path!r})
    m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
    import torch
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    print("BACKEND", torch.cuda.get_allocator_backend())
    print("ALLOCATED", torch.cuda.memory_allocated(0))
    import poolipc
    print("POOL_USED", poolipc.memory_stats()["used_current"] if poolipc._native.is_installed() else None)
""")


def fresh(argv, extra_env=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF",)}
    env.update({"POOLIPC_ENABLE": "1"}, **(extra_env or {}))
    code = FRESH.format(argv=list(argv), path=os.path.abspath(PRESTARTUP))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p.stdout, p.stderr


# --- results through the result arena (each in a fresh interpreter: the process's parent sets
# the result memory once, and this module's is a pool parent) --------------------------------

ARENA_PARENT = os.path.join(HERE, "workers", "torch_arena_parent.py")


def arena_case(case):
    p = subprocess.run([sys.executable, ARENA_PARENT, case], capture_output=True, text=True,
                       timeout=600, env=dict(os.environ))
    assert p.returncode == 0 and f"OK {case}" in p.stdout, p.stdout + p.stderr


def test_an_arena_result_is_a_torch_tensor_by_dlpack_and_deleting_it_gives_the_block_back():
    arena_case("dlpack")


def test_arena_results_of_one_byte_and_of_three_gib_arrive_intact():
    arena_case("sizes")


def test_one_parent_gives_arena_results_and_per_job_pool_results():
    arena_case("per-job")


def test_an_arena_result_over_the_cap_is_arena_full_error_and_the_next_job_works():
    arena_case("cap")


def test_a_torch_worker_carves_its_results_out_of_an_arena_slice():
    arena_case("slice")


def test_prestartup_in_a_fresh_interpreter_swaps_torchs_pool():
    out, err = fresh(["main.py"])
    (line,) = [x for x in err.splitlines() if x.startswith("poolipc:")]
    assert "current pool" in line and "memory_allocated() and memory_reserved() will report the pool" in line
    assert "BACKEND cudaMallocAsync" in out
    # torch's figure is the pool's (the 64 MiB tensor), not the default pool's 0.
    allocated = int(out.split("ALLOCATED ", 1)[1].split()[0])
    assert allocated >= 64 << 20 and f"POOL_USED {allocated}" in out, out


def test_prestartup_with_POOLIPC_TORCH_STATS_0_leaves_torchs_figures_reading_zero():
    out, err = fresh(["main.py"], {"POOLIPC_TORCH_STATS": "0"})
    assert "BACKEND cudaMallocAsync" in out and "ALLOCATED 0" in out, out


def test_prestartup_with_disable_cuda_malloc_says_the_swap_has_no_effect():
    out, err = fresh(["main.py", "--disable-cuda-malloc"])
    assert "the swap has no effect" in err
    assert "BACKEND native" in out and "ALLOCATED 0" not in out
