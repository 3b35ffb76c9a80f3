"""The example worker of the poolipc ComfyUI pack: for each input image, a result of the same
shape holding ``1 - image``. torch takes the views by DLPack, without a copy."""

import poolipc
import torch


def main():
    worker = poolipc.Worker()
    for job in worker:
        with job:
            images = [torch.from_dlpack(v) for v in job.inputs]
            outs = job.request_results([(str(x.dtype).removeprefix("torch."), tuple(x.shape)) for x in images])
            for x, out in zip(images, outs):
                torch.from_dlpack(out).copy_(1.0 - x)
            del images  # tensors over the views must not outlive the job


if __name__ == "__main__":
    main()
