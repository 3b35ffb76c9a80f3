"""Torch-free sharing across multiprocessing, one scenario per run (the simulated driver
in CI, the GPU too):

    python sharing_sim.py basic|dying|relay|copy|unpooled

The parent installs the pool, fills a ``DeviceBuffer`` and puts it (or a ``Shareable``) on
a ``multiprocessing`` Queue; spawned children get ``SharedMapping``\\ s. Prints ``PASS
<name> <details>`` and exits 0, or fails.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time

import poolipc
from poolipc import _native

TIMEOUT = 60.0


def wait_for(pred, what, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not in {timeout} s ({poolipc.torch_sharing.stats()})")
        time.sleep(0.02)


def child_basic(q_in, q_out):
    m = q_in.get(timeout=TIMEOUT)
    assert isinstance(m, poolipc.SharedMapping), type(m)
    first = m.read(0, 8)
    m.write(b"XYZ", 1)
    q_out.put((first, m.nbytes, poolipc.torch_sharing.stats()))
    assert q_in.get(timeout=TIMEOUT) == "release"
    m.release()
    m.release()  # idempotent
    try:
        m.read()
    except poolipc.ExpiredViewError:
        q_out.put("expired")
    q_in.get(timeout=TIMEOUT)


def child_channels(sq, conn):
    a = sq.get()
    b = conn.recv()
    conn.send((a.read(0, 4), b.read(0, 4)))
    a.write(b"AA", 0)
    b.write(b"BB", 0)
    conn.recv()


def child_again(q_in, q_out):
    n = 0
    while True:
        m = q_in.get(timeout=TIMEOUT)
        if m is None:
            break
        m.write(bytes([n % 251]), 0)
        q_out.put(m.read(0, 1))
        del m
        n += 1
    q_out.put(poolipc.torch_sharing.stats())
    q_in.get(timeout=TIMEOUT)


def child_hold(q_in, q_out, n):
    held = [q_in.get(timeout=TIMEOUT) for _ in range(n)]
    q_out.put(sum(m.nbytes for m in held))
    time.sleep(600)


def child_relay(q_in, q_out):
    m = q_in.get(timeout=TIMEOUT)
    q_out.put(m)  # on to a third process: the handle stays the owner's, this one keeps it
    q_in.get(timeout=TIMEOUT)
    # C's release comes once C's GPU work on the memory is done: give it time to arrive.
    deadline = time.monotonic() + 10
    while poolipc.torch_sharing.stats()["kept"] and time.monotonic() < deadline:
        time.sleep(0.02)
    q_out.put(poolipc.torch_sharing.stats()["kept"])
    q_in.get(timeout=TIMEOUT)


def child_last(q_in, q_out):
    m = q_in.get(timeout=TIMEOUT)
    q_out.put(m.read(0, 4))
    m.write(b"C", 0)
    m.release()
    q_out.put("done")


def fill(buf, data):
    _native._memcpy_htod(buf.ptr, data)


def read(buf, n):
    return _native._memcpy_dtoh(buf.ptr, n)


def fd_list():
    out = []
    for f in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            out.append(f"{f}:{os.readlink('/proc/self/fd/' + f)}")
        except OSError:
            pass
    return " ".join(out)


def fds():
    """Sockets and pool descriptors (multiprocessing's own pipes are not ours to count)."""
    n = 0
    for f in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink("/proc/self/fd/" + f).startswith(("socket:", "/memfd:poolipc-sim-pool"))
        except OSError:
            pass
    return n


def s_basic(ctx, parent):
    buf = parent.alloc(4096)
    fill(buf, b"abcdefgh")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child_basic, args=(q_in, q_out), daemon=True)
    p.start()
    q_in.put(buf)
    first, nbytes, child_stats = q_out.get(timeout=TIMEOUT)
    assert first == b"abcdefgh" and nbytes == 4096, (first, nbytes)
    assert child_stats["pools"] == 1 and child_stats["imports"] == 1, child_stats
    assert read(buf, 8) == b"aXYZefgh", read(buf, 8)
    assert poolipc.torch_sharing.stats()["kept"] == 1
    del buf  # the receiver still holds it: the share keeps it alive
    used = poolipc.memory_stats()["used_current"]
    assert used >= 4096, used
    q_in.put("release")
    assert q_out.get(timeout=TIMEOUT) == "expired"
    wait_for(lambda: poolipc.torch_sharing.stats()["kept"] == 0, "the release")
    wait_for(lambda: poolipc.memory_stats()["used_current"] == 0, "the block back to the pool")
    q_in.put(None)
    p.join(TIMEOUT)
    wait_for(lambda: poolipc.torch_sharing.stats()["receivers"] == 0, "the receiver's goodbye")
    return "read, write in place, keep-alive after the sender's del, release, used bytes back to 0"


