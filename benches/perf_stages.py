#!/usr/bin/env python3
"""Splits a call-graph profile of the runner by stage of a message's path.

Input: `perf script --no-inline -F comm,tid,ip,sym` of a `perf record -g`
(or `--call-graph dwarf`) of `shard-bench w1` / `w1-sat`. Each sample goes
to the first stage (in the order of STAGES) one of whose frames is on its
stack; the argument, if given, is the run's CPU µs per message, to turn
shares into µs. BENCHMARKS.md (issue 26) has the commands and the results.

    perf record -F 1999 --call-graph dwarf,32768 -o w.data \
        target/release/shard-bench w1-sat --messages 1000000
    perf script -i w.data --no-inline -F comm,tid,ip,sym \
        | python3 benches/perf_stages.py 4.7
"""

import collections
import sys

STAGES = [
    ("inbound envelope: decode, route, mailbox send", ["sharding::driver::deliver_envelope"]),
    ("inbound reply: pending table, decode, oneshot send", ["sharding::remote::Remote::complete"]),
    ("reader: read syscalls, frame parsing", ["transport::reader::read_loop"]),
    ("writer: write syscalls", ["transport::writer::write_loop"]),
    ("ask: remote send (encode, pending table, pipe)", ["sharding::remote::Remote::forward"]),
    ("ask: local mailbox send", ["LocalShard<E>::deliver"]),
    ("ask: the rest (envelope, oneshot, await)", ["EntityRef<P>::ask"]),
    ("runner's driver (FuturesUnordered, histogram)", ["shard_bench::harness::drive"]),
    ("entity: reply encode and send", ["ReplyTo<R>::answer", "RemoteReply::send"]),
    ("entity: dispatch and handler", ["Dispatch<E>>::dispatch"]),
    ("entity: ractor's loop, mailbox, select", ["ractor::actor::ActorRuntime"]),
    ("tokio: scheduler, park, timers", ["tokio::runtime"]),
]
OTHER = "other (kernel, threads outside tokio)"


def stage_of(stack):
    for stage, marks in STAGES:
        if any(mark in frame for frame in stack for mark in marks):
            return stage
    return OTHER


def main():
    counts = collections.Counter()
    stack = []
    for line in sys.stdin:
        if line.startswith((" ", "\t")) and line.strip():
            stack.append(line.strip())
            continue
        if stack:
            counts[stage_of(stack)] += 1
        stack = []
    if stack:
        counts[stage_of(stack)] += 1
    total = sum(counts.values()) or 1
    per_msg = float(sys.argv[1]) if len(sys.argv) > 1 else None
    for stage in [s for s, _ in STAGES] + [OTHER]:
        share = counts[stage] / total
        line = f"{stage:52s} {100 * share:5.1f} %"
        if per_msg is not None:
            line += f"  {per_msg * share:5.2f} µs"
        print(line)
    print("samples", total)


if __name__ == "__main__":
    main()
