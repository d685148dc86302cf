#!/usr/bin/env bash
# The one command for a GPU box, from the repository root (no papermill, jupytext or internet needed):
#
#   bash benchmarks/gpu_check.sh [tests] [bench[:NAME,NAME...]] [scaling] [profile] [profile-step]
#                                [chapter:NAME[,NAME...]|chapters|chapters-at-once[:NAME,NAME...]]
#
# with no argument: tests and bench.  Each part has its own time limit and prints what failed by name:
#   tests     the test suite on CUDA (pytest -n auto, every file whose packages a GPU box has, TEST_TIMEOUT 300 s
#             per test where pytest-timeout is installed, one thread per worker, work stealing, no ruff
#             test: SPHEREML_NO_DEV_TOOLS=1); each test's duration in $OUT/durations.txt; failing node ids
#             in $OUT/failures.txt, their messages in $OUT/failure-messages.txt as they happen (so a suite
#             stopped by its limit still says why), the whole log in $OUT/tests.txt     (TESTS_LIMIT, 240 s)
#   bench     every benchmark on CUDA but the energy's scaling study (or the listed ones), each in its own
#             process within what is left of the limit, with inductor's hints (TORCH_LOGS=perf_hints) and, in each
#             result, what the compiler made of each compiled candidate, then the open issues' goals against the saved results in
#             $OUT/goals.txt (python -m benchmarks.goals)                                   (BENCH_LIMIT, 240 s)
#   scaling   the energy's scaling study up to N = 2^20                                   (SCALING_LIMIT, 500 s)
#   profile   each patch layer by backend: wall, host and device time per call, top kernels (PROFILE_LIMIT, 120 s)
#   profile-step   the CNN-9 step, plain and with HS-MHE, eager and compiled (CUDA graphs): device time, top kernels,
#             what the compiler made of it and a warm step's peak memory, with TORCH_LOGS=cudagraphs (why CUDA
#             graphs were skipped or recorded again; NAMES: other regularisers of benchmarks/bench_comhe.py, one
#             word each)                                                                 (PROFILE_LIMIT, 120 s)
#   chapter:NAME / chapters   a chapter's gpu profile (the listed ones or all nine, one after another;
#             chapters-at-once[:NAME,...]: the listed ones or all at once, the cores shared out among them, each
#             chapter's clock then that of a shared GPU, said in its metrics.json as runs_beside), run as a script
#             made by jupytext beforehand
#             (`make gpu-scripts` writes benchmarks/chapters/NAME.py, ignored by git: carry it)
#             with metrics.json under _build/runs/NAME; SPHEREML_GPU_TINY=1 in the environment
#             runs the same code at smoke sizes first, to check it   (CHAPTER_LIMIT, 600 s)
#             Each finished training is saved under $SPHEREML_RESUME (default .gpu/resume; sphereml.book.resume)
#             and restored when the chapter runs again, so a chapter stopped by its limit goes on where it stopped,
#             on this box or, carried back in .gpu/resume, on the next: the saved trainings of the chapters run
#             come back in parts of 15 MiB, $OUT/resume.tar.aa, .ab, ..., as many chapters as fit in RESUME_MIB
#             (26: what a carry of 64 MiB leaves beside the data and the checkout; here, unpack them with
#             `cat resume.tar.* | tar xf - -C .gpu/resume`).
# TIDY_OUT=1 deletes the logs from $OUT once packed in gpu_check.tar.gz, for a box that sends back at most 8 files.
# Data: a GPU box has no Fashion-MNIST; copy its four IDX files to .gpu/data/fashion-mnist/ (ignored by git), carry
# .gpu and benchmarks/chapters to the box, and export SPHEREML_DATA=$PWD/.gpu/data before this script.
# Logs go to $OUT (default gpu_out/), one line per part in $OUT/summary.txt; benchmark JSON goes to
# benchmarks/results/*-cuda.json and is packed with the logs into $OUT/gpu_check.tar.gz.
set -u
OUT=${OUT:-gpu_out}
resume=${SPHEREML_RESUME:-$PWD/.gpu/resume}  # the chapters' saved trainings: the chapter parts' alone
unset SPHEREML_RESUME
ran=()  # the chapters run
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the tests write into it from their own working directories
export PYTHONPATH=${PYTHONPATH:-src}:. PYTHONUNBUFFERED=1 SPHEREML_NO_DOWNLOAD=1
PY=${PYTHON:-python3}
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(tests bench)

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt, report the status
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  local why=""
  [ $rc -eq 124 ] && why=" (time limit)"
  echo "$name: exit $rc$why after $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
}