def s_channels(ctx, parent):
    """A SimpleQueue and a Pipe (pickled in the caller's thread), to a spawned and a
    forkserver child; both shares released once the child exits."""
    for method in ("spawn", "forkserver"):
        c = mp.get_context(method)
        a, b = parent.alloc(4096), parent.alloc(4096)
        fill(a, b"aaaa")
        fill(b, b"bbbb")
        sq = c.SimpleQueue()
        mine, theirs = c.Pipe()
        p = c.Process(target=child_channels, args=(sq, theirs), daemon=True)
        p.start()
        sq.put(a)
        mine.send(b)
        if not mine.poll(TIMEOUT):
            raise TimeoutError(f"{method}: no answer (exit code {p.exitcode})")
        assert mine.recv() == (b"aaaa", b"bbbb"), method
        wait_for(lambda: read(a, 2) == b"AA" and read(b, 2) == b"BB", f"{method}: the child's writes")
        mine.send(None)
        p.join(TIMEOUT)
        wait_for(lambda: poolipc.torch_sharing.stats()["kept"] == 0, f"{method}: the releases")
    return "SimpleQueue and Pipe, spawn and forkserver: read, written in place, released"


def s_again(ctx, parent):
    """The same buffer sent 100 times, each dropped by the receiver before the next comes:
    its import lingers and is taken over, every share is released, nothing is left."""
    buf = parent.alloc(4096)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child_again, args=(q_in, q_out), daemon=True)
    p.start()
    for i in range(100):
        q_in.put(buf)
        assert q_out.get(timeout=TIMEOUT) == bytes([i % 251]), i
        assert read(buf, 1) == bytes([i % 251]), i
    q_in.put(None)
    child = q_out.get(timeout=TIMEOUT)
    assert child["mappings"] == 0 and child["imports"] <= 1, child
    wait_for(lambda: poolipc.torch_sharing.stats()["kept"] == 0, "every share released")
    del buf
    wait_for(lambda: poolipc.memory_stats()["used_current"] == 0, "the block back to the pool")
    q_in.put(None)
    p.join(TIMEOUT)
    return f"100 shares of one buffer, each dropped before the next; the receiver held {child['imports']} import(s) at the end, every share released"


def s_dying(ctx, parent):
    n = 50
    fd0 = fds()
    fd0_list = fd_list()
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child_hold, args=(q_in, q_out, n), daemon=True)
    p.start()
    for i in range(n):
        b = parent.alloc(1024 * (i + 1))
        q_in.put(b)
        del b
    total = q_out.get(timeout=TIMEOUT)
    assert total == sum(1024 * (i + 1) for i in range(n)), total
    assert poolipc.torch_sharing.stats()["kept"] == n
    assert poolipc.memory_stats()["used_current"] >= total
    os.kill(p.pid, signal.SIGKILL)
    p.join(TIMEOUT)
    p.close()
    wait_for(lambda: poolipc.torch_sharing.stats()["kept"] == 0, "the dead receiver's releases")
    wait_for(lambda: poolipc.memory_stats()["used_current"] == 0, "the blocks back to the pool")
    wait_for(lambda: poolipc.torch_sharing.stats()["receivers"] == 0, "the connection closed")
    q_in.close()
    q_out.close()
    q_in.join_thread()
    q_out.join_thread()
    # The share server's listening socket stays (one descriptor); no connection, no pool.
    try:
        wait_for(lambda: fds() <= fd0 + 1, "descriptors back", 10)
    except TimeoutError as e:
        raise AssertionError(f"{e}: before {fd0_list}; now {fd_list()}") from None
    return f"{n} shares held, SIGKILL: all released, used bytes 0, descriptors {fd0} -> {fds()}"


