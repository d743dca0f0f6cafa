#!/usr/bin/env bash
# All of dalid's GPU work on a machine with a GPU, in parts of at most about 10 minutes each;
# every part writes its log and an archive of its results to $OUT.
#
#   bash bench/gpu/run_on_device.sh              (from the repository root, once DALI is staged)
#       the whole GPU check in one call, in under 10 minutes (BUDGET_S 570 by default): setup,
#       bench-gpu (DALI's proxy among its contenders), experiments (bench-gpu's first run is
#       their base) and tests (the gpu-marked tests, DALI's proxy conformance cases on the GPU
#       among them, with what time is left: skipped under 90 s); each part's time is capped
#       so that the ones after it still get theirs
#   bash bench/gpu/run_on_device.sh PART...
#
#   setup          installs dalid (editable, no dependencies fetched) and records the machine:
#                  nvidia-smi, versions; checks that DALI, torch with CUDA, CuPy and pyzmq import
#   tests          the gpu-marked tests (pytest -m gpu -rA, JUnit XML), with nvidia-smi's
#                  processes before and after them (a leaked GPU process shows there)
#   bench-gpu      the GPU profile: DALI in-process, DALI's proxy and dalid (shared) at 1 and 8
#                  jobs (2,048 images, 3 epochs, the experiments' size), then the QA decoder
#                  configuration in-process and through dalid
#   bench-main     python -m bench --profile gpu: DALI in-process, DALI's proxy, dalid, dalid with
#                  staged outputs, the QA configuration in-process and through dalid, transport
#   bench-scaling  python -m bench --profile gpu --only scaling: 1, 2, 4 and 8 jobs of dalid
#                  (shared) and of DALI in-process, with each process's GPU memory
#   experiments    short bench runs (1 repeat, 2,048 images, 3 epochs) that tell where dalid's
#                  samples/s and GPU memory go: the defaults (base, in-process beside them; after
#                  bench-gpu in the same call, its first run), then the daemon as in-process runs
#                  (8 threads, 1-batch runs, 1 instance), 4-batch runs, 1 pinned instance, 8 DALI
#                  threads, and a hardware decoder share of HW_LOAD (0.9) for both; writes the table
#                  $OUT/experiments-summary.md (python -m bench.experiments). With setup, about
#                  6 minutes (BUDGET_S 380 by default, with setup or alone); experiments that
#                  would not fit what is left are skipped, and said so
#
# The machine needs torch with CUDA, CuPy, numpy and msgpack, and DALI and pyzmq in /tmp/site
# (pip install --target /tmp/site ...): PYTHONPATH is set here. See bench/README.md.
# Environment:
#   OUT         where results go (default ./gpu-out)
#   PYTHON      the interpreter (default python3)
#   BUDGET_S    seconds the parts of one invocation may take together (default 560; 570 for
#               the whole check; 380 for experiments, with setup or alone)
#   REPEATS     repeats of the benchmark parts (default 1)
#   HW_LOAD     the hardware decoder share of the experiments' hw-load run (default 0.9)
#   DRY_RUN=1   on a machine without a GPU: no install, the bench in quick mode on the CPU
#               (--profile gpu --quick --cpu), the gpu-marked tests skip; checks the plumbing
# shellcheck disable=SC2329  # the parts' functions are called by name, part_<name>
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT="$PWD"
OUT="${OUT:-$ROOT/gpu-out}"
PYTHON="${PYTHON:-python3}"
if [ $# -eq 0 ]; then
  set -- setup bench-gpu experiments tests
  BUDGET_S="${BUDGET_S:-570}"
fi
case "$*" in
  experiments | "setup experiments") BUDGET_S="${BUDGET_S:-380}" ;;
esac
BUDGET_S="${BUDGET_S:-560}"
REPEATS="${REPEATS:-1}"
DRY_RUN="${DRY_RUN:-0}"
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
DEADLINE=$((SECONDS + BUDGET_S))
mkdir -p "$OUT"

usage() { sed -n '2,43p' "$0"; exit 2; }

# Seconds the parts after the running one keep for themselves (set per part below), and the
# steps after the running one within its part.
AFTER=0
RESERVE=0
# bench-gpu's first run (DALI in-process, DALI's proxy and dalid at 1 and 8 jobs, the
# experiments' size): the experiments' base when they follow it in the same invocation.
PROFILE_RUN=""

# Seconds left for a step, keeping 15 s to pack its results, AFTER for the parts after it and
# RESERVE for the steps after it; at least 30.
left() {
  local remaining=$((DEADLINE - SECONDS - 15 - AFTER - RESERVE))
  echo $((remaining > 30 ? remaining : 30))
}

# pack NAME DIR: DIR's files as one archive, $OUT/NAME.tar.gz.
pack() {
  tar czf "$OUT/$1.tar.gz" -C "$2" . && echo "packed $OUT/$1.tar.gz ($(du -h "$OUT/$1.tar.gz" | cut -f1))"
}

