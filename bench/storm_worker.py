"""The storm's worker (bench/storm.py): each job's one input comes back XOR 0xA5 in one
result of the same shape. STORM_WORKER=bytes: torch-free, through View.read_bytes and
View.write_bytes; STORM_WORKER=torch: through DLPack into torch on the job's stream."""

import os

import poolipc

KIND = os.environ.get("STORM_WORKER", "bytes")


def main():
    worker = poolipc.Worker()
    if KIND == "torch":
        import torch
    for job in worker:
        with job:
            (v,) = job.inputs
            if KIND == "torch":
                x = torch.from_dlpack(v)
                (o,) = job.request_results([("uint8", tuple(x.shape))])
                torch.from_dlpack(o).copy_(x ^ 0xA5)
                del x
            else:
                data = v.read_bytes()
                (o,) = job.request_results([("uint8", list(v.shape))])
                o.write_bytes(bytes(b ^ 0xA5 for b in data))


if __name__ == "__main__":
    main()
