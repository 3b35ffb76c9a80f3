"""torch.multiprocessing scenarios under ``backend:cudaMallocAsync``, one per run:

    POOLIPC_TORCHMP_MODE=poolipc|control|unpooled python torchmp_scenarios.py NAME

``poolipc``: ``install_pool()`` before torch, then ``poolipc.torch_sharing.enable()`` in the
parent only (children started by ``spawn`` install the pool, since they may send tensors of
their own, but are enabled by what they unpickle). ``control``: the same backend without
poolipc. ``unpooled``: ``enable()`` without ``install_pool`` (the fallback's error).

Prints ``PASS <name> <details>`` and exits 0, or fails with the error. Every wait has a
deadline, and a pickling error in a queue's feeder thread fails the run at once.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import time

MODE = os.environ.get("POOLIPC_TORCHMP_MODE", "poolipc")
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
if MODE == "poolipc":
    import poolipc

    poolipc.install_pool(0)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

if MODE == "unpooled":
    import poolipc  # noqa: F811

DEV = torch.device("cuda", 0)
TIMEOUT = float(os.environ.get("POOLIPC_TORCHMP_TIMEOUT", "120"))
FEEDER_ERRORS: list[BaseException] = []


def queue(ctx):
    q = ctx.Queue()

    def on_error(e, obj):
        FEEDER_ERRORS.append(e)

    q._on_queue_feeder_error = on_error
    return q


def get(q, procs=(), timeout=TIMEOUT):
    """The next item, failing at once on a feeder error or a dead child."""
    deadline = time.monotonic() + timeout
    while True:
        if FEEDER_ERRORS:
            raise RuntimeError(f"a put failed: {FEEDER_ERRORS[0]!r}") from FEEDER_ERRORS[0]
        try:
            return q.get(timeout=0.2)
        except Exception as e:  # queue.Empty
            if type(e).__name__ != "Empty":
                raise
        for p in procs:
            if not p.is_alive() and p.exitcode not in (0, None):
                raise RuntimeError(f"child {p.pid} died with exit code {p.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError("no answer in time")


# ----- children -------------------------------------------------------------------------


def child_echo(q_in, q_out):
    """Receives a tensor, checks it, writes +1 in place, sends one of its own back."""
    torch.cuda.init()
    t = get(q_in)
    assert t.is_cuda, t.device
    ok = bool(torch.equal(t, torch.arange(t.numel(), device=DEV, dtype=t.dtype)))
    t.add_(1)
    torch.cuda.synchronize()
    mine = torch.full((1000,), 7.0, device=DEV)
    q_out.put((ok, mine))
    get(q_in)  # the parent checked; now both may go
    del t


def child_forward(q_in, q_out, n):
    torch.cuda.init()
    for _ in range(n):
        q_out.put(get(q_in))
    get(q_in)


def child_sum(q_in, q_out, n):
    torch.cuda.init()
    acc = torch.zeros(4, device=DEV, dtype=torch.float64)
    for _ in range(n):
        acc += get(q_in)
    q_out.put(acc.tolist())  # plain data: a CPU tensor would need this process alive


def pool_fn(t):
    return t * 2


def child_read_later(q_in, q_out):
    torch.cuda.init()
    t = get(q_in)
    get(q_in)  # the parent dropped its tensor and churned the pool
    q_out.put(bool((t == 3).all().item()))


def child_hold(q_in, q_out, n):
    torch.cuda.init()
    held = [get(q_in) for _ in range(n)]
    q_out.put(sum(int(t.numel()) for t in held))
    time.sleep(600)


def child_channels(sq, conn):
    """A tensor from a SimpleQueue and one from a Pipe: read, written in place, answered."""
    torch.cuda.init()
    t = sq.get()
    u = conn.recv()
    ok = bool((t == 7).all().item()) and bool((u == 8).all().item())
    t.fill_(17)
    u.fill_(18)
    torch.cuda.synchronize()
    conn.send(ok)
    conn.recv()  # the parent checked; now both may go


def child_arg(t, q_out):
    ok = bool((t == 5).all().item())
    t.fill_(6)
    torch.cuda.synchronize()
    q_out.put(ok)


def child_event(q_in, q_out):
    torch.cuda.init()
    t = get(q_in)
    q_out.put(bool((t == 9).all().item()))


def child_direct(q_in, q_out):
    """Ray's and vLLM's shape: the receiver rebuilds reduce_tensor's tuple itself."""
    if MODE == "poolipc":
        import poolipc as p

        p.torch_sharing.enable()
    torch.cuda.init()
    func, args = pickle.loads(get(q_in))
    t = func(*args)
    ok = bool((t == 11).all().item())
    t.fill_(12)
    torch.cuda.synchronize()
    q_out.put(ok)