gpu_processes() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
  else
    echo "no nvidia-smi"
  fi
}

part_setup() {
  local dir="$1"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi > "$dir/nvidia-smi.txt" 2>&1
    nvidia-smi -q > "$dir/nvidia-smi-q.txt" 2>&1
    nvidia-smi topo -m > "$dir/nvidia-smi-topo.txt" 2>&1
  fi
  { uname -a; nproc; free -g; df -h /tmp /dev/shm; } > "$dir/machine.txt" 2>&1
  if [ "$DRY_RUN" != 1 ]; then
    "$PYTHON" -m pip install -q --no-deps --no-index --no-build-isolation -e . || return 1
  fi
  "$PYTHON" - <<'PY' | tee "$dir/versions.txt"
import importlib.metadata as m
import nvidia.dali, torch, zmq, msgpack, numpy
import dalid.client, dalid.server
print("dali", nvidia.dali.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "zmq", zmq.__version__, "libzmq", zmq.zmq_version(), "numpy", numpy.__version__)
try:
    import cupy
    print("cupy", cupy.__version__)
except ImportError as error:
    print("cupy missing:", error)
for name in ("dalid", "nvidia-dali-cuda130", "nvidia-dali-cuda120", "pytest", "matplotlib",
             "scikit-learn", "pillow", "rich"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "not installed")
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
    from dalid.protocol import gpu_uuid
    print("uuid", gpu_uuid(0))
    # What the daemon's instance controller reads of the GPU (None: NVML not found).
    from dalid.server.runs.instances import GpuMeter
    meter = GpuMeter(0)
    print("nvml", meter.available, "utilisation", meter.read())
PY
}

part_tests() {
  local dir="$1"
  local left_s=$((DEADLINE - SECONDS - 15 - AFTER))
  if [ "$left_s" -lt 90 ]; then
    echo "tests skipped: ${left_s}s left, they need about 90s" | tee "$dir/skipped.txt"
    return 0
  fi
  gpu_processes > "$dir/gpu-processes-before.txt" 2>&1
  # The modules that hold gpu-marked tests, and of them those tests (they skip without CUDA):
  # collecting every module would import what only CPU tests need.
  local modules
  mapfile -t modules < <(grep -rlE "mark\.gpu" tests --include='test_*.py' | sort)
  echo "gpu-marked tests in: ${modules[*]}"
  timeout --kill-after=20 "$(left)" "$PYTHON" -m pytest -m gpu "${modules[@]}" -rA \
    -p no:cacheprovider --junitxml="$dir/gpu-tests.xml" 2>&1 | tee "$dir/pytest.log"
  local status=${PIPESTATUS[0]}
  sleep 2
  gpu_processes > "$dir/gpu-processes-after.txt" 2>&1
  ls -la /dev/shm > "$dir/dev-shm-after.txt" 2>&1
  return "$status"
}

bench() {
  local dir="$1"
  shift
  local mode=(--profile gpu --repeats "$REPEATS")
  [ "$DRY_RUN" = 1 ] && mode=(--profile gpu --quick --cpu --repeats 1)
  mkdir -p "$dir"
  gpu_processes > "$dir/gpu-processes-before.txt" 2>&1
  # In $dir: the run's summary JSON, LATEST.md with its plots (what is committed), and raw/,
  # the raw result and per-run plots (packed too; git ignores raw/ under bench/results).
  timeout --kill-after=20 "$(left)" "$PYTHON" -m bench "${mode[@]}" \
    --output "$dir" "$@" > "$dir/report.md" 2> >(tee "$dir/progress.log" >&2)
  local status=$?
  cat "$dir/report.md"
  gpu_processes > "$dir/gpu-processes-after.txt" 2>&1
  return "$status"
}

part_bench_gpu() {
  local size=(--epochs 3 --images 2048)
  [ "$DRY_RUN" = 1 ] && size=()
  # The QA configuration takes about a third of the time of the first run: keep it that.
  RESERVE=$(( (DEADLINE - SECONDS - AFTER) / 4 ))
  bench "$1/profile" "${size[@]}" --only dali,dali-proxy,dalid,scaling --scaling-jobs 1,8
  local status=$?
  [ "$status" = 0 ] && PROFILE_RUN="$1/profile"
  RESERVE=0
  bench "$1/qa" "${size[@]}" --only dali-qa,dalid-qa || status=1
  return "$status"
}

part_bench_main() {
  bench "$1" --only dali,dali-proxy,dalid,dalid-staged,dali-qa,dalid-qa,transport
}

part_bench_scaling() {
  bench "$1" --only scaling
}

