# The two commands of the README. Both create .venv/ on first use.
# torch is pinned through constraints.txt (PIP_CONSTRAINT, so isolated builds see it too):
# on these machines torch==2.13.0 is a local CPU wheel; anything else pulls GBs of CUDA.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export OMP_NUM_THREADS ?= 1
export TORCHINDUCTOR_COMPILE_THREADS ?= 1
# DeepSpeed's JIT-built CPU ops live inside the venv: built once per checkout, at install
# (importing atorch points TORCH_EXTENSIONS_DIR there too).
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions
# The venv's tools first: the op is built and later checked with the venv's ninja (a system ninja
# of another version reads the build log differently and rebuilds everything, for minutes).
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: install test test-fast demo clean

$(VENV)/.installed: setup.py requirements.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) scripts/prebuild_deepspeed_ops.py
	touch $@

install: $(VENV)/.installed

# The type check (mypy.ini: the whole package, the core interface strictly), then every test: the
# pure-logic ones on both cores (pytest-xdist; 100 s instead of 157 s here), then the ones that spawn
# ranks or launch jobs one at a time (each already uses the cores; side by side they would contend
# with their own collective timeouts); the 25 slowest are listed, to see where the suite's time goes.
test: install
	$(PY) -m mypy atorch
	$(PY) -m pytest tests/unit -n 2
	$(PY) -m pytest tests --ignore=tests/unit --durations=25

# Pure-logic tests only (milliseconds each).
test-fast: install
	$(PY) -m pytest tests/unit

demo: install
	$(PY) -m atorch.distributed.run --nproc_per_node 2 scripts/demo.py

clean:
	rm -rf $(VENV) build *.egg-info
