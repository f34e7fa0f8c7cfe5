#!/usr/bin/env bash
# The GPU check (docs/getting-started.md, the GPU suite), in one go, on a GPU host (run from the repository root):
#
#   bash tests/gpu/device_check.sh
#
# 1. the daemon's wheels from .whl/ (when there) into /tmp/site, on PYTHONPATH;
# 2. what the host has: nvidia-smi -L, the GPUs' compute and MIG modes, Python, torch, CUDA,
#    NCCL, and which elasticd Python imports;
# 3. the GPU suite: ELASTICD_TEST_PYTHON=python3 tests/run --gpu (at most 300 s);
# 4. bench_recovery's in-place figures on NCCL: node loss, or those BENCH_ONLY names (at most 150 s each).
#
# Everything goes to stdout and, when $OUT is set, to $OUT/gpu.log.  Every step has a time
# limit, and the bench gets what is left of 8 minutes (150 s at most; skipped under 60 s).  The suite and the bench run with a mark in their
# environment (ELASTICD_DEVICE_CHECK=<this run>), which every daemon and worker they start
# inherits; after each step the processes that carry this run's mark (and only those) are
# listed and killed.  Exit status: the suite's, else the bench's.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/gpu.log") 2>&1
fi
python=${ELASTICD_TEST_PYTHON:-python3}
step() { printf '\n=== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

mark="ELASTICD_DEVICE_CHECK=run-$$-$(date +%s)"  # set for the suite and the bench alone
leftovers() {
    # this run's processes only: those whose environment carries its mark
    local pids=() environ pid
    for environ in /proc/[0-9]*/environ; do
        pid=${environ#/proc/}
        pid=${pid%/environ}
        if tr '\0' '\n' 2> /dev/null < "$environ" | grep -qxF "$mark"; then
            pids+=("$pid")
        fi
    done
    if [ "${#pids[@]}" -gt 0 ]; then
        echo "left behind by $1 (killed now):"
        ps -o pid=,args= -p "${pids[@]}" | cut -c1-200
        kill -9 "${pids[@]}" 2> /dev/null
    fi
}

step "wheels"
export PYTHONPATH="$root/daemon:$root/ctl"
if compgen -G ".whl/*.whl" > /dev/null; then
    timeout 60 "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && echo "installed: $(ls .whl | tr '\n' ' ')"
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
else
    echo "no .whl/: the daemon's dependencies must already be importable"
fi
echo "PYTHONPATH=$PYTHONPATH"
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}  # a failing worker's log then says what NCCL saw

step "host"
timeout 15 nvidia-smi -L
timeout 15 nvidia-smi --query-gpu=index,name,uuid,compute_mode,mig.mode.current,driver_version --format=csv
command -v nft > /dev/null && echo "nft: $(command -v nft)" || echo "nft: none"
[ -f /sys/fs/cgroup/cgroup.controllers ] && echo "cgroup v2: $(cat /sys/fs/cgroup/cgroup.controllers)" || echo "cgroup v2: none"
timeout 60 "$python" - <<'EOF'
import sys, platform
print("python", sys.version.split()[0], sys.executable, "on", platform.platform())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print("nccl", torch.cuda.nccl.version(), "device 0:", torch.cuda.get_device_name(0))
for name in ("elasticd", "elasticctl", "zmq", "sdnotify", "cryptography", "psutil", "prometheus_client", "pytest"):
    try:
        module = __import__(name)
        print(f"{name:18} {getattr(module, '__version__', '')} {module.__file__}")
    except Exception as exc:
        print(f"{name:18} MISSING: {exc!r}")
EOF

step "the GPU suite: tests/run --gpu"
env "$mark" ELASTICD_TEST_PYTHON="$python" timeout -s INT -k 15 "${SUITE_LIMIT:-300}" \
    tests/run --gpu -v -rA --durations=10 -p no:cacheprovider
suite=$?
echo "tests/run --gpu exited $suite"
leftovers "the suite"

bench=0
for only in ${BENCH_ONLY:-node-loss}; do  # e.g. BENCH_ONLY="node-loss scale-up"
    step "bench_recovery --backend nccl: $only, in place"
    left=$((${CHECK_BUDGET:-480} - SECONDS - 15))  # 8 minutes in all (CHECK_BUDGET); 15 s for the last clean-up
    if [ "$left" -gt 150 ]; then left=150; fi
    if [ "$left" -lt 60 ]; then
        echo "skipped: ${SECONDS} s spent, too little left of ${CHECK_BUDGET:-480} s"
        continue
    fi
    stamp=$(mktemp)
    env "$mark" timeout -k 10 "$left" "$python" tests/bench/bench_recovery.py --backend nccl \
        --only "$only" --system elasticd-inplace --runs 1
    status=$?
    echo "bench_recovery $only exited $status (limit $left s)"
    if [ "$status" -ne 0 ]; then bench=$status; fi
    leftovers "the bench"
    # a run that did not recover keeps its folder: show what its workers and daemons said
    for dir in $(find /tmp -maxdepth 1 -name 'elasticd-recovery-*' -newer "$stamp" 2> /dev/null); do
        echo "--- kept by the bench: $dir"
        for file in $(ls "$dir"/n*-state/logs/*/attempt_*/*.err 2> /dev/null | head -6) $(ls "$dir"/n*.log 2> /dev/null); do
            echo "--- $file (tail)"
            tail -n 25 "$file"
        done
    done
    rm -f "$stamp"
done

step "done in $SECONDS s: suite $suite, bench $bench"
if [ "$suite" -ne 0 ]; then exit "$suite"; fi
exit "$bench"
