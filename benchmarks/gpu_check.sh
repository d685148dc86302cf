#!/usr/bin/env bash
# The GPU check, in one run from the repository root on a CUDA machine (no papermill or internet needed):
# the tests that exercise CUDA and the compiled Triton kernels, then the energy, SphereConv and margin-head
# benchmarks.  Logs go to $OUT (default gpu_out/), the benchmark JSON to benchmarks/results/*-cuda.json
# (also packed into $OUT/results.tar.gz).  Each step has its own time limit, so one slow step cannot take
# the rest with it.  Usage: OUT=dir bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 SPHEREML_NO_DOWNLOAD=1
PY=${PYTHON:-python3}

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.txt, report the status
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
}

{ nvidia-smi -L; $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, torch.cuda.get_device_name())"; } > "$OUT/env.txt" 2>&1
# the compiled Triton kernels against float64 dense (one configuration each), and the CUDA training tests
SPHEREML_TRITON_AUTOTUNE=0 step pytest "${PYTEST_LIMIT:-120}" $PY -m pytest -q -p no:cacheprovider \
  tests/test_energy_triton.py tests/test_train.py
SPHEREML_BENCH_BUDGET_S=${ENERGY_BUDGET:-220} step bench_energy "${ENERGY_LIMIT:-235}" $PY -m benchmarks energy
step bench_sphereconv "${SPHERECONV_LIMIT:-90}" $PY -m benchmarks sphereconv
step bench_margins "${MARGINS_LIMIT:-150}" $PY -m benchmarks margins
tar czf "$OUT/results.tar.gz" benchmarks/results/*-cuda.json 2>/dev/null
cat "$OUT/summary.txt"
