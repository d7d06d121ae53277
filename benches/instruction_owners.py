#!/usr/bin/env python3
"""Instructions per message by owner, from two callgrind runs of one program.

Run the program under callgrind at two sizes, then give both profiles and
the difference in messages; each function's own (self) instructions are
counted, the small run's taken from the large run's, divided by the
difference, so start-up and shutdown cancel out:

    valgrind --tool=callgrind --callgrind-out-file=small.out PROGRAM ... --messages 100000
    valgrind --tool=callgrind --callgrind-out-file=large.out PROGRAM ... --messages 300000
    python3 benches/instruction_owners.py small.out large.out 200000

A function goes to the owner its name shows (the crate or library it
belongs to); code inlined into it is counted with it. That treats a
binary with line tables (the runner) and one without (the `limits`
anchors) alike. BENCHMARKS.md (issue 26, session 25) has the figures.
"""

import re
import subprocess
import sys

LINE = re.compile(r"\s*([\d,]+) \([ \d.]+%\)\s+(.*)$")


def self_counts(profile):
    """Self instructions by `file:function`, from callgrind_annotate."""
    out = subprocess.run(
        ["callgrind_annotate", "--auto=no", "--inclusive=no", "--threshold=100", profile],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    counts = {}
    for line in out.splitlines():
        m = LINE.match(line)
        if m and "PROGRAM TOTALS" not in line:
            key = m.group(2).strip()
            counts[key] = counts.get(key, 0) + int(m.group(1).replace(",", ""))
    return counts


def owner(key):
    """The owner of the function named in `file:function [object]`."""
    where, _, function = key.partition(":")
    function = function.split(" [")[0]
    if "libc.so" in key or where.startswith("./"):
        # glibc's own functions, by what they are.
        if "malloc" in key or "free" in function:
            return "the allocator"
        if re.search(r"mem(cpy|move|set|cmp)", function):
            return "memcpy, memset, memcmp"
        if "clock_gettime" in function:
            return "clock reads"
        return "the rest (std, core, libc, others)"
    checks = [
        ("from_utf8", "UTF-8 checks"),
        ("Timespec", "clock reads"),
        ("clock_gettime", "clock reads"),
        ("hashbrown", "hash tables"),
        ("BuildHasher", "hash tables"),
        ("Hasher", "hash tables"),
        ("foldhash", "hash tables"),
        ("cbor4ii", "CBOR of the messages"),
        ("ciborium", "CBOR of the messages"),
        ("serde", "CBOR of the messages"),
    ]
    for needle, name in checks:
        if needle in function:
            return name
    if "datum_cluster_sharding" in function and "wire::" in function:
        return "the library's header codec"
    if (
        re.match(r"<?limits", function)
        or "shard_bench" in function
        or "hdrhistogram" in function
        or "futures_util" in function
    ):
        return "the program's own code (driver, checks, entity)"
    if "datum_cluster_sharding" in function:
        return "the library's own code"
    if "ractor" in function:
        return "ractor"
    if "tokio::sync" in function:
        return "tokio's channels and wakers"
    if "tokio" in function:
        return "tokio's scheduler, timers and I/O"
    return "the rest (std, core, libc, others)"


def main():
    if len(sys.argv) != 4:
        sys.exit(f"usage: {sys.argv[0]} SMALL.out LARGE.out MESSAGES_BETWEEN")
    small, large = self_counts(sys.argv[1]), self_counts(sys.argv[2])
    messages = int(sys.argv[3])
    if messages <= 0:
        sys.exit("MESSAGES_BETWEEN must be positive")
    by_owner = {}
    for key in set(small) | set(large):
        per_message = (large.get(key, 0) - small.get(key, 0)) / messages
        by_owner[owner(key)] = by_owner.get(owner(key), 0) + per_message
    for name, count in sorted(by_owner.items(), key=lambda kv: -kv[1]):
        print(f"{count:8.0f}  {name}")
    print(f"{sum(by_owner.values()):8.0f}  total")


if __name__ == "__main__":
    main()