{ nvidia-smi -L; $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, torch.cuda.get_device_name())"; } > "$OUT/env.txt" 2>&1

for part in "${PARTS[@]}"; do
  case $part in
    tests)
      # test_book / test_notebooks / test_browser / test_setup / test_chapter_verdicts and the tests marked
      # notebook need papermill, jupytext, selenium or the make set-up, which a GPU box does not have
      timeout=()
      $PY -c "import pytest_timeout" 2>/dev/null && timeout=(--timeout "${TEST_TIMEOUT:-300}")
      # one thread per worker: 16 workers of 16 threads each on 16 cores ran the suite at a fraction of its speed
      # (an H200 box, 12 workers: 83 % of the tests in 265 s, the chapters beside them 4x slower than alone)
      # work stealing (pytest-xdist >= 3.2): an idle worker takes tests queued on a busy one, so the slow tests
      # do not wait at the end of one worker's share
      dist=()
      $PY -c "import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split('.')[:2])) < (3, 2))" 2>/dev/null \
        && dist=(--dist worksteal)
      : > "$OUT/failure-messages.txt"
      : > "$OUT/durations.txt"
      OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1} \
        SPHEREML_FAILURE_LOG="$OUT/failure-messages.txt" SPHEREML_DURATION_LOG="$OUT/durations.txt" \
        SPHEREML_NO_DEV_TOOLS=1 \
        step tests "${TESTS_LIMIT:-240}" $PY -m pytest -n "${WORKERS:-auto}" "${dist[@]}" -v -p no:cacheprovider \
        "${timeout[@]}" \
        --continue-on-collection-errors --ignore=tests/test_book.py --ignore=tests/test_notebooks.py \
        --ignore=tests/test_browser.py --ignore=tests/test_setup.py --ignore=tests/test_chapter_verdicts.py \
        -m "not notebook" tests
      grep -E "^(FAILED|ERROR) |\] (FAILED|ERROR) " "$OUT/tests.txt" | sed -E 's/.*(FAILED|ERROR) /\1 /; s/ - .*//; s/ +$//' \
        | sort -u > "$OUT/failures.txt"
      echo "tests: $(grep -c . "$OUT/failures.txt") failing node ids (failures.txt);" \
        "$(grep -cE '\] PASSED|^PASSED|PASSED ' "$OUT/tests.txt") passed" | tee -a "$OUT/summary.txt"
      ;;
    bench|bench:*)
      names=${part#bench}
      names=${names#:}
      if [ -z "$names" ]; then
        names=$(ls benchmarks/bench_*.py | sed -E 's|.*/bench_(.*)\.py|\1|' | tr '\n' ' ')
      fi
      # each benchmark in its own process, within what is left of BENCH_LIMIT, so that one that dies (the OPT step
      # that CUDA graphs could not capture, on an H100 on 2026-12-06, took the two queued after it down with it)
      # leaves the others to run; each one's line in summary.txt, their output together in bench.txt
      # perf_hints: inductor's hints; how many graphs skipped CUDA graphs is in each result's "compiler" (the reasons
      # go to the cudagraphs log, which also writes a line per call run outside a graph, inside the timing: it is
      # profile-step's)
      started=$SECONDS
      : > "$OUT/bench.txt"
      for name in ${names//,/ }; do
        left=$(( ${BENCH_LIMIT:-240} - (SECONDS - started) ))
        if [ "$left" -le 0 ]; then
          echo "bench $name: not run (BENCH_LIMIT reached)" | tee -a "$OUT/summary.txt"
          continue
        fi
        begun=$SECONDS
        TORCH_LOGS=${TORCH_LOGS-perf_hints} timeout "$left" $PY -m benchmarks "$name" >> "$OUT/bench.txt" 2>&1
        rc=$?
        why=""
        [ $rc -eq 124 ] && why=" (time limit)"
        echo "bench $name: exit $rc$why after $((SECONDS - begun)) s" | tee -a "$OUT/summary.txt"
      done
      # the open issues' goals against the results saved now (and earlier): met / missed / not measured
      $PY -m benchmarks.goals cuda > "$OUT/goals.txt" 2>&1
      echo "goals: $(grep -c '| met |' "$OUT/goals.txt") met, $(grep -c '| missed |' "$OUT/goals.txt") missed" \
        "(goals.txt)" | tee -a "$OUT/summary.txt"
      ;;
    scaling)
      step scaling "${SCALING_LIMIT:-500}" $PY -m benchmarks.bench_energy --only scaling
      ;;
    profile)
      step profile "${PROFILE_LIMIT:-120}" $PY -m benchmarks.profile_layer
      ;;
    profile-step)
      # shellcheck disable=SC2086  # NAMES: regulariser names, one word each
      TORCH_LOGS=${TORCH_LOGS-cudagraphs} step profile-step "${PROFILE_LIMIT:-120}" $PY -m benchmarks.profile_step \
        ${NAMES:-none HS-MHE}
      ;;
    chapter:*|chapters|chapters-at-once|chapters-at-once:*)
      chapters=${part#*:}
      [ "$chapters" = "$part" ] \
        && chapters=$(ls benchmarks/chapters/*.py 2>/dev/null | xargs -n1 basename | sed 's/\.py$//')
      chapters=${chapters//,/ }
      ran+=($chapters)
      # shellcheck disable=SC2086  # the names, one word each
      set -- $chapters
      threads=$(( $(nproc) / ($# > 0 ? $# : 1) ))  # the cores shared out among chapters run at once
      [ "$threads" -ge 1 ] || threads=1
      for name in $chapters; do
        if [ "${part%%:*}" = chapters-at-once ]; then  # at once, the cores shared: their metrics.json list each
          # training's seconds as it ends, so a chapter stopped by its limit still measures its throughput
          OMP_NUM_THREADS=$threads SPHEREML_RUNS_BESIDE=$(($# - 1)) SPHEREML_PROFILE=gpu SPHEREML_RESUME=$resume \
            step "chapter-$name" "${CHAPTER_LIMIT:-600}" $PY "benchmarks/chapters/$name.py" &
        else
          SPHEREML_PROFILE=gpu SPHEREML_RESUME=$resume step "chapter-$name" "${CHAPTER_LIMIT:-600}" \
            $PY "benchmarks/chapters/$name.py"
        fi
      done
      wait
      ;;
    *) echo "unknown part $part" | tee -a "$OUT/summary.txt" ;;
  esac
done
packed=() budget=$(( ${RESUME_MIB:-26} * 1024 ))  # the saved trainings to carry on, in parts of 15 MiB
for name in $(printf "%s\n" "${ran[@]}" | sort -u); do
  [ -d "$resume/$name" ] || continue
  count=$(find "$resume/$name" -name '[0-9]*.pt' | wc -l)  # not a save cut short (.NNNN.pt.PID.tmp)
  kib=$(find "$resume/$name" -name '[0-9]*.pt' -printf '%s\n' | awk '{s += $1} END {print int(s / 1024)}')
  if [ "$kib" -le "$budget" ]; then
    packed+=("$name") budget=$((budget - kib))
    echo "resume $name: $count trainings, $((kib / 1024)) MiB, in resume.tar.*" | tee -a "$OUT/summary.txt"
  else
    echo "resume $name: $count trainings, $((kib / 1024)) MiB, too large to come back" | tee -a "$OUT/summary.txt"
  fi
done
[ ${#packed[@]} -gt 0 ] && tar cf - -C "$resume" --exclude='.*' "${packed[@]}" | split -b 15M - "$OUT/resume.tar."
tar czf "$OUT/gpu_check.tar.gz" "$OUT"/*.txt benchmarks/results/*-cuda.json _build/runs/*/metrics.json 2>/dev/null
if [ "${TIDY_OUT:-0}" = 1 ] && tar tzf "$OUT/gpu_check.tar.gz" > /dev/null 2>&1; then
  find "$OUT" -maxdepth 1 -name '*.txt' ! -name summary.txt -delete  # they are in the archive
fi
cat "$OUT/summary.txt"
