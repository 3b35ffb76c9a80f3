"""A stand-in for the poolipc binding in the pack's tests (no GPU, no Rust build): the API the
pack uses, with workers that are real child processes and tensors that are `FakeTensor`s.

`install_pool` prints one line naming the device and the CUDA_VISIBLE_DEVICES it saw, so the
startup tests can check what the real one would have initialised CUDA with. `Parent.pid`
keeps answering for a worker that died (as a binding that has not noticed yet), so the pack's
own liveness check is what the tests exercise.
"""
import os
import subprocess
import sys

STUB = True
INSTALLS = []


class PoolipcError(RuntimeError):
    pass


class JobFailedError(PoolipcError):
    pass


class UnknownWorkerError(PoolipcError, KeyError):
    pass


class MpsError(PoolipcError):
    pass


def start_mps(*, accept_shared_gpu_faults=False, control=None):
    if not accept_shared_gpu_faults:
        raise MpsError("MPS not started: not acknowledged (stub)")
    if "torch" in sys.modules:
        raise MpsError("MPS not started: torch first (stub)")
    pipe = "/tmp/poolipc-mps-stub/pipe"
    print(f"poolipc: started a private MPS daemon ({pipe}) (stub)", file=sys.stderr, flush=True)
    return pipe


def install_pool(device=0, **options):
    if "torch" in sys.modules:
        raise PoolipcError("poolipc.install_pool: torch is already imported")
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if not conf:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
    INSTALLS.append(device)
    print(
        f"poolipc: installed a shareable CUDA memory pool as device {device}'s current pool "
        f"(stub, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}"
        + "".join(f", {k}={v!r}" for k, v in sorted(options.items())) + ")",
        file=sys.stderr,
        flush=True,
    )
    return {"installed": True, "driver": "stub", "device": device, "effective": True, "reason": None}


def is_installed():
    return bool(INSTALLS)


def memory_stats():
    return {}


class FakeTensor:
    """Just enough of a tensor: values, a shape and a device."""

    def __init__(self, values, device="cpu"):
        self.values, self.device = list(values), device
        self.shape = (len(self.values),)

    def to(self, device):
        return FakeTensor(self.values, str(device))

    def contiguous(self):
        return self


class Parent:
    instances = []
    return_rungs_supported = True

    def __init__(self, device=0):
        self.device = device
        self.procs, self.spawned, self.stopped = {}, [], []
        self.allowlists = []
        self.trusts = []
        self._next = 1
        Parent.instances.append(self)

    def spawn(self, argv, env=None, env_allowlist=None, *, isolated=None):
        argv = [str(a) for a in argv]
        self.trusts.append(isolated)
        inherited = dict(os.environ)
        if env_allowlist is not None:  # what the binding keeps (poolipc::restrict_env)
            keep = set(env_allowlist) | {"PATH", "HOME", "TMPDIR", "LANG", "LD_LIBRARY_PATH", "PYTHONPATH"}
            inherited = {
                k: v for k, v in inherited.items()
                if k in keep or k.startswith(("POOLIPC_", "CUDA_", "LC_"))
            }
        self.allowlists.append(env_allowlist)
        proc = subprocess.Popen(argv, env={**inherited, **(env or {})})
        worker, self._next = self._next, self._next + 1
        self.procs[worker] = proc
        self.spawned.append((worker, argv, env))
        return worker

    def pid(self, worker):
        if worker not in self.procs:
            raise UnknownWorkerError(worker)
        return self.procs[worker].pid

    def stop(self, worker):
        proc = self.procs.pop(worker, None)
        if proc is None:
            raise UnknownWorkerError(worker)
        self.stopped.append(worker)
        proc.terminate()
        return proc.wait(10)

    def _run(self, worker, inputs):
        proc = self.procs.get(worker)
        if proc is None:
            raise UnknownWorkerError(worker)
        if proc.poll() is not None:
            raise JobFailedError(f"worker {worker} lost: exited with {proc.returncode}")
        return tuple(FakeTensor([1.0 - v for v in x.values], x.device) for x in inputs)

    def run(self, worker, inputs, **kwargs):
        if kwargs.pop("return_rungs", False):
            if not Parent.return_rungs_supported:
                raise TypeError("run() got an unexpected keyword argument 'return_rungs'")
            outs = self._run(worker, inputs)
            return outs, {"inputs": ["pool pointer"] * len(inputs), "results": ["pool pointer"] * len(outs)}
        return self._run(worker, inputs)