def child_types(q_in, q_out):
    torch.cuda.init()
    items = get(q_in)
    out = []
    for it in items:
        # plain data: a CPU tensor would need this process alive when the parent unpickles it
        out.append((str(it.dtype), tuple(it.shape), it.stride(), type(it).__name__, it.requires_grad, raw(it).tolist()))
    a = get(q_in)
    b = get(q_in)
    same = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    q_out.put((out, same))


def child_ipc_event(q_in, q_out):
    torch.cuda.init()
    ev = get(q_in)
    ev.synchronize()
    q_out.put(True)


def child_big(q_in, q_out):
    torch.cuda.init()
    t = get(q_in, timeout=300)
    n = t.numel()
    step = max(1, n // 4096)
    # Every step-th element and the last: a copy that lost a chunk or an offset shows here.
    ok = bool((t[::step] == torch.arange(0, n, step, device=t.device, dtype=t.dtype)).all())
    q_out.put((int(n), int(t[-1].item()), int(t[0].item()), ok))
    del t
    torch.cuda.synchronize()


# ----- scenarios ------------------------------------------------------------------------


def start(ctx, target, *args):
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def s_queue(ctx):
    q_in, q_out = queue(ctx), queue(ctx)
    p = start(ctx, child_echo, q_in, q_out)
    t = torch.arange(1 << 20, device=DEV, dtype=torch.float32)
    q_in.put(t)
    ok, mine = get(q_out, [p])
    assert ok, "the child read other bytes"
    assert torch.equal(t, torch.arange(1 << 20, device=DEV, dtype=torch.float32) + 1), "the child's write is missing"
    assert mine.is_cuda and bool((mine == 7).all().item()), "the child's tensor came wrong"
    mine.fill_(8)
    torch.cuda.synchronize()
    q_in.put(None)
    p.join(TIMEOUT)
    return "1 MiB both ways, in place"


def s_many(ctx):
    n = int(os.environ.get("POOLIPC_TORCHMP_MANY", "100000"))
    a_b, b_c, out = queue(ctx), queue(ctx), queue(ctx)
    b = start(ctx, child_forward, a_b, b_c, n)
    c = start(ctx, child_sum, b_c, out, n)
    t0 = time.perf_counter()
    for i in range(n):
        a_b.put(torch.full((4,), float(i % 1000), device=DEV, dtype=torch.float64))
    acc = get(out, [b, c], timeout=max(TIMEOUT, n / 200))
    dt = time.perf_counter() - t0
    a_b.put(None)
    want = float(sum(i % 1000 for i in range(n)))
    assert acc == [want] * 4, (acc, want)
    b.join(TIMEOUT)
    c.join(TIMEOUT)
    return f"{n} tensors A->B->C in {dt:.1f} s ({dt / n * 1e6:.0f} us each)"


def s_pool_map(ctx):
    with ctx.Pool(2) as pool:
        ts = [torch.full((256,), float(i), device=DEV) for i in range(8)]
        r = pool.map(pool_fn, ts)
        # read while the workers (the results' owners) live
        assert all(x.is_cuda and bool((x == 2 * i).all().item()) for i, x in enumerate(r)), r
        del r
    return "8 tensors in, 8 CUDA results out"


def s_producer_deletes(ctx):
    q_in, q_out = queue(ctx), queue(ctx)
    p = start(ctx, child_read_later, q_in, q_out)
    t = torch.full((1 << 22,), 3.0, device=DEV)
    q_in.put(t)
    del t
    time.sleep(1.0)
    churn = [torch.full((1 << 22,), -1.0, device=DEV) for _ in range(16)]
    torch.cuda.synchronize()
    del churn
    torch.cuda.empty_cache()
    q_in.put(None)
    assert get(q_out, [p]), "the child read recycled memory"
    p.join(TIMEOUT)
    return "16 MiB read right after the producer dropped it and churned the pool"


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def used() -> int:
    if MODE == "poolipc":
        return poolipc.memory_stats()["used_current"]
    return torch.cuda.memory_allocated()


def kept() -> dict:
    if MODE == "poolipc":
        return poolipc.torch_sharing.stats()
    return {"kept": 0, "receivers": 0}


def s_sigkill(ctx):
    n = 1000
    q_in, q_out = queue(ctx), queue(ctx)
    torch.cuda.synchronize()
    base_used = used()
    p = start(ctx, child_hold, q_in, q_out, n)
    for _ in range(n):
        q_in.put(torch.ones(1 << 16, device=DEV))
    held = get(q_out, [p])
    assert held == n << 16, held
    k = kept()
    assert k["kept"] == n, k
    during = used()
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    deadline = time.monotonic() + 30
    while kept()["kept"] and time.monotonic() < deadline:
        time.sleep(0.05)
    torch.cuda.synchronize()
    after = used()
    k = kept()
    assert k["kept"] == 0 and k["receivers"] == 0, k
    assert after <= base_used, (base_used, during, after)
    return f"1000 shares held; SIGKILL; kept 0, used {during >> 20} -> {after >> 20} MiB (baseline {base_used >> 20})"


def s_process_arg(ctx):
    q_out = queue(ctx)
    t = torch.full((4096,), 5.0, device=DEV)
    p = start(ctx, child_arg, t, q_out)
    assert get(q_out, [p]), "the child read other bytes"
    p.join(TIMEOUT)
    assert bool((t == 6).all().item()), "the child's write is missing"
    return "Process(args=(t,)) read and written in place"


def s_channels(ctx):
    """mp.SimpleQueue and mp.Pipe (their pickling runs in the caller's thread, not a feeder),
    with a child started by spawn and one by forkserver."""
    for method in ("spawn", "forkserver"):
        c = mp.get_context(method)
        sq = c.SimpleQueue()
        mine, theirs = c.Pipe()
        p = c.Process(target=child_channels, args=(sq, theirs), daemon=True)
        p.start()
        t = torch.full((4096,), 7.0, device=DEV)
        u = torch.full((4096,), 8.0, device=DEV)
        sq.put(t)
        mine.send(u)
        deadline = time.monotonic() + TIMEOUT
        while not mine.poll(0.2):
            if not p.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{method}: the child gave no answer (exit code {p.exitcode})")
        assert mine.recv(), f"{method}: the child read other bytes"
        assert bool((t == 17).all().item()) and bool((u == 18).all().item()), f"{method}: the child's writes are missing"
        mine.send(None)
        p.join(TIMEOUT)
    return "SimpleQueue and Pipe, to a spawned and a forkserver child: read and written in place"


def s_event(ctx):
    q_in, q_out = queue(ctx), queue(ctx)
    p = start(ctx, child_event, q_in, q_out)
    t = torch.zeros(1 << 20, device=DEV)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # about a second of GPU time on the current stream
    t.fill_(9)  # ordered after the sleep; the put does not wait for it
    q_in.put(t)
    assert get(q_out, [p]), "the child read before the sender's writes were done"
    p.join(TIMEOUT)
    if MODE == "poolipc":
        # An event only where the stream has work queued: with nothing left to run there is
        # nothing to order the receiver after.
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.synchronize()
        idle = reduce_tensor(t)[1][-1]
        torch.cuda._sleep(int(2e8))
        busy = reduce_tensor(t)[1][-1]
        torch.cuda.synchronize()
        import poolipc as pi

        pi.torch_sharing.forget_kept()
        assert idle is False and busy is True, f"event_sync_required: {idle} idle, {busy} busy"
        return "the receiver waited for the sender's stream; no event where the stream was idle"
    return "the receiver waited for the sender's stream"


def s_direct(ctx):
    from torch.multiprocessing.reductions import reduce_tensor

    q_in, q_out = queue(ctx), queue(ctx)
    p = start(ctx, child_direct, q_in, q_out)
    t = torch.full((1000,), 11.0, device=DEV)
    func, args = reduce_tensor(t)
    args = list(args)
    args[6] = 0  # Ray and vLLM put the receiver's device index here
    q_in.put(pickle.dumps((func, tuple(args))))
    assert get(q_out, [p]), "the child read other bytes"
    p.join(TIMEOUT)
    assert bool((t == 12).all().item()), "the child's write is missing"
    return "reduce_tensor with field 6 rewritten, rebuilt by hand"


def raw(x):
    return x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def s_types(ctx):
    q_in, q_out = queue(ctx), queue(ctx)
    p = start(ctx, child_types, q_in, q_out)
    dts = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]
    if hasattr(torch, "float8_e4m3fn"):
        dts += [torch.float8_e4m3fn, torch.float8_e5m2]
    items = []
    for dt in dts:
        items.append(torch.arange(24, device=DEV).reshape(4, 6).to(dt))
    base = torch.arange(60, device=DEV, dtype=torch.float32).reshape(6, 10)
    items.append(base[1:, ::3])  # a view: offset and strides
    items.append(torch.nn.Parameter(torch.ones(3, device=DEV)))
    items.append(torch.ones(3, device=DEV, requires_grad=True))
    items.append(torch.empty(0, device=DEV))
    items.append(torch.tensor(3.5, device=DEV))
    q_in.put(items)
    same = torch.ones(8, device=DEV)
    q_in.put(same)  # twice, in two pickles
    q_in.put(same)
    out, same_storage = get(q_out, [p])
    p.join(TIMEOUT)
    for src, (dt, shape, stride, cls, rg, data) in zip(items, out):
        assert dt == str(src.dtype) and shape == tuple(src.shape) and stride == src.stride(), (src, dt, shape, stride)
        assert cls == type(src).__name__ and rg == src.requires_grad, (cls, rg, src)
        assert data == raw(src).tolist(), (src, data)
    assert same_storage, "the same tensor sent twice arrived as two storages"
    return f"{len(dts)} dtypes, a view, a Parameter, requires_grad, empty, 0-d; same storage twice"


