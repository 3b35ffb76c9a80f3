#!/usr/bin/env python3
"""The client side of the real-ComfyUI run (``run.sh``): talks to a ComfyUI server over its
HTTP API and checks what comes back. Standard library, plus numpy and Pillow (which ComfyUI
needs anyway) for the image checks.

Subcommands (each prints what it saw, and one ``RESULT {json}`` line last; exit 0 = pass):

- ``image [--flip] PATH``: write the test PNG (256x48 RGB, every 8-bit value occurs).
- ``wait --url U --pid PID``: wait until the server answers ``/system_stats`` (fails at once
  when the server process exits first); prints ComfyUI's device line (its allocator backend).
- ``object-info --url U --worker NAME``: the pack's nodes are registered, the start node's
  ``worker`` list holds NAME (read from the server's worker file).
- ``prompt --url U --comfy DIR --image NAME --worker NAME --prefix P --expect pool|staging|refused``:
  POST /prompt with LoadImage -> poolipc: start worker -> poolipc: invert in worker ->
  SaveImage, poll /history/<id>, then check the saved PNG pixel for pixel against the inverse
  of the input (computed the way ComfyUI computes it) and the invert node's text for the rung;
  with ``refused``, check that the start node refused with the pack's "not enabled" words.
- ``free --url U``: POST /free {"unload_models": true} (the pack then stops its workers).
- ``workflow``: print the API-format workflow (for reading; the CI test validates it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

START, INVERT = "PoolipcStartWorker", "PoolipcInvertInWorker"


def workflow(image: str, worker: str, prefix: str) -> dict:
    """The API-format prompt: node ids are strings, a link is [node id, output index]."""
    return {
        "1": {"class_type": "LoadImage", "inputs": {"image": image}},
        "2": {"class_type": START, "inputs": {"worker": worker}},
        "3": {"class_type": INVERT, "inputs": {"image": ["1", 0], "worker": ["2", 0]}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["3", 0], "filename_prefix": prefix}},
    }


def http(method: str, url: str, body=None, timeout: float = 10.0):
    """(status, bytes); an HTTP error status is returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def result(ok: bool, **fields) -> int:
    fields["ok"] = ok
    print("RESULT " + json.dumps(fields, sort_keys=True, default=str), flush=True)
    return 0 if ok else 1


def say(msg: str) -> None:
    print(msg, flush=True)


# --- the test image -------------------------------------------------------------------------


def make_image(path: str, flip: bool = False) -> int:
    import numpy as np
    from PIL import Image

    w, h = 256, 48
    x = np.arange(w, dtype=np.int64)[None, :].repeat(h, 0)
    y = np.arange(h, dtype=np.int64)[:, None].repeat(w, 1)
    rgb = np.stack([x, 255 - x, (x * 7 + y * 13) % 256], axis=-1).astype(np.uint8)
    if flip:  # a second image, so that ComfyUI runs the invert node again
        rgb = np.ascontiguousarray(rgb[::-1, ::-1])
    Image.fromarray(rgb, "RGB").save(path)
    say(f"wrote {path}: {w}x{h} RGB, every 8-bit value in red and green{' (flipped)' if flip else ''}")
    return result(True, path=path)


def expected_inverse(input_png: str):
    """What SaveImage must write for ``1 - image`` of LoadImage's tensor, computed with the
    same float32 steps ComfyUI takes: LoadImage ``uint8 -> float32 / 255``, the worker
    ``1.0 - x`` (float32), SaveImage ``clip(255. * x).astype(uint8)`` (truncation). Also the
    plain ``255 - v``, which truncation misses by one for some values."""
    import numpy as np
    from PIL import Image, ImageOps

    img = ImageOps.exif_transpose(Image.open(input_png)).convert("RGB")
    src = np.array(img)
    x = src.astype(np.float32) / 255.0
    y = np.float32(1.0) - x
    exp = np.clip(np.float32(255.0) * y, 0, 255).astype(np.uint8)
    return src, exp, (255 - src.astype(np.int64)).astype(np.uint8)


# --- server commands ------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def wait(url: str, pid: int | None, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if pid is not None and not _pid_alive(pid):
            return result(False, why=f"the server (pid {pid}) exited before it answered", last=last)
        try:
            code, body = http("GET", url + "/system_stats", timeout=5)
            if code == 200:
                stats = json.loads(body)
                dev = (stats.get("devices") or [{}])[0]
                say(f"server answers: device {dev.get('name')!r} (type {dev.get('type')}, index {dev.get('index')})")
                return result(True, device=dev.get("name"), waited_s=round(timeout - (deadline - time.monotonic()), 1))
            last = f"HTTP {code}"
        except (OSError, ValueError) as e:
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.5)
    return result(False, why=f"no answer from {url}/system_stats in {timeout:.0f} s", last=last)


