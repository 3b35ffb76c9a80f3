#!/usr/bin/env python3
"""Where a round trip's time goes: merges the marks that `POOLIPC_PROBE=DIR` made processes
write (`DIR/probe-<pid>-<n>.txt`, `<ns> <label>` lines, one clock for all processes) into one
timeline, cuts it into round trips (`rt.begin` … `rt.synced`, marked by `poolipc bench`), and
prints, for the round trips [--skip, --skip + --count) that share the most common sequence of
marks, the median time of each step (the time from the mark before to this one).

    POOLIPC_PROBE=/tmp/p poolipc bench --max-mib 1 ...; python3 bench/probe_report.py /tmp/p
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import sys


def load(directory: pathlib.Path) -> list[tuple[int, str, int]]:
    marks = []
    for f in sorted(directory.glob("probe-*.txt")):
        # probe-<pid>.txt, or probe-<pid>-<n>.txt (one file per dump).
        pid = int(f.stem.split("-")[1])
        for line in f.read_text().splitlines():
            if not line or line.startswith("#"):
                continue
            t, label = line.split(" ", 1)
            marks.append((int(t), label, pid))
    marks.sort()
    return marks


def round_trips(marks: list[tuple[int, str, int]]) -> list[list[tuple[int, str, int]]]:
    trips, current = [], None
    for m in marks:
        if m[1] == "rt.begin":
            current = [m]
        elif current is not None:
            current.append(m)
            if m[1] == "rt.synced":
                trips.append(current)
                current = None
    return trips


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=pathlib.Path)
    ap.add_argument("--skip", type=int, default=1, help="round trips to skip first (default 1: the first, a fresh allocation)")
    ap.add_argument("--count", type=int, default=400, help="round trips to take (default 400: bench's 4 KiB recycled row)")
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    marks = load(a.dir)
    if not marks:
        print(f"no marks under {a.dir}", file=sys.stderr)
        return 1
    trips = round_trips(marks)[a.skip : a.skip + a.count]
    if not trips:
        print("no round trips (rt.begin … rt.synced) in the marks", file=sys.stderr)
        return 1
    sigs = collections.Counter(tuple(label for _, label, _ in t) for t in trips)
    sig, n = sigs.most_common(1)[0]
    chosen = [t for t in trips if tuple(label for _, label, _ in t) == sig]
    parent_pid = chosen[0][0][2]
    print(f"{a.title or a.dir}: {n} of {len(trips)} round trips share the most common sequence ({len(sigs)} sequences)")
    print(f"  {'step (time since the mark before)':40} {'who':7} {'median µs':>10} {'p90 µs':>9}")
    for i in range(1, len(sig)):
        d = sorted((t[i][0] - t[i - 1][0]) / 1000 for t in chosen)
        who = "parent" if chosen[0][i][2] == parent_pid else "worker"
        print(f"  {sig[i - 1] + ' → ' + sig[i]:40} {who:7} {statistics.median(d):10.2f} {d[int(len(d) * 0.9) - 1 if len(d) > 1 else 0]:9.2f}")
    tot = sorted((t[-1][0] - t[0][0]) / 1000 for t in chosen)
    print(f"  {'total':40} {'':7} {statistics.median(tot):10.2f} {tot[int(len(tot) * 0.9) - 1 if len(tot) > 1 else 0]:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
