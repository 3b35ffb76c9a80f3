#!/usr/bin/env python3
"""This tree's `poolipc bench` against a baseline revision's, over alternated pairs of runs.

Each pair is two JSON files written by `poolipc bench --json-out` in one call, this tree's run
and the baseline's run one after the other (run.sh's `regress` part alternates them). For every
row both revisions report, the table gives the medians over the pairs, their ratio
(this tree / baseline), and the spread of the per-pair ratios (min-max). A row is a
REGRESSION when every pair's ratio is above the threshold (1.05), "within the spread" when
the pairs straddle it, and ok when none is above it. Lower is better in every row (times).

    python3 bench/regress.py --pair MAIN.json BASE.json [--pair MAIN.json BASE.json ...]
    python3 bench/regress.py --self-test

Exit status: 0 when no row is a regression, 2 when one is, 1 on unreadable input.
Standard library only: the GPU machine has no package index.
"""

import argparse
import json
import math
import statistics
import sys

THRESHOLD = 1.05


def size(b):
    """4096 -> '4 KiB', as the bench's tables write sizes."""
    for unit, n in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= n and b % n == 0:
            return f"{b // n} {unit}"
    return f"{b} B"


def number(v):
    """A finite float, or None (serde_json writes NaN as null)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) and v > 0 else None


def rows(doc):
    """{(row, size): µs} for every median the report holds.

    Reads the keys `crates/poolipc-cli/src/bench/report.rs` `json()` writes, the same at 57719ac
    (`crates/poolipc-cli/src/bench.rs` there) save `isolation_cost`, which it lacks. A `--mps` run
    nests the plain report under "plain"; that one is compared.
    """
    if "plain" in doc and isinstance(doc["plain"], dict):
        doc = doc["plain"]
    out = {}

    def put(name, b, v):
        v = number(v)
        if v is not None and isinstance(b, int):
            out[(name, size(b))] = v

    for r in doc.get("round_trip") or []:
        put("round trip, recycled", r.get("bytes"), r.get("recycled_median_us"))
        put("round trip, re-lend", r.get("bytes"), r.get("relend_median_us"))
    for r in doc.get("above_limit_inputs") or []:
        put("arena copy, read-only", r.get("bytes"), r.get("median_us"))
        put("arena copy, copy-back", r.get("bytes"), r.get("copy_back_median_us"))
    # device_memory's pool_pointer_relend_median_us is the round trip's re-lend again: left out.
    for r in doc.get("device_memory") or []:
        put("device memory, cuMemAlloc", r.get("bytes"), r.get("cu_mem_alloc_median_us"))
        put("device memory, VMM again", r.get("bytes"), r.get("vmm_handle_median_us"))
    for r in doc.get("arena_results") or []:
        put("arena result", r.get("bytes"), r.get("median_us"))
    for r in doc.get("arena_results_late_with_slice") or []:
        put("arena result, slice", r.get("bytes"), r.get("median_us"))
    for r in doc.get("isolation_cost") or []:
        put("isolation, writable", r.get("bytes"), r.get("isolated_writable_median_us"))
        put("isolation, read-only", r.get("bytes"), r.get("isolated_read_only_median_us"))
    batch = doc.get("batch") or {}
    s = number(batch.get("median_s"))
    if s is not None and isinstance(batch.get("tensors"), int):
        out[(f"batch, {batch['tensors']} tensors", size(batch.get("tensor_bytes") or 4096))] = s * 1e6
    return out


def verdict(ratios):
    if min(ratios) > THRESHOLD:
        return "REGRESSION"
    if max(ratios) > THRESHOLD:
        return "within the spread"
    return "ok"


def compare(pairs):
    """pairs: [(main rows, baseline rows)]. Returns (table rows, rows only one side has)."""
    keys = [k for k in pairs[0][0] if all(k in m and k in b for m, b in pairs)]
    table = []
    for k in keys:
        mains = [m[k] for m, _ in pairs]
        bases = [b[k] for _, b in pairs]
        ratios = [m / b for m, b in zip(mains, bases)]
        main_med = statistics.median(mains)
        base_med = statistics.median(bases)
        table.append((k, main_med, base_med, main_med / base_med, min(ratios), max(ratios), verdict(ratios)))
    every = set()
    for m, b in pairs:
        every |= set(m) | set(b)
    lone = sorted(every - set(keys))
    return table, lone


def render(table, lone, n_pairs, labels):
    main, base = labels
    lines = [
        f"regress: {main} / {base}, medians over {n_pairs} alternated pair(s); "
        f"REGRESSION: every pair > {THRESHOLD}x; within the spread: pairs straddle {THRESHOLD}x",
        f"  {'row':<28} {'size':>8} {main + ' µs':>14} {base + ' µs':>14} {'ratio':>7} {'spread':>13}  verdict",
    ]
    for (name, sz), m, b, r, lo, hi, v in table:
        spread = f"{lo:.2f}-{hi:.2f}x"
        lines.append(f"  {name:<28} {sz:>8} {m:>14.1f} {b:>14.1f} {r:>6.2f}x {spread:>13}  {v}")
    if lone:
        lines.append("  only one side (or not every pair) reports: " + ", ".join(f"{n} {s}" for n, s in lone))
    counts = {v: sum(1 for t in table if t[6] == v) for v in ("ok", "within the spread", "REGRESSION")}
    lines.append(
        f"  {len(table)} rows: {counts['ok']} ok, {counts['within the spread']} within the spread, "
        f"{counts['REGRESSION']} REGRESSION"
    )
    return "\n".join(lines)


def load(path):
    with open(path, encoding="utf-8") as f:
        return rows(json.load(f))


def synthetic(scale, batch_s):
    """A report as the bench writes it, every median times `scale`."""
    return {
        "driver": "sim",
        "round_trip": [
            {"bytes": 4096, "recycled_median_us": 10.0 * scale, "relend_median_us": 9.0 * scale},
            {"bytes": 1 << 20, "recycled_median_us": 12.0 * scale, "relend_median_us": None},
        ],
        "above_limit_inputs": [{"bytes": 4096, "median_us": 20.0, "copy_back_median_us": 40.0}],
        "device_memory": [],
        "arena_results": [{"bytes": 4096, "median_us": 30.0 * scale, "rung": "arena"}],
        "batch": {"tensors": 8, "tensor_bytes": 4096, "median_s": batch_s},
    }


def self_test():
    # Three pairs: the round trips 1.10x slower in every pair (a regression), the arena copy
    # equal (ok), the batch 1.10x in one pair and 0.95x in two (within the spread), the
    # re-lend at 1 MiB null on both sides (left out), the arena result only in main's pairs.
    pairs = []
    for batch in (1.10, 0.95, 0.95):
        main = synthetic(1.10, batch * 1e-3)
        base = synthetic(1.0, 1e-3)
        del base["arena_results"]
        pairs.append((rows(main), rows(base)))
    table, lone = compare(pairs)
    got = {k: v for k, _, _, _, _, _, v in table}
    want = {
        ("round trip, recycled", "4 KiB"): "REGRESSION",
        ("round trip, re-lend", "4 KiB"): "REGRESSION",
        ("round trip, recycled", "1 MiB"): "REGRESSION",
        ("arena copy, read-only", "4 KiB"): "ok",
        ("arena copy, copy-back", "4 KiB"): "ok",
        ("batch, 8 tensors", "4 KiB"): "within the spread",
    }
    assert got == want, got
    assert lone == [("arena result", "4 KiB")], lone
    batch = next(t for t in table if t[0][0].startswith("batch"))
    assert math.isclose(batch[3], 0.95) and math.isclose(batch[4], 0.95) and math.isclose(batch[5], 1.10), batch
    # A --mps report nests the plain one.
    assert rows({"plain": synthetic(1.0, 1e-3), "mps": {}}) == pairs[0][1] | {("arena result", "4 KiB"): 30.0}
    text = render(table, lone, len(pairs), ("main", "base"))
    assert "3 REGRESSION" in text and "1 within the spread" in text, text
    print("regress.py self-test: ok")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", nargs=2, action="append", metavar=("MAIN", "BASE"), default=[],
                   help="one pair: this tree's JSON and the baseline's, from the same call")
    p.add_argument("--labels", nargs=2, default=("main", "baseline"), metavar=("MAIN", "BASE"))
    p.add_argument("--self-test", action="store_true", help="check the comparison on synthetic reports")
    a = p.parse_args()
    if a.self_test:
        self_test()
        return 0
    if not a.pair:
        p.error("no --pair given")
    try:
        pairs = [(load(m), load(b)) for m, b in a.pair]
    except (OSError, ValueError) as e:
        print(f"regress.py: {e}", file=sys.stderr)
        return 1
    table, lone = compare(pairs)
    if not table:
        print("regress.py: the two sides report no row in common", file=sys.stderr)
        return 1
    print(render(table, lone, len(pairs), tuple(a.labels)))
    return 2 if any(t[6] == "REGRESSION" for t in table) else 0


if __name__ == "__main__":
    sys.exit(main())
