#!/usr/bin/env python3
"""Reads the fused decode kernels' event logs (`dsv4 bench moe --defines FMOE_TRACE=1 --trace DIR`,
src/bin/dsv4/moe_trace.rs; the events: kernels/fast_moe_gemm.cu, FmoeTraceKind) and prints where a
launch's time went: the router jobs and the plan, each kind of item's wait and duration, how many
blocks stream at each moment, and the chain of items that ends last.

usage: scripts/fmoe-trace.py FILE.json [FILE.json ...] [--blocks]   (--blocks: every block's timeline)
Times are µs from the launch's first event. Standard library only."""
import json
import statistics
import sys

START, TAKE, WAIT, WAITED, PLAN_WAIT, PLAN_WAITED, ISSUED, BEGIN, END, JOB, JOB_QUANT, JOB_LOGITS, PLAN, \
    PUBLISH, DONE, SELECTED, PLANNED, FULL_WAITS, EMPTY_WAITS = range(1, 20)
SHARED, DOWN = 1 << 29, 1 << 30


def item_name(arg):
    if arg < 0:
        return f"job{-2 - arg}"
    kind = "down" if arg & DOWN else "up"
    return f"{kind}{'-sh' if arg & SHARED else ''}#{arg & (SHARED - 1)}"


def item_kind(arg):
    if arg < 0:
        return "router job"
    return ("down" if arg & DOWN else "up") + (" shared" if arg & SHARED else " routed")


def stats(xs):
    if not xs:
        return "-"
    xs = sorted(xs)
    return f"n={len(xs)} min {xs[0]:.1f} med {statistics.median(xs):.1f} max {xs[-1]:.1f}"