def s_ipc_event(ctx):
    q_in, q_out = queue(ctx), queue(ctx)
    p = start(ctx, child_ipc_event, q_in, q_out)
    ev = torch.cuda.Event(interprocess=True)
    ev.record()
    q_in.put(ev)
    assert get(q_out, [p])
    p.join(TIMEOUT)
    return "torch.cuda.Event(interprocess=True) crossed beside it"


def s_big(ctx, gib):
    """One allocation of `gib` GiB: by pointer where it fits the import limit, as a copy
    into a VMM allocation above it; either way the receiver reads the right bytes and the
    sender's share (and copy) goes when the receiver exits."""
    q_in, q_out = queue(ctx), queue(ctx)
    p = start(ctx, child_big, q_in, q_out)
    n = int(gib * (1 << 30)) // 8
    t = torch.arange(n, device=DEV, dtype=torch.int64)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    q_in.put(t)
    numel, last, first, ok = get(q_out, [p], timeout=300)
    took = (time.perf_counter() - t0) * 1e3
    assert (numel, last, first, ok) == (n, n - 1, 0, True), (numel, last, first, ok)
    p.join(TIMEOUT)
    deadline = time.monotonic() + 10
    while poolipc.torch_sharing.stats()["kept"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert poolipc.torch_sharing.stats()["kept"] == 0, poolipc.torch_sharing.stats()
    torch.cuda.synchronize()
    free_after = torch.cuda.mem_get_info()[0]
    # A copy, where one was made, is given back once the receiver let go (the device's
    # figure is checked only when the scenario has the GPU to itself: others move it).
    if os.environ.get("POOLIPC_TORCHMP_JOBS") == "1":
        assert free_after >= free_before - (64 << 20), (free_before >> 20, free_after >> 20)
    return f"{gib} GiB crossed and read right in {took:.1f} ms; device free {free_before >> 20} -> {free_after >> 20} MiB"


def s_big4(ctx):
    return s_big(ctx, 4)


def s_big6(ctx):
    return s_big(ctx, 6)


def s_unpooled(ctx):
    """Without install_pool: a clear error, not a crash, not wrong bytes."""
    import poolipc as pp

    pp.torch_sharing.enable()
    from torch.multiprocessing.reductions import reduce_tensor

    t = torch.ones(16, device=DEV)
    try:
        reduce_tensor(t)
    except RuntimeError as e:
        assert "install_pool" in str(e), e
        return f"clear error: {str(e)[:200]}"
    raise AssertionError("an unpooled tensor was shared")


SCENARIOS = {
    "queue": s_queue,
    "many": s_many,
    "pool_map": s_pool_map,
    "producer_deletes": s_producer_deletes,
    "sigkill": s_sigkill,
    "process_arg": s_process_arg,
    "channels": s_channels,
    "event": s_event,
    "direct": s_direct,
    "types": s_types,
    "ipc_event": s_ipc_event,
    "big4": s_big4,
    "big6": s_big6,
    "unpooled": s_unpooled,
}


def main(name: str) -> None:
    if MODE == "poolipc":
        poolipc.torch_sharing.enable()
    ctx = mp.get_context(os.environ.get("POOLIPC_TORCHMP_START", "spawn"))
    t0 = time.perf_counter()
    detail = SCENARIOS[name](ctx)
    print(f"PASS {name} [{MODE}] {detail} ({time.perf_counter() - t0:.1f} s)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
