#!/usr/bin/env python3
"""Splits a call-graph profile of the runner by stage of a message's path,
or any profile by the owner of the code each sample was in.

Input: `perf script --no-inline -F comm,tid,ip,sym` of a `perf record -g`
(or `--call-graph dwarf`) of `shard-bench w1` / `w1-sat`. Each sample goes
to the first stage (in the order of STAGES) one of whose frames is on its
stack. With `--owners`, each sample goes instead to the owner of its leaf
frame: the kernel when its address is a kernel one, else the first of
OWNERS one of whose marks is in the symbol (anywhere in it, so a generic
type parameter can match too: the marks are chosen to be rare there);
the rest is the program's own code, and the runner's part of it (its
driver, its checks and its entity's handler: `is_runner`) is printed too. This works for the
anchors' profiles as well (`limits tcp-mux`, `limits ractor-ask`). The number
argument, if given, is the run's CPU µs per message, to turn shares into
µs. BENCHMARKS.md (issue 26) has the commands and the results.

    perf record -F 1999 --call-graph dwarf,32768 -o w.data \
        target/release/shard-bench w1-sat --messages 1000000
    perf script -i w.data --no-inline -F comm,tid,ip,sym \
        | python3 benches/perf_stages.py 4.7
    perf script -i w.data --no-inline -F comm,tid,ip,sym \
        | python3 benches/perf_stages.py --owners 4.7
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

ALLOCATOR = "allocator (glibc malloc and free)"
# Owners of a leaf frame, by a piece of its symbol; the first match wins.
OWNERS = [
    ("CBOR: ciborium, cbor4ii, the header codec (and std's UTF-8 check)",
     ["ciborium", "cbor4ii::", "wire::cbor", "fast::encode", "fast::decode", "fast::octets", "from_utf8",
      "SealedProtocol>::decode"]),
    ("lookups: hashing, string compares, maps", ["sip::Hasher", "hash_one", "hashbrown", "memcmp",
                                                 "HashMap"]),
    (ALLOCATOR, ["malloc", "_int_free", "cfree", "libc_free", "realloc",
                                           "unlink_chunk", "calloc", "memalign"]),
    ("ractor", ["ractor::"]),
    ("tokio sync: oneshot, mpsc, notify, wakers", ["tokio::sync", "tokio::runtime::task::waker",
                                                   "wake_by_val", "clone_waker", "drop_waker"]),
    ("tokio: scheduler, timers", ["tokio::"]),
    ("clock reads", ["clock_gettime", "Timespec"]),
    ("futures-util (the runner's FuturesUnordered)", ["futures_util"]),
    ("memcpy, memset", ["memmove", "memcpy", "memset"]),
]
# glibc's free, under the names perf may give its address.
FREE = {"free", "__free", "__libc_free"}
KERNEL = "kernel (syscalls, futex, scheduler)"
OWN = "the rest: the program's own code, std, inlined"
RUNNER = "  of which the runner's: driver, checks, handler"


def stage_of(stack):
    for stage, marks in STAGES:
        if any(mark in frame for frame in stack for mark in marks):
            return stage
    return OTHER


def owner_of(stack):
    address, _, symbol = stack[0].partition(" ")
    if address.startswith("ffffffff"):
        return KERNEL
    if symbol.split("@")[0] in FREE:
        return ALLOCATOR
    for owner, marks in OWNERS:
        if any(mark in symbol for mark in marks):
            return owner
    return RUNNER if is_runner(symbol) else OWN


def is_runner(symbol):
    """The runner's own functions, and its entity's handlers (the code a
    user writes; the protocol's dispatch, which the library's macro
    generates, is not counted)."""
    return symbol.startswith("shard_bench::") or (
        symbol.startswith("<shard_bench::") and "::entity::Handler<" in symbol
    )


def main():
    args = sys.argv[1:]
    by_owner = "--owners" in args
    args = [a for a in args if a != "--owners"]
    classify = owner_of if by_owner else stage_of
    names = [o for o, _ in OWNERS] + [KERNEL, OWN, RUNNER] if by_owner else [s for s, _ in STAGES] + [OTHER]
    counts = collections.Counter()
    stack = []
    for line in sys.stdin:
        if line.startswith((" ", "\t")) and line.strip():
            stack.append(line.strip())
            continue
        if stack:
            counts[classify(stack)] += 1
        stack = []
    if stack:
        counts[classify(stack)] += 1
    total = sum(counts.values()) or 1
    if by_owner:
        counts[OWN] += counts[RUNNER]  # the runner's line is a part of the own code's
    per_msg = float(args[0]) if args else None
    for stage in names:
        share = counts[stage] / total
        line = f"{stage:52s} {100 * share:5.1f} %"
        if per_msg is not None:
            line += f"  {per_msg * share:5.2f} µs"
        print(line)
    print("samples", total)


if __name__ == "__main__":
    main()
