#!/usr/bin/env bash
# The h5ngff benchmark on a machine without network, from a folder built by bench/device/bundle
# (run.sh is copied into it). From anywhere:
#
#     bash dist/device/run.sh [SCALE [OUT_DIR]]
#
# SCALE: fraction of the 4.54 GB f32 volume (default 1; above 1, a larger volume).
# OUT_DIR (or $OUT): where results.md, results.json, plot.png, logs/, MANIFEST.json and run.log land
# (default ./bench-out).
#
# What it does: installs the bundle's wheels into a private site dir (pip --target, or unzipping
# them where pip is missing), checks every import (preflight.py), writes the f32 input on all cores
# (pregen.py, bit for bit what bench.data writes on one), then runs
#     python -m bench --scale S --cores N --cases f32 --only h5ngff,h5ngff-pyramid,tensorstore --repeat 2
# from the bundle's h5ngff/ (the physical limit on 1 core and on N processes, the pyramid floor, then
# every run, verified), with the input and outputs in /dev/shm when it has room, and copies what it
# made into OUT_DIR. Environment (defaults are the 16-core target's):
#   BENCH_SCALE=1  BENCH_CORES=16  BENCH_ONLY=h5ngff,h5ngff-pyramid,tensorstore  BENCH_REPEAT=2  BENCH_CASES=f32
#   BENCH_PYTHON=python3           must be the Python the wheels were built for (MANIFEST.json)
#   BENCH_SITE=$TMPDIR/h5ngff-bench-site   BENCH_RESULTS_DIR=$TMPDIR/h5ngff-bench-results
#   BENCH_DATA_DIR=/dev/shm/h5ngff-bench-data  BENCH_WORK_DIR=/dev/shm/h5ngff-bench-work  (disk under
#                                  $TMPDIR when /dev/shm has less than 7 x SCALE + 1.5 GB free)
#   BENCH_DEADLINE_S=570           the whole script (the device tool's 600 s); the suite is stopped in
#                                  time to copy what it has. 0: no deadline
#   BENCH_PREGEN=1                 0: let the suite generate the input itself (one core)
#   BENCH_RUN_TIMEOUT              per tool run (default 60 + 120 x SCALE s; the suite's own is 120 + 1500 x SCALE)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONNOUSERSITE=1

DEV=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TREE="$DEV/h5ngff"
TMP=${TMPDIR:-/tmp}
SCALE=${1:-${BENCH_SCALE:-1}}
OUT=${2:-${OUT:-$PWD/bench-out}}
WHEELS=${BENCH_WHEELS:-$DEV/whl}
CORES=${BENCH_CORES:-16}
PY=${BENCH_PYTHON:-python3}
SITE=${BENCH_SITE:-$TMP/h5ngff-bench-site}
DATA_DIR=${BENCH_DATA_DIR:-/dev/shm/h5ngff-bench-data}
WORK_DIR=${BENCH_WORK_DIR:-/dev/shm/h5ngff-bench-work}
RESULTS_DIR=${BENCH_RESULTS_DIR:-$TMP/h5ngff-bench-results}
REPEAT=${BENCH_REPEAT:-2}
CASES=${BENCH_CASES:-f32}
ONLY=${BENCH_ONLY:-h5ngff,h5ngff-pyramid,tensorstore}
DEADLINE=${BENCH_DEADLINE_S:-570}
PREGEN=${BENCH_PREGEN:-1}
RUN_TIMEOUT=${BENCH_RUN_TIMEOUT:-$(awk -v s="$SCALE" 'BEGIN { printf "%d", 60 + 120 * s }')}
MARK=.h5ngff-bench
export BENCH_CORES=$CORES

stamp() { printf '\n==== %s  +%ds  %s\n' "$(date '+%F %T')" "$SECONDS" "$*"; }

# Empty DIR for this run: refuses a non-empty folder this script did not make (no marker in it).
fresh() {
    local dir=$1
    if [ -d "$dir" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ] && [ ! -e "$dir/$MARK" ]; then
        echo "ERROR: $dir is not empty and was not made by run.sh (no $MARK in it): not removing it"
        return 1
    fi
    rm -rf "$dir" && mkdir -p "$dir" && touch "$dir/$MARK"
}