def report(path, show_blocks):
    d = json.load(open(path))
    ev = d["events"]
    print(f"== {path}: B={d['B']} {d['routing']} {d['path']}: {len(ev)} events"
          + (f" (logged {d['events_logged']}, kept {len(d['events'])}: LOST SOME)"
             if d["events_logged"] > len(d["events"]) else ""))
    if not ev:
        return
    t0 = ev[0][0]
    ts = sorted({e[0] for e in ev})
    steps = [b - a for a, b in zip(ts, ts[1:]) if b > a]
    print(f"  span {(ev[-1][0] - t0) / 1e3:.1f} µs; timer step (smallest gap seen) {min(steps) if steps else 0} ns")
    us = lambda t: (t - t0) / 1e3
    blocks = {}
    for t, b, sm, kind, arg in ev:
        blocks.setdefault(b, []).append((t, kind, arg, sm))

    # Per item: take, wait, waited, issued (producer) and begin, end (consumers), by (block, item).
    items = {}
    for b, es in blocks.items():
        for t, kind, arg, _ in es:
            if kind in (TAKE, WAIT, WAITED, ISSUED, BEGIN, END):
                items.setdefault((b, arg), {})[kind] = t
    by_kind = {}
    for (b, arg), it in items.items():
        by_kind.setdefault(item_kind(arg), []).append((b, arg, it))

    # The SM clock (START and DONE carry its low 32 bits): cycles per ns, to read the waits' cycle counts.
    rates = []
    for b, es in blocks.items():
        st = [(t, a) for t, k, a, _ in es if k == START]
        dn = [(t, a) for t, k, a, _ in es if k == DONE]
        if st and dn and dn[0][0] > st[0][0]:
            rates.append(((dn[0][1] - st[0][1]) % (1 << 32)) / (dn[0][0] - st[0][0]))
    ghz = statistics.median(rates) if rates else 0.0
    # Each item's waits (cycles): the consumers' for its stages after the first (FULL_WAITS follows the item's
    # BEGIN on its block), the producer's for free slots (EMPTY_WAITS follows its ISSUED).
    data_wait, slot_wait = {}, {}
    for b, es in blocks.items():
        begun = issued = None
        for t, kind, arg, _ in es:
            if kind == BEGIN:
                begun = arg
            elif kind == ISSUED:
                issued = arg
            elif kind == FULL_WAITS and begun is not None:
                data_wait[(b, begun)] = arg
            elif kind == EMPTY_WAITS and issued is not None:
                slot_wait[(b, issued)] = arg
    if ghz:
        print(f"  SM clock {ghz:.3f} GHz (START/DONE cycle counts over their times)")

    # The router.
    jobs = [(b, t, kind, arg) for b, es in blocks.items() for t, kind, arg, _ in es
            if kind in (JOB, JOB_QUANT, JOB_LOGITS, SELECTED, PLANNED, PLAN)]
    if jobs:
        starts = [us(t) for _, t, k, _ in jobs if k == JOB]
        quant = [us(t) for _, t, k, _ in jobs if k == JOB_QUANT]
        logits = [us(t) for _, t, k, _ in jobs if k == JOB_LOGITS]
        at = lambda kind: next((f"{us(t):.1f}" for _, t, k, _ in jobs if k == kind), "-")
        print(f"  router: {len(starts)} jobs start {stats(starts)}; x's codes stored {stats(quant)}; "
              f"logits stored {stats(logits)}; the last job's selection stored at {at(SELECTED)}, plan stored at "
              f"{at(PLANNED)}, published at {at(PLAN)}")
    pw = [(us(t), b) for b, es in blocks.items() for t, kind, arg, _ in es if kind == PLAN_WAITED]
    pws = [us(t) for b, es in blocks.items() for t, kind, arg, _ in es if kind == PLAN_WAIT]
    if pw:
        print(f"  producers waiting for the plan: {len(pw)}, from {stats(pws)}, released {stats([x for x, _ in pw])}")
    starts = [us(t) for b, es in blocks.items() for t, kind, arg, _ in es if kind == START]
    dones = [us(t) for b, es in blocks.items() for t, kind, arg, _ in es if kind == DONE]
    print(f"  blocks: {len(blocks)}; first act {stats(starts)}; end posted {stats(dones)}")

    for kind in sorted(by_kind):
        its = by_kind[kind]
        if kind == "router job":
            continue
        take = [us(it[TAKE]) for _, _, it in its if TAKE in it]
        first = [(it[BEGIN] - it[TAKE]) / 1e3 for _, _, it in its if BEGIN in it and TAKE in it]
        dur = [(it[END] - it[BEGIN]) / 1e3 for _, _, it in its if BEGIN in it and END in it]
        waits = [(it[WAITED] - it[WAIT]) / 1e3 for _, _, it in its if WAIT in it and WAITED in it]
        ends = [us(it[END]) for _, _, it in its if END in it]
        print(f"  {kind}: taken {stats(take)}")
        print(f"      take -> first stage in {stats(first)}; first stage -> stored {stats(dur)}")
        if waits:
            print(f"      waited for inputs ({len(waits)} of {len(its)}): {stats(waits)}")
        if ghz:
            dw = [data_wait[(b, arg)] / ghz / 1e3 for b, arg, it in its if (b, arg) in data_wait]
            frac = [100 * data_wait[(b, arg)] / ghz / (it[END] - it[BEGIN]) for b, arg, it in its
                    if (b, arg) in data_wait and BEGIN in it and END in it and it[END] > it[BEGIN]]
            sw = [slot_wait[(b, arg)] / ghz / 1e3 for b, arg, _ in its if (b, arg) in slot_wait]
            if dw:
                print(f"      consumers waited for stages (after the first) {stats(dw)} µs, "
                      f"% of first stage -> stored {stats(frac)}")
            if sw:
                print(f"      producer waited for free slots {stats(sw)} µs")
        print(f"      stored {stats(ends)}")

    # Streaming blocks over time: an item counts from its first stage in to its outputs stored.
    spans = [(us(it[BEGIN]), us(it[END])) for (_, _), it in items.items() if BEGIN in it and END in it]
    if spans:
        end = max(e for _, e in spans)
        line = []
        for x in range(0, int(end) + 1, 2):
            line.append(str(sum(1 for a, b in spans if a <= x < b)))
        print("  blocks computing an item, every 2 µs: " + " ".join(line))

    # The chain that ends last: the last item stored; for a down item, the tile it waited for and the up
    # item of that tile stored last.
    ends = [(it[END], b, arg) for (b, arg), it in items.items() if END in it]
    if ends:
        t, b, arg = max(ends)
        print(f"  last stored: {item_name(arg)} on block {b} at {us(t):.1f} (began {us(items[(b, arg)].get(BEGIN, t)):.1f}, "
              f"taken {us(items[(b, arg)].get(TAKE, t)):.1f})")
        pubs = {}
        for bb, es in blocks.items():
            for tt, kind, a2, _ in es:
                if kind == PUBLISH:
                    pubs.setdefault(a2, []).append((tt, bb))
        if pubs:
            last = sorted((max(v)[0], tile) for tile, v in pubs.items())
            print("  each tile's last up item counted in (µs): "
                  + ", ".join(f"t{tile} {us(tt):.1f}" for tt, tile in last))

    if show_blocks:
        names = {TAKE: "take", WAIT: "wait", WAITED: "in", PLAN_WAIT: "planwait", PLAN_WAITED: "plan",
                 ISSUED: "issued", BEGIN: "begin", END: "end", JOB: "job", JOB_QUANT: "xq", JOB_LOGITS: "logits",
                 PLAN: "PLAN", PUBLISH: "pub", START: "start", DONE: "done", SELECTED: "selected",
                 PLANNED: "planned", FULL_WAITS: "data-wait-cycles", EMPTY_WAITS: "slot-wait-cycles"}
        for b in sorted(blocks):
            es = blocks[b]
            parts = []
            for t, kind, arg, sm in es:
                what = names.get(kind, str(kind))
                if kind in (TAKE, WAIT, WAITED, ISSUED, BEGIN, END):
                    what += " " + item_name(arg)
                elif kind == PUBLISH:
                    what += f" t{arg}"
                elif kind in (FULL_WAITS, EMPTY_WAITS, START, DONE):
                    what += f" {arg}"
                parts.append(f"{us(t):.1f} {what}")
            print(f"  block {b} (SM {es[0][3]}): " + "; ".join(parts))


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if not args:
        print(__doc__)
        sys.exit(2)
    for p in args:
        report(p, "--blocks" in sys.argv)


if __name__ == "__main__":
    main()
