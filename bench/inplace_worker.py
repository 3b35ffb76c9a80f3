"""bench/inplace.py's worker: adds 1 in place to every input (torch, on the job's stream) and
asks for no result."""

import poolipc
import torch


def main():
    worker = poolipc.Worker()
    for job in worker:
        try:
            with job:
                for v in job.inputs:
                    torch.from_dlpack(v).add_(1)
                # A write into a read-only mapping faults here, inside this job.
                torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (the parent sees the job fail)
            print(f"inplace worker: job failed: {e!r}", flush=True)


if __name__ == "__main__":
    main()
