#!/usr/bin/env python3
"""Reads the prefill GEMMs' event logs (`dsv4 bench moe --path prefill --defines FMW_TRACE=1 --trace DIR`,
src/bin/dsv4/moe_trace.rs; the events: kernels/fast_moe_wide.cu, FmwTraceKind) and prints, for the up and the
down GEMM, where an item's time goes on its block:

  start   the previous item's outputs stored (DONE) -> the consumers begin to wait for this item's record
          (START): their own work between items;
  data    START -> the record in with the item's first stage (DATA): waiting for the weights' stream;
  math    DATA -> the last pass's mainloop done (MATH);
  epi     MATH -> outputs stored (DONE);
  lead    the producer thread's start of the item (PRODUCE) ahead of START.

and the share of the blocks' busy time (first START to last DONE) spent in `start` and `data`, and how unevenly
the blocks end. A block's first item has no `start` (nothing before it on the block).

From the SM clock cycles consumer thread 0 logs with each item (WFULL, WMMA, CYCLES, kept apart from the times):
the share of its items' cycles (record in -> outputs stored) it spent waiting for full ring slots (the stream
behind the math) and for its wgmmas (the tensor core's queue: both warpgroups' blocks), and the median an item.

usage: scripts/fmw-trace.py FILE.json [FILE.json ...]   Times in µs. Standard library only."""
import json
import statistics
import sys

PRODUCE, START, DATA, MATH, DONE = 1, 2, 3, 4, 5
WFULL, WMMA, CYCLES = 6, 7, 8  # cycles (+ 1), not times
DOWN = 1 << 30


def stats(xs):
    if not xs:
        return "-"
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
    return f"n={len(xs)} med {statistics.median(xs):.2f} p90 {p90:.2f} max {xs[-1]:.2f} sum {sum(xs):.0f}"


def report_kernel(name, ev):
    """ev: [t_ns, block, sm, kind, arg] rows of one GEMM (up or down)."""
    cyc = [e for e in ev if e[3] >= WFULL]
    ev = [e for e in ev if e[3] < WFULL]
    items = {}  # item -> {kind: t}
    blocks = {}  # block -> [item, ...] in START order
    for t, b, _sm, kind, arg in ev:
        item = arg & (DOWN - 1)
        rec = items.setdefault(item, {"block": b})
        rec[kind] = t
        if kind == START:
            blocks.setdefault(b, []).append((t, item))
    if not items:
        return
    t0 = min(e[0] for e in ev)
    us = lambda ns: ns / 1e3
    parts = {"start": [], "data": [], "math": [], "epi": [], "lead": []}
    busy = 0.0
    ends = []
    for b, seq in blocks.items():
        seq.sort()
        prev_done = None
        first_start = None
        last_done = None
        for _, item in seq:
            r = items[item]
            if START not in r or DONE not in r:
                continue
            if first_start is None:
                first_start = r[START]
            if prev_done is not None:
                parts["start"].append(us(r[START] - prev_done))
            if DATA in r:
                parts["data"].append(us(r[DATA] - r[START]))
                if MATH in r:
                    parts["math"].append(us(r[MATH] - r[DATA]))
            if MATH in r:
                parts["epi"].append(us(r[DONE] - r[MATH]))
            if PRODUCE in r:
                parts["lead"].append(us(r[START] - r[PRODUCE]))
            prev_done = r[DONE]
            last_done = r[DONE]
        if first_start is not None and last_done is not None:
            busy += us(last_done - first_start)
            ends.append(us(last_done - t0))
    span = us(max(e[0] for e in ev) - t0)
    print(f"  {name}: {len(items)} items on {len(blocks)} blocks, span {span:.1f} µs")
    for k in ("start", "data", "math", "epi", "lead"):
        print(f"    {k:5s} {stats(parts[k])}")
    if busy > 0:
        print(f"    of the blocks' busy time ({busy:.0f} µs): start {100 * sum(parts['start']) / busy:.1f}%, "
              f"data {100 * sum(parts['data']) / busy:.1f}%")
    if ends:
        print(f"    blocks end at {min(ends):.1f} .. {max(ends):.1f} µs (median {statistics.median(ends):.1f})")
    report_cycles(cyc)


def report_cycles(cyc):
    """cyc: the WFULL / WMMA / CYCLES rows (their time field holds cycles + 1)."""
    per = {}  # (block, item) -> {kind: cycles}
    for c, b, _sm, kind, arg in cyc:
        per.setdefault((b, arg & (DOWN - 1)), {})[kind] = c - 1
    whole = [r for r in per.values() if len(r) == 3 and r[CYCLES] > 0]
    if not whole:
        return
    total = sum(r[CYCLES] for r in whole)
    full = sum(r[WFULL] for r in whole)
    mma = sum(r[WMMA] for r in whole)
    print(f"    thread 0's cycles ({len(whole)} items, median {statistics.median(r[CYCLES] for r in whole):.0f} an "
          f"item): full-slot waits {100 * full / total:.1f}%, wgmma waits {100 * mma / total:.1f}%, "
          f"the rest {100 * (total - full - mma) / total:.1f}%")


def report(path):
    d = json.load(open(path))
    ev = d["events"]
    lost = d["events_logged"] > len(ev)
    print(f"== {path}: B={d['B']} {d['routing']} {d['path']}: {len(ev)} events"
          + (f" (logged {d['events_logged']}, kept {len(ev)}: LOST SOME)" if lost else ""))
    report_kernel("up GEMM", [e for e in ev if not e[4] & DOWN])
    report_kernel("down GEMM", [e for e in ev if e[4] & DOWN])


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for p in sys.argv[1:]:
        report(p)
