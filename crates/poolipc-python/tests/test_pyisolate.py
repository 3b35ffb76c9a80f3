"""poolipc.pyisolate with the real pyisolate 0.10.2 from PyPI, on the simulated driver, across
real processes: pyisolate starts the extension (`python -m pyisolate._internal.uds_client` in
its venv), RPC goes over pyisolate's JSONSocketTransport, and poolipc's serializers, registered
through pyisolate's adapter hook on both sides, send the tensors by pool pointer.

No torch here: the host lends `poolipc.DeviceBuffer`s, the extension receives
`poolipc.pyisolate.LentView`s and sends them back through the return lease. The torch variant
is in gpu_pyisolate_test.py.

Each test runs in a child pytest of this file (a fresh interpreter and parent: the adapter is
one per process, and test_sim.py makes the main run's parent with its own options).
"""

import asyncio
import functools
import logging
import os
import struct
import sys
import time

import pytest

os.environ.setdefault("POOLIPC_DRIVER", "sim")
if os.environ["POOLIPC_DRIVER"] != "sim":
    pytest.skip("test_pyisolate.py runs on the simulated driver only", allow_module_level=True)
if "torch" in sys.modules:
    pytest.skip("torch is imported in this process; run test_pyisolate.py in its own pytest process",
                allow_module_level=True)
pyisolate = pytest.importorskip("pyisolate")

import poolipc  # noqa: E402
import poolipc.pyisolate as pp  # noqa: E402

from conftest import run_in_child_pytest  # noqa: E402

CHILD = os.environ.get("POOLIPC_PYISO_CHILD") == "1"


def own_process(test=None, *, handoff_timeout=None):
    """Runs the test in a child pytest of this file (whose parent gets `handoff_timeout`)."""
    if test is None:
        return functools.partial(own_process, handoff_timeout=handoff_timeout)

    @functools.wraps(test)
    def run(*args, **kwargs):
        if CHILD:
            return test(*args, **kwargs)
        extra = {"POOLIPC_PYISO_CHILD": "1"}
        if handoff_timeout is not None:
            extra["POOLIPC_PYISO_HANDOFF"] = str(handoff_timeout)
        run_in_child_pytest(__file__, kwargs["request"], extra)

    return run


@pytest.fixture(scope="module")
def parent():
    if not CHILD:
        return None
    handoff = os.environ.get("POOLIPC_PYISO_HANDOFF")
    info = poolipc.install_pool(0, stop_timeout=2.0, handoff_timeout=float(handoff) if handoff else None)
    assert info["installed"] and "SIMULATED" in info["driver"]
    return poolipc.Parent(0)


def buffer(parent, data):
    buf = parent.alloc(len(data), dtype="uint8", shape=[len(data)])
    parent.write(buf.ptr, data)
    return buf


