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
# SMALL and LARGE (default 100000 and 300000) come from the environment.
set -eu

cache=no
if [ "${1:-}" = "--cache" ]; then
    cache=yes
    shift
fi
if [ $# -lt 1 ]; then
    echo "usage: $0 [--cache] PROGRAM [ARGS...]   (run with --messages N added)" >&2
    exit 2
fi
small=${SMALL:-100000}
large=${LARGE:-300000}

# One run: prints "instructions d1_misses" (the misses 0 without --cache).
count() {
    # shellcheck disable=SC2068 # the program and its arguments, split
    valgrind --tool=cachegrind --cache-sim=$cache --cachegrind-out-file=/dev/null \
        $@ --messages "$n" 2>&1 >/dev/null | awk '
        /I *refs:/ { gsub(",", "", $4); ir = $4 }
        /D1  misses:/ { gsub(",", "", $4); d1 = $4 }
        END { if (ir == "") exit 1; print ir, (d1 == "" ? 0 : d1) }'
}

n=$small

a=$(count $@)
n=$large
z=$(count $@)
echo "$a $z" | awk -v s="$small" -v l="$large" -v cache="$cache" -v prog="$*" '{
    span = l - s
    printf "%s: %.0f instructions per message", prog, ($3 - $1) / span
    if (cache == "yes") printf ", %.1f L1 data misses per message", ($4 - $2) / span
    printf " (%s and %s messages)\n", s, l
}'
