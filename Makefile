# sphereml — one entry point for set-up, tests, the book and benchmarks.
#   make test   create the environment if missing, then run the whole test suite (notebooks included)
#   make test-fast   the same without chapters, subprocesses, slow tests and the browser (while working)
#   make book   create the environment if missing, execute every chapter (profile auto) and build _build/html
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
# Where a machine without an NVIDIA GPU gets the CPU build of torch (PyPI's Linux wheels are CUDA builds).
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.sphereml-installed
JB_FLAGS := -W --keep-going
PYTEST_ARGS ?=

.PHONY: setup torch-index test test-fast book book-smoke bench sm90 sync gpu-scripts clean
setup: $(STAMP)

# The venv is checked by its pip, not its python: one made without ensurepip (Debian without python3-venv) has a
# python and no pip, and `python3 -m venv` is run again, to fail with its own message.
$(STAMP): pyproject.toml
	@test -x $(BIN)/pip || $(PYTHON) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "NVIDIA GPU found: installing CUDA torch $(TORCH_VERSION)"; \
	  $(BIN)/pip install "torch==$(TORCH_VERSION)"; \
	else \
	  echo "no NVIDIA GPU: installing CPU torch $(TORCH_VERSION)"; \
	  $(BIN)/pip install "torch==$(TORCH_VERSION)" $$($(MAKE) -s torch-index); \
	fi
	$(BIN)/pip install -e ".[book,test]"
	@touch $@

# pip's arguments for CPU torch: the CPU wheel index when it answers within 5 s (name lookup included), nothing
# otherwise: a machine that cannot reach the PyTorch index then installs at once from its default index (which
# may serve CPU torch itself) instead of pip retrying the unreachable index five times for every dependency.
torch-index:
	@if timeout 5 $(PYTHON) -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=4)" \
	     "$(TORCH_CPU_INDEX)/" >/dev/null 2>&1; then \
	  echo "--extra-index-url $(TORCH_CPU_INDEX)"; \
	else \
	  echo "$(TORCH_CPU_INDEX) unreachable: torch from the default index" >&2; \
	fi

test: $(STAMP)
	SPHEREML_NO_DOWNLOAD=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

# Everything but the chapters (notebook), other processes (subprocess), single tests over ~10 s (slow) and the
# browser: the loop to run while editing the library; `make test` before committing.
test-fast: $(STAMP)
	SPHEREML_NO_DOWNLOAD=1 $(BIN)/python -m pytest -q -m "not notebook and not subprocess and not slow and not browser" $(PYTEST_ARGS)

# Executes every chapter in profile auto (cpu without a GPU) through the execution cache.
book: $(STAMP)
	SPHEREML_GLUE_FIGURES=1 $(BIN)/jupyter-book build . $(JB_FLAGS)
	@echo "open _build/html/index.html"

# Smoke build (CI): reuses the notebooks that `make test` executed (seeded into this cache).
book-smoke: $(STAMP)
	SPHEREML_PROFILE=smoke SPHEREML_GLUE_FIGURES=1 $(BIN)/jupyter-book build . --path-output _build/smoke $(JB_FLAGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks

# Every Triton kernel compiled for an H100 here (benchmarks/sm90.py): registers and spills under the Triton of the GPU
# boxes, installed into .cache/triton-VERSION (TRITON_VERSION=installed: the environment's own).
TRITON_VERSION ?= 3.6.0
sm90: $(STAMP)
	@set -e; extra=; \
	if [ "$(TRITON_VERSION)" != installed ]; then extra=.cache/triton-$(TRITON_VERSION); \
	  test -d $$extra/triton-$(TRITON_VERSION).dist-info || \
	    $(BIN)/pip install -q --no-deps --upgrade --target $$extra "triton==$(TRITON_VERSION)"; fi; \
	TRITON_INTERPRET=0 PYTHONPATH=$$extra$${PYTHONPATH:+:$$PYTHONPATH} $(BIN)/python -m benchmarks.sm90

# Regenerate the paired .ipynb from the MyST sources after editing notebooks/*.md.
sync: $(STAMP)
	$(BIN)/jupytext --sync notebooks/*.md

# The chapters as plain scripts for a GPU box without jupytext or papermill (benchmarks/gpu_check.sh chapters;
# the folder is ignored by git: carry it to the machine).
gpu-scripts: $(STAMP)
	mkdir -p benchmarks/chapters
	for f in notebooks/*.md; do $(BIN)/jupytext --quiet --to py -o benchmarks/chapters/$$(basename $$f .md).py $$f; done

clean:
	rm -rf _build
