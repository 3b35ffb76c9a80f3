"""A stand-in for the few torch calls bench/pybench.py makes (see ../README.md)."""
import contextlib

float32 = "float32"


class _Tensor:
    def __getitem__(self, i):
        return self

    def item(self):
        return 42.0  # what pybench's worker writes

    def zero_(self):
        return self


class _Stream:
    cuda_stream = 7

    def synchronize(self):
        pass


class cuda:  # noqa: N801  (torch.cuda)
    Stream = _Stream

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()

    @staticmethod
    def synchronize():
        pass

    @staticmethod
    def current_stream(*a):
        return _Stream()


def zeros(n, dtype=None, device=None):
    return _Tensor()


def device(*a):
    return a
