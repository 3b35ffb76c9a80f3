"""A torch worker for the H200 suite: views go into torch by DLPack (no copy); each result is
``x * 2 + 1`` in the input's dtype and shape. POOLIPC_TEST_MODE: ``torch`` (default),
``cupy`` (reads by __cuda_array_interface__, writes with CuPy on the job's stream),
``die-after-import``, ``die-after-grant`` (SIGKILL at that step), ``fresh-threads`` (each job
taken and served on a new thread that touched no CUDA before: the binding makes the worker's
device current on whichever thread calls it)."""

import os
import signal
import threading

import poolipc
import torch

MODE = os.environ.get("POOLIPC_TEST_MODE", "torch")


def main():
    worker = poolipc.Worker()
    if MODE == "fresh-threads":
        taken = []

        def one():
            job = worker.next_job()
            taken.append(job is not None)
            if job is not None:
                serve(job)

        while not taken or taken[-1]:
            t = threading.Thread(target=one)
            t.start()
            t.join()
        return
    for job in worker:
        if MODE == "die-after-import":
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            serve(job)
        except poolipc.JobFailedError as e:
            # The parent refused this job's results (an arena cap, say): `with job` has
            # reported the job failed; the worker goes on with the next one.
            print(f"torch worker: {job!r} failed: {e}", flush=True)


def serve(job):
    with job:
        if MODE == "cupy":
            import cupy

            with cupy.cuda.ExternalStream(job.stream):
                xs = [cupy.asarray(v) for v in job.inputs]
                outs = job.request_results([(v.dtype, tuple(v.shape)) for v in job.inputs])
                for x, o in zip(xs, outs):
                    cupy.asarray(o)[...] = x * 2 + 1
            return
        xs = [torch.from_dlpack(v) for v in job.inputs]
        outs = job.request_results([(str(x.dtype).removeprefix("torch."), tuple(x.shape)) for x in xs])
        if MODE == "die-after-grant":
            os.kill(os.getpid(), signal.SIGKILL)
        for x, o in zip(xs, outs):
            torch.from_dlpack(o).copy_(x * 2 + 1)
        del xs


if __name__ == "__main__":
    main()
