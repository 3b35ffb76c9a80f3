#!/usr/bin/env python3
"""Where a round trip's time goes: merges the marks that `POOLIPC_PROBE=DIR` made processes
write (`DIR/probe-<pid>-<n>.txt`, `<ns> <label> <tid>` lines, one clock for all processes) into
one timeline, cuts it into round trips (`rt.begin` … `rt.synced`, marked by `poolipc bench`),
and prints, for the round trips [--skip, --skip + --count) that share the most common sequence
of marks, the median time of each step (the time from the mark before to this one).

With `--threads` (several workers at once, where the timeline interleaves many round trips) it
prints where each thread's time goes instead: for every thread, its steps (one mark to the
next on that thread) by total time, with their count and median, and for an IO thread its
busy share (its time outside `io.wait` → `io.woke`, the loop's waiting) and work per job.

    POOLIPC_PROBE=/tmp/p poolipc bench --max-mib 1 ...; python3 bench/probe_report.py /tmp/p
    POOLIPC_PROBE=/tmp/q poolipc bench --workers 4; python3 bench/probe_report.py /tmp/q --threads
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import sys


# The IO loop's marks around its waiting, one pair per loop turn.
WAIT_MARKS = ("io.wait", "io.woke")


def load_threads(directory: pathlib.Path) -> list[tuple[int, str, int, int]]:
    """Every mark as (ns, label, pid, tid), by time; tid 0 where a file has none (older
    probes wrote `<ns> <label>`)."""
    marks = []
    for f in sorted(directory.glob("probe-*.txt")):
        # probe-<pid>.txt, or probe-<pid>-<n>.txt (one file per dump).
        pid = int(f.stem.split("-")[1])
        for line in f.read_text().splitlines():
            if not line or line.startswith("#"):
                continue
            fields = line.split(" ")
            tid = int(fields[2]) if len(fields) > 2 else 0
            marks.append((int(fields[0]), fields[1], pid, tid))
    marks.sort()
    return marks


def load(directory: pathlib.Path) -> list[tuple[int, str, int]]:
    return [(t, label, pid) for t, label, pid, _ in load_threads(directory)]


def role(labels: collections.Counter) -> str:
    """A thread's part, read from its marks' prefixes."""
    prefixes = collections.Counter()
    for label, n in labels.items():
        prefixes[label.split(".", 1)[0]] += n
    names = {"io": "IO thread", "w": "worker", "c": "caller", "py": "Python", "rt": "bench", "user": "user code",
             "alloc": "allocator"}
    return "+".join(names.get(p, p) for p, _ in prefixes.most_common(2))


def pct(d: list[float], q: float) -> float:
    """The `q` quantile of the sorted `d` (its element at int(len * q) - 1, the first at least)."""
    return d[min(len(d) - 1, max(0, int(len(d) * q) - 1))]


def threads_report(marks: list[tuple[int, str, int, int]], top: int, title: str, only: str | None = None) -> int:
    by_thread: dict[tuple[int, int], list[tuple[int, str]]] = collections.defaultdict(list)
    for t, label, pid, tid in marks:
        by_thread[(pid, tid)].append((t, label))
    print(f"{title}: {len(marks)} marks on {len(by_thread)} threads of {len({p for p, _ in by_thread})} processes")
    # The busiest threads first (the most marks).
    for (pid, tid), ms in sorted(by_thread.items(), key=lambda kv: -len(kv[1])):
        if len(ms) < 4:
            continue
        labels = collections.Counter(label for _, label in ms)
        if only and not any(label.startswith(only + ".") for label in labels):
            continue
        steps: dict[str, list[float]] = collections.defaultdict(list)
        for (t0, a), (t1, b) in zip(ms, ms[1:]):
            steps[f"{a} → {b}"].append((t1 - t0) / 1000)
        span = (ms[-1][0] - ms[0][0]) / 1000
        line = f"  pid {pid} tid {tid} ({role(labels)}): {len(ms)} marks over {span / 1000:.1f} ms"
        if labels.get("io.wait"):
            waited = sum(steps.get("io.wait → io.woke", []))
            jobs = labels.get("io.cmd", 0)
            line += f", busy {100 * (span - waited) / span if span else 0:.0f}%"
            if jobs:
                line += f", {(span - waited) / jobs:.2f} µs of work per submit ({jobs} submits)"
        print(line)
        print(f"    {'step (on this thread)':44} {'count':>7} {'median µs':>10} {'p90 µs':>9} {'total ms':>9} {'share':>6}")
        ranked = sorted(steps.items(), key=lambda kv: -sum(kv[1]))
        for name, d in ranked[:top]:
            d.sort()
            total = sum(d)
            print(f"    {name:44} {len(d):7} {statistics.median(d):10.2f} {pct(d, 0.9):9.2f} {total / 1000:9.2f} {100 * total / span if span else 0:5.1f}%")
    return 0


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
    ap.add_argument("--threads", action="store_true", help="where each thread's time goes, for several workers at once")
    ap.add_argument("--top", type=int, default=8, help="with --threads: steps shown per thread (default 8)")
    ap.add_argument("--keep-waits", action="store_true", help="keep the IO loop's io.wait / io.woke marks in the round trips (left out by default)")
    ap.add_argument("--only", metavar="PREFIX", help="with --threads: only threads with marks of this prefix (io, w, c, py)")
    a = ap.parse_args()
    if a.threads:
        marks = load_threads(a.dir)
        if not marks:
            print(f"no marks under {a.dir}", file=sys.stderr)
            return 1
        return threads_report(marks, a.top, a.title or str(a.dir), a.only)
    marks = load(a.dir)
    if not marks:
        print(f"no marks under {a.dir}", file=sys.stderr)
        return 1
    if not a.keep_waits:
        # The IO loop's turns (how many it takes varies from one round trip to the next)
        # would split the round trips into many sequences.
        marks = [m for m in marks if m[1] not in WAIT_MARKS]
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
        print(f"  {sig[i - 1] + ' → ' + sig[i]:40} {who:7} {statistics.median(d):10.2f} {pct(d, 0.9):9.2f}")
    tot = sorted((t[-1][0] - t[0][0]) / 1000 for t in chosen)
    print(f"  {'total':40} {'':7} {statistics.median(tot):10.2f} {pct(tot, 0.9):9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