def wait_until(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while True:
        v = cond()
        if v or time.monotonic() > end:
            return v
        time.sleep(0.02)


def run_with_extension(parent, tmp_path, body):
    """Starts the extension with poolipc's adapter, runs `await body(ext, channel)`, stops
    everything; returns what body returned."""
    import pyiso_harness

    assert pyiso_harness.uv_dir(), "pyisolate's wheel brings uv; it should be beside this interpreter"
    pyisolate.register_adapter(pp.PoolipcAdapter())
    channel = pp.HostChannel(parent)

    lost = parent.stats()["workers_lost"]

    async def main():
        manager, ext = pyiso_harness.load_extension(channel, tmp_path / "venvs")
        try:
            return await body(ext, channel)
        finally:
            # pyisolate's receive thread in the extension holds the last message it received
            # (its arguments, so their leases) until the next one arrives: send one more.
            await ext.channel_stats()
            assert wait_until(lambda: channel.leases_out() == 0, 10), "every lease ended"
            t0 = time.monotonic()
            channel.close()
            closed_in = time.monotonic() - t0
            manager.stop_all_extensions()
            # The extension closed its side at the goodbye: no deadline ran out, nothing lost.
            assert closed_in < 1.5, f"closing the channel took {closed_in:.2f} s"
            assert parent.stats()["workers_lost"] == lost

    return asyncio.run(main())


@own_process
def test_a_lent_buffer_reaches_the_extension_by_pool_pointer_and_comes_back(parent, request, tmp_path):
    data = bytes(range(256)) * 16

    async def body(ext, channel):
        buf = buffer(parent, data)
        seen = await ext.describe(buf)
        assert seen == {"type": "LentView", "shape": [4096], "dtype": "uint8", "rung": "pool pointer",
                        "head": data[:8].hex()}
        back = await ext.echo(buf)
        assert isinstance(back, poolipc.DeviceBuffer), type(back)
        assert back.shape == (4096,) and back.dtype == "uint8"
        assert parent.read(back.ptr, 4096) == data, "the returned tensor holds the lent bytes"
        assert back.ptr != buf.ptr, "it is the host's own memory, not the lent tensor"
        stats = await ext.channel_stats()
        assert stats["leases_taken"] == 2 and stats["tensors_sent"] == 1
        assert stats["token"] == channel.token
        assert channel.leases_lent == 2 and channel.tensors_returned == 1
        return parent.stats()

    stats = run_with_extension(parent, tmp_path, body)
    assert stats["pool_pointer_tensors"] >= 2


@own_process
def test_a_write_in_the_extension_is_seen_by_the_host(parent, request, tmp_path):
    async def body(ext, channel):
        buf = buffer(parent, b"\0" * 64)
        rung = await ext.write_first(buf, "deadbeef")
        assert rung == "pool pointer"
        # The lease ends once the extension dropped the view (pyisolate's receive thread
        # holds the last message until the next one arrives).
        await ext.channel_stats()
        assert wait_until(lambda: channel.leases_out() == 0), "the lease ended"
        assert parent.read(buf.ptr, 4) == bytes.fromhex("deadbeef")

    run_with_extension(parent, tmp_path, body)


@own_process
def test_a_lease_lasts_as_long_as_the_extension_keeps_the_tensor(parent, request, tmp_path):
    async def body(ext, channel):
        a = buffer(parent, b"\1" * 32)
        b = buffer(parent, b"\2" * 32)
        assert await ext.keep(a) == 1
        assert await ext.keep(b) == 2
        await ext.channel_stats()
        time.sleep(0.3)
        assert channel.leases_out() == 2, "kept tensors keep their leases open"
        # Two leases held at once, and the extension still serves calls with tensors.
        c = buffer(parent, b"\3" * 32)
        assert (await ext.describe(c))["head"] == "03" * 8
        assert await ext.drop_kept() == 2
        await ext.channel_stats()
        assert wait_until(lambda: channel.leases_out() == 0), "dropping them ended their leases"

    run_with_extension(parent, tmp_path, body)


@own_process
def test_two_tensors_in_one_message_go_as_two_leases_and_come_back_in_order(parent, request, tmp_path):
    async def body(ext, channel):
        a = buffer(parent, b"A" * 100)
        b = buffer(parent, b"B" * 300)
        out = await ext.two(a, b)
        assert [o.shape for o in out] == [(300,), (100,)]
        assert parent.read(out[0].ptr, 300) == b"B" * 300
        assert parent.read(out[1].ptr, 100) == b"A" * 100
        assert channel.tensors_returned == 2

    run_with_extension(parent, tmp_path, body)


@own_process
def test_with_two_channels_a_message_needs_its_channel_named(parent, request, tmp_path):
    other = pp.HostChannel(parent)
    try:
        async def body(ext, channel):
            buf = buffer(parent, b"x" * 8)
            with pytest.raises(Exception, match="2 poolipc channels exist"):
                await ext.describe(buf)
            with channel.sending():
                assert (await ext.describe(buf))["head"] == "78" * 8
            bound = channel.bind(ext)
            assert (await bound.describe(buf))["rung"] == "pool pointer"

        run_with_extension(parent, tmp_path, body)
    finally:
        other.close()


@own_process(handoff_timeout=1.5)
def test_an_idle_extension_renews_its_return_lease_and_is_not_killed(parent, request, tmp_path):
    # A parent with a 1.5 s deadline: an extension holding its return lease unused past it
    # would be killed; it finishes it every third of that, and the host lends the next.
    async def body(ext, channel):
        buf = buffer(parent, b"r" * 16)
        time.sleep(4.0)
        back = await ext.echo(buf)
        assert parent.read(back.ptr, 16) == b"r" * 16
        return parent.stats()

    stats = run_with_extension(parent, tmp_path, body)
    assert stats["workers_lost"] == 0
    assert stats["jobs_completed"] >= 3, "renewed return leases completed"


def test_registering_without_the_right_pyisolate_is_a_clear_error(monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.11.0" if name == "pyisolate" else real(name))
    with pytest.raises(ImportError, match=r"pyisolate>=0.10,<0.11.*0\.11\.0"):
        pp.register(child=False)
    monkeypatch.setattr(importlib.metadata, "version", real)
    assert pp.check_pyisolate().startswith("0.10.")


def test_the_host_serializer_wraps_pyisolates_and_survives_its_re_registration():
    from pyisolate._internal.serialization_registry import SerializerRegistry

    reg = SerializerRegistry()  # a fresh one, not the process's

    class Tensor:  # what the registry keys torch tensors by: the class name
        is_cuda = False

    sent = []

    def pyisolates(obj):
        sent.append(obj)
        return {"__type__": "TensorValue"}

    reg.register("Tensor", pyisolates)
    pp.register(reg, child=False)
    ours = reg.get_serializer("Tensor")
    assert ours is not pyisolates and ours.__poolipc_delegate__ is pyisolates
    t = Tensor()
    assert ours(t) == {"__type__": "TensorValue"} and sent == [t], "a CPU tensor goes to pyisolate's"
    # pyisolate registers its own again at every extension start (host.py:238), then the
    # adapter's register runs again: ours wraps the new one.
    def pyisolates_again(obj):
        return {"__type__": "TensorValue", "again": True}

    reg.register("Tensor", pyisolates_again)
    pp.register(reg, child=False)
    assert reg.get_serializer("Tensor").__poolipc_delegate__ is pyisolates_again
    pp.register(reg, child=False)
    assert reg.get_serializer("Tensor").__poolipc_delegate__ is pyisolates_again, "idempotent"
    assert reg.get_serializer("Parameter").__poolipc_delegate__ is pyisolates_again
    assert reg.get_deserializer(pp.RETURNED) is not None and reg.get_serializer("DeviceBuffer") is not None


@own_process
def test_closing_while_the_extension_keeps_a_tensor_warns_and_the_parent_stops_waiting(parent, request, tmp_path, caplog):
    import pyiso_harness

    pyiso_harness.uv_dir()
    pyisolate.register_adapter(pp.PoolipcAdapter())
    channel = pp.HostChannel(parent)
    lost = parent.stats()["workers_lost"]

    async def main():
        manager, ext = pyiso_harness.load_extension(channel, tmp_path / "venvs")
        try:
            kept = buffer(parent, b"k" * 64)
            assert await ext.keep(kept) == 1
            await ext.channel_stats()
            assert channel.leases_out() == 1
            t0 = time.monotonic()
            with caplog.at_level(logging.WARNING, logger="poolipc.pyisolate"):
                channel.close()
            waited = time.monotonic() - t0
            said = [r.getMessage() for r in caplog.records if "holds 1 leases" in r.getMessage()]
            assert said, [r.getMessage() for r in caplog.records]
            # The extension kept its side open for the lease; the parent waited its stop
            # deadline (2 s here), then stopped waiting and took the memory back.
            assert 1.5 < waited < 10, waited
            assert parent.stats()["workers_lost"] == lost + 1
            # The extension goes on serving pyisolate's RPC; dropping the tensor is harmless.
            assert await ext.drop_kept() == 1
            assert (await ext.channel_stats())["leases_taken"] == 1
        finally:
            manager.stop_all_extensions()

    asyncio.run(main())


# --- a channel is a capability: its token, one worker, its own directory -------------------


def raw_peer(path, send):
    """Connects to `path` as a process of our uid that was not given the token, sends `send`
    and half-closes; returns what the host sent back before hanging up (bytes, descriptors)."""
    import array
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    data, fds = b"", []
    try:
        s.connect(path)
        if send:
            s.sendall(send)
        s.shutdown(socket.SHUT_WR)
        while not data:  # the pool FD would come with the host's first bytes (its Hello)
            msg, anc, _flags, _addr = s.recvmsg(1 << 16, socket.CMSG_SPACE(16 * 4))
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds += array.array("i", cdata[: len(cdata) - len(cdata) % 4])
            if not msg:
                break
            data += msg
    except (ConnectionRefusedError, ConnectionResetError, FileNotFoundError):
        pass
    finally:
        s.close()
        for fd in fds:
            os.close(fd)
    return data, len(fds)


def start_extension_worker(channel):
    """The extension's side without pyisolate: a worker process connecting with the
    environment the channel gives its extension (`Worker.connect()` sends the token)."""
    import subprocess

    from conftest import py_worker_argv

    env = dict(os.environ)
    env.pop("POOLIPC_FD", None)
    env.update(channel.env())
    env["POOLIPC_TEST_MODE"] = "echo"
    return subprocess.Popen(py_worker_argv(), env=env)


@own_process
def test_a_channel_connection_without_the_token_is_refused_before_the_pool_fd_is_sent(parent, request):
    channel = pp.HostChannel(parent)
    try:
        for send in (b"", b"not the token", b"y" * 32, channel.token.upper().encode()):
            assert raw_peer(channel.listener.path, send) == (b"", 0), send
        assert channel.listener.refused_count == 4
        assert all("token" in r for r in channel.listener.refused)
        assert parent.workers() == []
        # the extension, with the token, still gets in
        proc = start_extension_worker(channel)
        w = channel.connect(timeout=60)
        assert parent.workers() == [w]
    finally:
        channel.close()
    assert proc.wait(30) == 0


@own_process
def test_a_second_connection_on_a_used_channel_is_refused(parent, request):
    channel = pp.HostChannel(parent)
    try:
        proc = start_extension_worker(channel)
        w = channel.connect(timeout=60)
        assert wait_until(lambda: channel.listener.closed)
        # even with the token: the channel served its one worker
        assert raw_peer(channel.listener.path, channel.token.encode()) == (b"", 0)
        assert not os.path.exists(channel.listener.path)
        assert parent.workers() == [w]
    finally:
        channel.close()
    assert proc.wait(30) == 0


@own_process
def test_a_flood_of_200_connections_leaves_workers_and_fds_bounded(parent, request):
    channel = pp.HostChannel(parent)
    try:
        fds_before = len(os.listdir("/proc/self/fd"))
        for i in range(200):
            assert raw_peer(channel.listener.path, b"%032d" % i) == (b"", 0), i
        assert channel.listener.refused_count == 200
        assert len(channel.listener.refused) <= 32
        assert parent.workers() == []
        assert len(os.listdir("/proc/self/fd")) <= fds_before + 16
        proc = start_extension_worker(channel)
        w = channel.connect(timeout=60)
        assert parent.workers() == [w]
    finally:
        channel.close()
    assert proc.wait(30) == 0


@own_process
def test_each_sandbox_is_given_only_its_own_channels_directory(parent, request):
    adapter = pp.PoolipcAdapter()
    a, b = pp.HostChannel(parent), pp.HostChannel(parent)
    dir_a, dir_b = (os.path.dirname(c.listener.path) for c in (a, b))
    try:
        assert adapter.get_sandbox_system_paths() is None  # two wait, none chosen
        with a.sending():
            assert adapter.get_sandbox_system_paths() == [dir_a]
        with b.sending():
            assert adapter.get_sandbox_system_paths() == [dir_b]
        b.close()
        assert adapter.get_sandbox_system_paths() == [dir_a]  # the one still waiting
        proc = start_extension_worker(a)
        a.connect(timeout=60)
        assert wait_until(lambda: a.listener.closed)
        assert adapter.get_sandbox_system_paths() is None  # connected: nothing to reach
    finally:
        a.close()
        b.close()
    assert proc.wait(30) == 0
