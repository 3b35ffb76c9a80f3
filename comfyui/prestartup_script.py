"""poolipc's ComfyUI prestartup hook: swap torch's CUDA memory pool for a shareable one, so
that tensors can be handed to isolated worker processes without a copy.

Opt in with ``POOLIPC_ENABLE=1`` in ComfyUI's environment. ComfyUI runs this file before it
imports torch; it works whether ComfyUI's ``cuda_malloc`` ran before (current ``main.py``) or
runs after (older ``main.py``) the prestartup scripts. It never breaks startup: any failure
is logged with its reason and ComfyUI starts as before.
"""


def _poolipc_prestartup():
    import logging
    import os
    import sys

    log = logging.getLogger("poolipc")

    def say(msg, level=logging.WARNING):
        log.log(level, msg)
        if not logging.getLogger().hasHandlers() and not log.handlers:
            print(msg, file=sys.stderr, flush=True)

    if os.environ.get("POOLIPC_ENABLE", "").strip().lower() not in ("1", "true", "yes", "on"):
        return
    try:
        try:
            import poolipc
        except ImportError as e:
            say(
                f"poolipc: not enabled ({e}); install the wheel into ComfyUI's Python "
                "(python -m pip install poolipc-*.whl). ComfyUI starts as before."
            )
            return
        device = int(os.environ.get("POOLIPC_DEVICE", "0"))
        poolipc.install_pool(device)  # logs its own line
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - a Rust panic surfaces as a BaseException
        say(f"poolipc: not enabled: {type(e).__name__}: {e}. ComfyUI starts as before.")


_poolipc_prestartup()