def object_info(url: str, worker: str) -> int:
    problems = []
    info = {}
    for cls in (START, INVERT):
        code, body = http("GET", f"{url}/object_info/{cls}")
        doc = json.loads(body) if code == 200 else {}
        if cls not in doc:
            problems.append(f"{cls} is not registered (HTTP {code}: {body[:200]!r})")
            continue
        info[cls] = doc[cls]
    start = info.get(START)
    if start:
        choices = start["input"]["required"]["worker"][0]
        say(f"{START}: display name {start.get('display_name')!r}, worker choices {choices}")
        if worker not in choices:
            problems.append(f"worker {worker!r} is not among the start node's choices {choices}")
        if start.get("output") != ["POOLIPC_WORKER"]:
            problems.append(f"{START} outputs {start.get('output')}, expected ['POOLIPC_WORKER']")
    inv = info.get(INVERT)
    if inv:
        say(f"{INVERT}: display name {inv.get('display_name')!r}, inputs {sorted(inv['input']['required'])}, outputs {inv.get('output')}")
        if inv.get("output") != ["IMAGE", "STRING"]:
            problems.append(f"{INVERT} outputs {inv.get('output')}, expected ['IMAGE', 'STRING']")
    for p in problems:
        say("PROBLEM: " + p)
    return result(not problems, problems=problems)


def free(url: str) -> int:
    code, body = http("POST", url + "/free", {"unload_models": True})
    say(f"POST /free {{'unload_models': true}}: HTTP {code}")
    return result(code == 200, status=code)


def _messages(status) -> list:
    return list((status or {}).get("messages") or [])