# End the processes the suite left running after a stop at the deadline: they carry our tag.
leftovers() {
    local tag=$1 pids=() e p
    for e in /proc/[0-9]*/environ; do
        p=${e#/proc/}; p=${p%/environ}
        grep -qzxF "BENCH_RUN_TAG=$tag" "$e" 2>/dev/null && pids+=("$p")
    done
    [ "${#pids[@]}" -eq 0 ] && return 0
    echo "ending ${#pids[@]} process(es) the suite left running: ${pids[*]}"
    kill -TERM "${pids[@]}" 2>/dev/null; sleep 3; kill -KILL "${pids[@]}" 2>/dev/null
    return 0
}

main() {
    stamp "start: scale $SCALE, cores $CORES, repeat $REPEAT, cases $CASES, runs $ONLY, deadline ${DEADLINE}s, per-run timeout ${RUN_TIMEOUT}s"
    [ -d "$TREE/bench" ] && [ -f "$DEV/MANIFEST.json" ] || { echo "ERROR: $DEV is not a bundle (build one with bench/device/bundle)"; return 2; }
    command -v "$PY" >/dev/null || { echo "ERROR: no $PY here (set BENCH_PYTHON)"; return 2; }
    echo "h5ngff: $(head -2 "$TREE/COMMIT" 2>/dev/null | tr '\n' ' ')"
    local want have
    want=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["python_version"])' "$DEV/MANIFEST.json")
    have=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    echo "python: $(command -v "$PY") ($("$PY" -V 2>&1)); the wheels are for $want: $(ls "$WHEELS"/*.whl 2>/dev/null | wc -l) in $WHEELS"
    if [ "$want" != "$have" ]; then
        echo "ERROR: $PY is Python $have, the bundle's wheels are for $want (set BENCH_PYTHON, or rebuild with bundle --python-version $have)"
        return 2
    fi

    stamp "machine"
    echo "nproc: $(nproc)   usable: $("$PY" -c 'import os; print(len(os.sched_getaffinity(0)))')"
    lscpu 2>/dev/null | grep -E '^(Model name|Socket|Core|Thread|CPU\(s\)|NUMA node\(s\)|L3)' || grep -m1 'model name' /proc/cpuinfo
    for f in /sys/fs/cgroup/cpu.max /sys/fs/cgroup/memory.max; do [ -r "$f" ] && echo "$f: $(cat "$f")"; done
    free -g
    df -h /dev/shm "$TMP" 2>/dev/null
    uptime

    stamp "install the wheels into $SITE"
    fresh "$SITE" || return 3
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        if ! "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl; then
            echo "pip failed or missing: unpacking the wheels with zipfile instead (none of them has a .data folder)"
            fresh "$SITE" || return 3
            "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$SITE" "$WHEELS"/*.whl || return 3
        fi
    fi
    ls "$SITE" | grep dist-info | tr '\n' ' '; echo
    # Byte-compile on every core now, so no process compiles a module inside a timed run.
    "$PY" -m compileall -q -j 0 "$SITE" "$DEV" >/dev/null 2>&1 || echo "compileall failed (modules compile on first import)"

    export PYTHONPATH="$SITE:$TREE/src"
    if "$PY" -c 'import hdf5plugin' 2>/dev/null; then
        echo "hdf5plugin: $("$PY" -c 'import hdf5plugin; print(hdf5plugin.__file__)')"
    elif [ -d "$DEV/stub" ]; then
        export PYTHONPATH="$PYTHONPATH:$DEV/stub"
        echo "hdf5plugin: none here; the bundle's stub on the path (registers no HDF5 filter; f32 is contiguous, no filter is read)"
    fi
    echo "PYTHONPATH=$PYTHONPATH"

    stamp "allocator"
    local jem="$DEV/libjemalloc.so.2"
    if [ -r "$jem" ] && ! ldd "$jem" 2>&1 | grep -q 'not found' && [ -z "$(LD_PRELOAD="$jem" "$PY" -c pass 2>&1)" ]; then
        export H5NGFF_JEMALLOC="$jem"
        echo "H5NGFF_JEMALLOC=$jem (h5ngff's workers preload it, as with Debian's libjemalloc2 installed)"
    else
        echo "WARNING: no usable $jem here: h5ngff's workers fall back to tuned glibc malloc"
    fi

    # h5ngff plans one worker per usable core: hold the whole suite to $CORES of them if more are usable.
    local pin=() usable
    usable=$("$PY" -c 'import os; print(len(os.sched_getaffinity(0)))')
    if [ "$usable" -gt "$CORES" ]; then
        pin=("$PY" -c 'import os, sys; os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:int(sys.argv[1])]); os.execvp(sys.argv[2], sys.argv[2:])' "$CORES")
        echo "pinning the suite to the first $CORES of $usable usable cores"
    elif [ "$usable" -lt "$CORES" ]; then
        echo "WARNING: only $usable usable cores: the limit is divided by $CORES but h5ngff plans $usable workers"
    fi

    stamp "preflight"
    (cd "$TREE" && "${pin[@]}" "$PY" "$DEV/preflight.py" --only "$ONLY" --site "$SITE") || { echo "preflight failed: not running the suite"; return 4; }

    # The input + the largest outputs at once (the limit's, a 3-level pyramid's) + slack, in GB.
    local need free_gb
    need=$(awk -v s="$SCALE" 'BEGIN { printf "%d", 7 * s + 1.5 }')
    mkdir -p "$DATA_DIR" 2>/dev/null
    free_gb=$(df -Pk "$DATA_DIR" 2>/dev/null | awk 'NR==2 { printf "%d", $4 / 1048576 }')
    if [ -z "$free_gb" ] || [ "$free_gb" -lt "$need" ]; then
        echo "WARNING: $DATA_DIR has ${free_gb:-?} GB free, need ~$need GB: using $TMP (disk; inputs are read through the page cache)"
        DATA_DIR=$TMP/h5ngff-bench-data WORK_DIR=$TMP/h5ngff-bench-work
    fi
    echo "input in $DATA_DIR, outputs in $WORK_DIR, results in $RESULTS_DIR"
    mkdir -p "$DATA_DIR" && fresh "$WORK_DIR" && fresh "$RESULTS_DIR" || return 3

    local entry=(-m bench)

    if [ "$PREGEN" != 0 ]; then
        stamp "input: written on $CORES processes, bit for bit what the suite's one-core generator writes (pregen.py)"
        (cd "$TREE" && "${pin[@]}" "$PY" "$DEV/pregen.py" --scale "$SCALE" --data-dir "$DATA_DIR" --workers "$CORES" --cases "$CASES") \
            || echo "pregen failed: the suite generates the input itself (one core)"
    fi
    local left=$((DEADLINE > 0 ? DEADLINE - SECONDS - 25 : 10**9))
    [ "$left" -gt 30 ] || { echo "no time left for the suite"; return 5; }

    stamp "suite$([ "$DEADLINE" -gt 0 ] && echo " (stopped after ${left}s if still running)")"
    local args=(--scale "$SCALE" --cores "$CORES" --data-dir "$DATA_DIR" --work-dir "$WORK_DIR" --results-dir "$RESULTS_DIR"
                --cases "$CASES" --only "$ONLY" --repeat "$REPEAT" --timeout "$RUN_TIMEOUT")
    echo "cd $TREE && ${pin[*]:+(pinned) }$PY ${entry[*]} ${args[*]}"
    # The tag marks every process the suite starts (each tool runs in a process session of its own),
    # so any left running after a stop at the deadline can be found and ended.
    local tag="h5ngff-bench-$$-$RANDOM"
    (cd "$TREE" && BENCH_RUN_TAG="$tag" timeout --kill-after=10 "$left" "${pin[@]}" "$PY" "${entry[@]}" "${args[@]}") 2>&1 \
        | while IFS= read -r line; do printf '[+%4ds] %s\n' "$SECONDS" "$line"; done
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 124 ] && echo "SUITE STOPPED at the deadline: partial logs only"
    leftovers "$tag"
    stamp "suite exited $rc"

    local res
    res=$(ls -td "$RESULTS_DIR"/*/ 2>/dev/null | head -1)
    cp "$DEV/MANIFEST.json" "$OUT/" 2>/dev/null
    if [ -n "$res" ]; then
        for f in results.md results.json plot.png; do [ -f "$res/$f" ] && cp "$res/$f" "$OUT/"; done
        [ -d "$res/logs" ] && rm -rf "$OUT/logs" && cp -r "$res/logs" "$OUT/logs"
        if [ -f "$res/results.json" ]; then
            stamp "summary"
            "$PY" "$DEV/summary.py" "$res/results.json"
        fi
    fi
    stamp "done: $(ls "$OUT" | tr '\n' ' ')"
    return "$rc"
}

mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
main 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
