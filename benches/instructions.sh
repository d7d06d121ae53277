#!/bin/sh
# Instructions (and, with --cache, simulated L1 data-cache misses) per
# message of a whole program, counted by valgrind's cachegrind: the program
# runs twice, with SMALL and LARGE messages, and the difference is divided
# by LARGE - SMALL, so start-up and shutdown cancel out.
#
# Unlike CPU time on a shared two-core guest, these counts repeat to within
# about 0.3 % from run to run, so a change of 1 % in the work a message
# costs can be seen. They are not time: cachegrind runs the threads one at
# a time on one simulated cache, counts no kernel instruction, and weighs an
# instruction that stalls on memory the same as one that does not.
# BENCHMARKS.md (issue 26, session 23) has the figures and what they mean.
#
#   benches/instructions.sh target/release/shard-bench w1-sat
#   benches/instructions.sh --cache target/release/shard-bench w1-sat
#   benches/instructions.sh "$LIMITS tcp-mux --concurrency 256"
#   benches/instructions.sh "$LIMITS ractor-ask --concurrency 256"
#
# The program and its arguments may come as one string: they are split at
# spaces (so no argument may hold one) and not globbed. `--messages N` is
# added. Only in-process runs count: cachegrind does not follow child
# processes (`shard-bench --mode multi-process` would count the parent).
# SMALL and LARGE (default 100000 and 300000) come from the environment.
set -euf

cache=no
if [ "${1:-}" = "--cache" ]; then
    cache=yes
    shift
fi
if [ $# -lt 1 ]; then
    echo "usage: $0 [--cache] PROGRAM [ARGS...]" >&2
    exit 2
fi
small=${SMALL:-100000}
large=${LARGE:-300000}
if [ "$large" -le "$small" ]; then
    echo "$0: LARGE ($large) must be more than SMALL ($small)" >&2
    exit 2
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT

# One run of N messages: prints "instructions d1_misses" (0 misses without
# --cache); a program that fails, or a summary that is missing, stops all.
count() {
    # shellcheck disable=SC2068 # the program and its arguments, split
    if ! valgrind --tool=cachegrind --cache-sim=$cache --cachegrind-out-file=/dev/null \
        $@ --messages "$n" >/dev/null 2>"$log"; then
        cat "$log" >&2
        echo "$0: the run of $n messages failed" >&2
        exit 1
    fi
    awk '
        /I *refs:/ { gsub(",", "", $4); ir = $4 }
        /D1  misses:/ { gsub(",", "", $4); d1 = $4 }
        END { if (ir == "") exit 1; print ir, (d1 == "" ? 0 : d1) }' "$log" || {
        echo "$0: no cachegrind summary in the run of $n messages" >&2
        exit 1
    }
}

n=$small
a=$(count $@)
n=$large
z=$(count $@)
PROG="$*" SMALL="$small" LARGE="$large" CACHE="$cache" awk -v a="$a" -v z="$z" 'BEGIN {
    split(a, x, " "); split(z, y, " ")
    span = ENVIRON["LARGE"] - ENVIRON["SMALL"]
    printf "%s: %.0f instructions per message", ENVIRON["PROG"], (y[1] - x[1]) / span
    if (ENVIRON["CACHE"] == "yes") printf ", %.1f L1 data misses per message", (y[2] - x[2]) / span
    printf " (%s and %s messages)\n", ENVIRON["SMALL"], ENVIRON["LARGE"]
}'