def prompt(args) -> int:
    wf = workflow(args.image, args.worker, args.prefix)
    say("workflow: " + json.dumps(wf))
    code, body = http("POST", args.url + "/prompt", {"prompt": wf, "client_id": "poolipc-real-run"})
    try:
        resp = json.loads(body)
    except ValueError:
        resp = {"raw": body[:500].decode(errors="replace")}
    say(f"POST /prompt: HTTP {code}: {json.dumps(resp)[:2000]}")
    if code != 200 or "prompt_id" not in resp:
        return result(False, why="ComfyUI refused the prompt (validation)", http=code, response=resp)
    pid = resp["prompt_id"]
    deadline = time.monotonic() + args.timeout
    entry = None
    while time.monotonic() < deadline:
        c, b = http("GET", f"{args.url}/history/{pid}")
        if c == 200:
            doc = json.loads(b)
            if pid in doc:
                entry = doc[pid]
                break
        time.sleep(0.5)
    if entry is None:
        return result(False, why=f"prompt {pid} not in /history after {args.timeout:.0f} s", prompt_id=pid)
    status = entry.get("status") or {}
    outputs = entry.get("outputs") or {}
    say(f"/history/{pid}: status {status.get('status_str')!r}, completed {status.get('completed')}, outputs for nodes {sorted(outputs)}")
    errors = [m[1] for m in _messages(status) if isinstance(m, (list, tuple)) and m and m[0] == "execution_error"]
    for e in errors:
        say(f"execution_error in node {e.get('node_id')} ({e.get('node_type')}): {e.get('exception_type')}: {e.get('exception_message')}")
        tb = e.get("traceback")
        if tb:
            say("  traceback (last lines): " + "".join(tb[-6:]).replace("\n", "\n  "))

    if args.expect == "refused":
        msg = " ".join(str(e.get("exception_message")) for e in errors)
        ok = (
            status.get("status_str") == "error"
            and any(e.get("node_type") == START for e in errors)
            and "poolipc: refused" in msg
            and "POOLIPC_ENABLE=1" in msg
        )
        return result(ok, prompt_id=pid, status=status.get("status_str"), message=msg[:600],
                      why=None if ok else "expected the start node to refuse with the pack's 'not enabled' words")

    if status.get("status_str") != "success" or errors:
        return result(False, why="the prompt did not succeed", prompt_id=pid, status=status.get("status_str"),
                      errors=[f"{e.get('node_type')}: {e.get('exception_message')}" for e in errors])

    text = " ".join((outputs.get("3") or {}).get("text") or [])
    say(f"invert node's text: {text}")
    images = (outputs.get("4") or {}).get("images") or []
    if not images:
        return result(False, why="SaveImage reported no image", prompt_id=pid, text=text)
    im = images[0]
    path = os.path.join(args.comfy, "output", im.get("subfolder") or "", im["filename"])
    problems = []
    # The same file through the server's /view, as a browser would fetch it.
    q = urllib.parse.urlencode({"filename": im["filename"], "subfolder": im.get("subfolder") or "", "type": im.get("type") or "output"})
    vc, vb = http("GET", f"{args.url}/view?{q}", timeout=30)
    try:
        with open(path, "rb") as f:
            disk = f.read()
    except OSError as e:
        return result(False, why=f"cannot read the saved image {path}: {e}", prompt_id=pid)
    if vc != 200 or vb != disk:
        problems.append(f"/view gave HTTP {vc} and {'the same' if vb == disk else 'other'} bytes than {path}")

    import numpy as np
    from PIL import Image

    src, exp, plain = expected_inverse(os.path.join(args.comfy, "input", args.image))
    got = np.array(Image.open(path).convert("RGB"))
    if got.shape != exp.shape:
        problems.append(f"saved image is {got.shape}, input {src.shape}")
        wrong = None
    else:
        wrong = int((got != exp).sum())
        off_plain = int((exp != plain).sum())
        say(
            f"pixels: {wrong} of {exp.size} channel values differ from ComfyUI's float32 inverse "
            f"(0 = exact); that inverse itself differs from 255-v in {off_plain} values "
            "(SaveImage truncates 255*x; not poolipc's doing)"
        )
        if wrong:
            idx = np.argwhere(got != exp)[:5]
            for i in idx:
                i = tuple(int(v) for v in i)
                say(f"  at {i}: input {int(src[i])}, expected {int(exp[i])}, got {int(got[i])}")
            problems.append(f"{wrong} channel values are not the inverse")
        if np.array_equal(got, src):
            problems.append("the saved image equals the INPUT (nothing was inverted)")
    want = {"pool": "pool pointer", "staging": "host staging"}[args.expect]
    other = {"pool": "host staging", "staging": "pool pointer"}[args.expect]
    if want not in text:
        problems.append(f"the invert node's text does not name the rung {want!r}")
    if other in text:
        problems.append(f"the invert node's text names {other!r}, expected only {want!r}")
    for p in problems:
        say("PROBLEM: " + p)
    return result(not problems, prompt_id=pid, saved=path, mismatched_values=wrong, rung_text=text, problems=problems)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("image")
    s.add_argument("path")
    s.add_argument("--flip", action="store_true", help="the image turned by 180 degrees")
    s = sub.add_parser("wait")
    s.add_argument("--url", required=True)
    s.add_argument("--pid", type=int)
    s.add_argument("--timeout", type=float, default=180)
    s = sub.add_parser("object-info")
    s.add_argument("--url", required=True)
    s.add_argument("--worker", required=True)
    s = sub.add_parser("free")
    s.add_argument("--url", required=True)
    s = sub.add_parser("prompt")
    s.add_argument("--url", required=True)
    s.add_argument("--comfy", required=True, help="the ComfyUI folder (for input/ and output/)")
    s.add_argument("--image", required=True, help="a file name in ComfyUI's input/")
    s.add_argument("--worker", required=True)
    s.add_argument("--prefix", required=True)
    s.add_argument("--expect", choices=["pool", "staging", "refused"], required=True)
    s.add_argument("--timeout", type=float, default=120)
    s = sub.add_parser("workflow")
    s.add_argument("--image", default="poolipc_real.png")
    s.add_argument("--worker", default="example")
    s.add_argument("--prefix", default="poolipc_real")
    a = p.parse_args(argv)
    try:
        if a.cmd == "image":
            return make_image(a.path, a.flip)
        if a.cmd == "wait":
            return wait(a.url, a.pid, a.timeout)
        if a.cmd == "object-info":
            return object_info(a.url, a.worker)
        if a.cmd == "free":
            return free(a.url)
        if a.cmd == "prompt":
            return prompt(a)
        print(json.dumps(workflow(a.image, a.worker, a.prefix), indent=2))
        return 0
    except Exception as e:  # noqa: BLE001 - say what broke, as a result line
        import traceback

        traceback.print_exc()
        return result(False, why=f"drive.py {a.cmd} crashed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    sys.exit(main())
