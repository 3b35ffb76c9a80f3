"""The pyisolate extension the tests load (its class; the module pyisolate loads from
`module_path` is pyiso_module/). It runs in pyisolate's child process, where pyisolate
rehydrates poolipc's adapter, whose serializers connect the extension's poolipc channel.

Without torch a lent tensor arrives as a `poolipc.pyisolate.LentView`; with torch, as a torch
tensor over the parent's memory.
"""

import sys

from pyisolate import ExtensionBase


class PoolipcTestExtension(ExtensionBase):
    """Methods the host calls over pyisolate's RPC."""

    async def on_module_loaded(self, module):
        self.kept = []

    async def describe(self, x):
        """What arrived: type, shape, dtype, how it crossed, its first bytes."""
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(x, torch.Tensor):
            return {"type": "Tensor", "shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch."),
                    "device": str(x.device), "sum": float(x.double().sum().item())}
        return {"type": type(x).__name__, "shape": list(x.shape), "dtype": x.dtype, "rung": x.rung,
                "head": x.read_bytes()[:8].hex()}

    async def echo(self, x):
        """Sends the tensor back (through the return lease)."""
        return x

    async def scaled(self, x, factor):
        """A new tensor of the extension's own (torch): x * factor."""
        return x * factor

    async def two(self, a, b):
        """Two tensors in one message, two back."""
        return [b, a]

    async def write_first(self, x, data_hex):
        """Writes into the lent tensor in place: the parent sees it (pool pointer)."""
        x.write_bytes(bytes.fromhex(data_hex))
        return x.rung

    async def keep(self, x):
        """Keeps the tensor past the call: its lease stays open."""
        self.kept.append(x)
        return len(self.kept)

    async def drop_kept(self):
        """Drops what it kept: their leases end."""
        n = len(self.kept)
        self.kept.clear()
        return n

    async def channel_stats(self):
        import poolipc.pyisolate as pp

        ch = pp.child_channel()
        return {"leases_taken": ch.leases_taken, "tensors_sent": ch.tensors_sent, "token": ch.token}