# experiment DIR NAME NEED_S [DALID_X=Y...] -- BENCH-OPTIONS...: one bench run of the experiments
# in DIR/NAME, its daemons run with the DALID_* settings given (dalid serve reads them from its
# environment, which the bench's daemons inherit); skipped when less than NEED_S seconds are
# left, so that a run is never cut short into a result that says nothing.
experiment() {
  local dir="$1" name="$2" need="$3"
  shift 3
  local settings=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    settings+=("$1")
    shift
  done
  shift
  local left_s=$((DEADLINE - SECONDS - 15 - AFTER - RESERVE))
  if [ "$left_s" -lt "$need" ]; then
    echo "experiment $name skipped: ${left_s}s left, it needs about ${need}s" |
      tee -a "$dir/skipped.txt"
    return 0
  fi
  echo "--- experiment $name: ${settings[*]:-daemon defaults} $* (${left_s}s left)"
  mkdir -p "$dir/$name"
  echo "${settings[*]}" > "$dir/$name/daemon-env.txt"
  (
    [ ${#settings[@]} -gt 0 ] && export "${settings[@]}"
    bench "$dir/$name" "$@"
  )
}

part_experiments() {
  local dir="$1"
  # Half of bench-gpu's images: each 1-job run takes some 10 s on an H100, each 8-job run 20.
  local size=(--epochs 3 --images 2048)
  [ "$DRY_RUN" = 1 ] && size=()
  # --jobs 8: each contender at 1 job, then at 8 (scaling runs would add DALI in-process's).
  local one=(--only dalid) both=(--only dalid --jobs 8)
  local status=0
  # base: the defaults, DALI in-process beside dalid at 1 and 8 jobs; every ratio is against it.
  # After bench-gpu in this invocation, its first run is the base (the same size and daemon).
  if [ -n "$PROFILE_RUN" ]; then
    echo "--- experiment base: bench-gpu's first run ($PROFILE_RUN)"
    mkdir -p "$dir/base" && cp -r "$PROFILE_RUN/." "$dir/base/" || status=1
  else
    experiment "$dir" base 80 -- "${size[@]}" --only dali,dalid --jobs 8 || status=1
  fi
  # The daemon as in-process DALI runs: 8 threads (the cores, 16, by default), one batch a run
  # (--run-batches auto does that at batch 256), one pinned instance (the controller's 'auto').
  # At in-process's rate, the gap is these settings; below it, the daemon's path itself.
  experiment "$dir" like-in-process 35 DALID_THREADS=8 DALID_RUN_BATCHES=1 DALID_INSTANCES=1 \
    -- "${size[@]}" "${one[@]}" || status=1
  # Runs of 4 batches (the default before auto): at 8 jobs DALI's buffers for runs of 1,024
  # samples, not 256. Whether the larger runs buy samples/s on a GPU, and what GPU memory per
  # extra job they cost (on the CPU: 6.4 GiB of daemon against 2.4, the same samples/s).
  experiment "$dir" run-batches-4 60 DALID_RUN_BATCHES=4 -- "${size[@]}" "${both[@]}" || status=1
  # One pinned instance: at 8 jobs, the GPU memory and rate without the controller's second.
  experiment "$dir" instances-1 60 DALID_INSTANCES=1 -- "${size[@]}" "${both[@]}" || status=1
  # 8 DALI threads (the mixed decoder's thread pool used some 22 us a sample a thread at 16).
  experiment "$dir" threads-8 35 DALID_THREADS=8 -- "${size[@]}" "${one[@]}" || status=1
  # More of the decoding on the hardware decoder, in-process and through dalid alike: less of
  # the CPU-side decoding whose threads the daemon spends more on.
  experiment "$dir" hw-load 45 -- "${size[@]}" --only dali,dalid \
    --hw-decoder-load "${HW_LOAD:-0.9}" || status=1
  "$PYTHON" -m bench.experiments "$dir" | tee "$OUT/experiments-summary.md" || status=1
  return "$status"
}

[ $# -gt 0 ] || usage
for part in "$@"; do
  case "$part" in
    setup | tests | bench-gpu | bench-main | bench-scaling | experiments) ;;
    *) echo "unknown part: $part" >&2; usage ;;
  esac
done

failed=0
for part in "$@"; do
  dir="$(mktemp -d "/tmp/dalid-gpu-$part-XXXX")"
  echo "=== $part (${BUDGET_S}s budget, $((DEADLINE - SECONDS))s left) ==="
  started=$SECONDS
  # The tests leave the bench at least 150 s when it follows them in this invocation; bench-gpu
  # leaves the experiments 200 s when they follow it (their first four fit; the last are
  # skipped first).
  AFTER=0
  RESERVE=0
  [ "$part" = tests ] && [[ " $* " == *" bench-gpu "* ]] && AFTER=150
  [ "$part" = bench-gpu ] && [[ " $* " == *" experiments "* ]] && AFTER=200
  "part_${part//-/_}" "$dir" > >(tee "$OUT/$part.log") 2>&1
  status=$?
  echo "=== $part: exit $status after $((SECONDS - started))s ===" | tee -a "$OUT/$part.log"
  pack "$part" "$dir"
  [ "$status" = 0 ] || failed=1
done
exit "$failed"
