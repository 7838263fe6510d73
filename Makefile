# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when missing and
# installs what is missing; nothing at test or demo time needs the network beyond the package registry.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch lies on disk on the build machines; on a GPU host set TORCH_SPEC to the
# CUDA build you want (or install torch into .venv first: an importable torch is never replaced).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.hzo-installed
SOURCES := pyproject.toml CMakeLists.txt $(wildcard csrc/*.cpp csrc/*.h)
PYTEST_ARGS ?=

.PHONY: install test test-all bench demo gpu-wheels clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(SOURCES) | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" cmake ninja
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Opt-in tiers: slow CPU tests, and CUDA tests (skipped without a GPU).
test-all: $(STAMP)
	$(PY) -m pytest -q -m "" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.kernel.adam_step
	$(PY) benchmarks/offload_step.py

demo: $(STAMP)
	$(PY) examples/seq2seq/run_demo.py

# Wheels for what the GPU machine's image lacks (it has no network): carry .gpu_wheels with
# benchmarks/gpu_check.sh, which installs them from there.
gpu-wheels: | $(PY)
	$(PY) -m pip download -q -d .gpu_wheels pytest pytest-timeout

clean:
	rm -rf build output $(STAMP)