def s_relay(ctx, parent):
    buf = parent.alloc(256)
    fill(buf, b"ABCD")
    a_b, b_c, c_out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    b = ctx.Process(target=child_relay, args=(a_b, b_c), daemon=True)
    b.start()
    a_b.put(buf)
    c = ctx.Process(target=child_last, args=(b_c, c_out), daemon=True)
    c.start()
    assert c_out.get(timeout=TIMEOUT) == b"ABCD"
    assert c_out.get(timeout=TIMEOUT) == "done"
    assert read(buf, 4) == b"CBCD", read(buf, 4)
    a_b.put("stats")
    kept_b = b_c.get(timeout=TIMEOUT)
    assert kept_b == 0, f"B still keeps {kept_b} share(s) after C released"
    a_b.put(None)
    b.join(TIMEOUT)
    c.join(TIMEOUT)
    wait_for(lambda: poolipc.torch_sharing.stats()["kept"] == 0, "B's release")
    return "A -> B -> C: C read A's bytes and wrote in place; B and A released"


def child_copy(q_in, q_out):
    m = q_in.get(timeout=TIMEOUT)
    q_out.put((m.nbytes, m.read(0, 8), m.read(m.nbytes - 8, 8), poolipc.torch_sharing.stats()))
    m.write(b"child", 0)
    m.release()
    q_in.get(timeout=TIMEOUT)


def s_copy(ctx, parent):
    """An allocation above the import limit (lowered to 2 chunks here) crosses as a copy:
    the receiver maps a VMM allocation the sender made and serves by FD."""
    parent.lower_import_limit(2)
    n = 96 << 20
    buf = parent.alloc(n)
    fill(buf, b"first..!")
    _native._memcpy_htod(buf.ptr + n - 8, b"..last!!")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child_copy, args=(q_in, q_out), daemon=True)
    p.start()
    q_in.put(buf)
    nbytes, head, tail, child_stats = q_out.get(timeout=TIMEOUT)
    assert (nbytes, head, tail) == (n, b"first..!", b"..last!!"), (nbytes, head, tail)
    assert child_stats["pools"] == 0 and child_stats["imports"] == 1, child_stats
    wait_for(lambda: poolipc.torch_sharing.stats()["kept"] == 0, "the copy's release")
    # A copy: the receiver's write is its own.
    assert read(buf, 8) == b"first..!", read(buf, 8)
    q_in.put(None)
    p.join(TIMEOUT)
    return f"{n >> 20} MiB above a 2-chunk import limit crossed as a copy, read right, released"


def s_unpooled(ctx, parent):
    import pickle

    buf = parent.alloc(64, shared=False)
    try:
        pickle.dumps(buf)
    except poolipc.PoolipcError as e:
        assert "not from poolipc's pool" in str(e), e
        return f"clear error: {e}"
    raise AssertionError("memory outside the pool was shared")


def main(name):
    poolipc.install_pool(0)
    parent = poolipc.Parent(0)
    ctx = mp.get_context("spawn")
    detail = {
        "again": s_again,
        "basic": s_basic,
        "channels": s_channels,
        "dying": s_dying,
        "relay": s_relay,
        "copy": s_copy,
        "unpooled": s_unpooled,
    }[name](ctx, parent)
    print(f"PASS {name}: {detail}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
