# Two commands on a fresh machine: `make demo` and `make test`. Each creates .venv when missing and
# installs what is missing; nothing at test or demo time needs the network beyond the package registry.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch comes from whichever index pip is configured with; to choose the build (CPU-only, a CUDA version),
# install torch into .venv first (README "Install on a GPU machine"): an importable torch is never replaced.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.hzo-installed
SOURCES := pyproject.toml CMakeLists.txt $(wildcard csrc/*.cpp csrc/*.h)
# The editable install maps each module name to its file when it is installed, so a module added,
# removed or turned into a package (ops.py -> ops/) needs a reinstall: the list is a prerequisite,
# rewritten only when it changes.
MODULES := $(sort $(wildcard hf_zero_offload/*.py hf_zero_offload/*/*.py))
MODULE_LIST := $(VENV)/.hzo-modules
PYTEST_ARGS ?=

.PHONY: install test test-all bench demo gpu-wheels clean FORCE

$(PY):
	$(PYTHON) -m venv $(VENV)

$(MODULE_LIST): FORCE | $(PY)
	@echo '$(MODULES)' | cmp -s - $@ || echo '$(MODULES)' > $@

$(STAMP): $(SOURCES) $(MODULE_LIST) | $(PY)
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

# Each target line of a benchmark says met / NOT MET / not meaningful here (with the reason).
bench: $(STAMP)
	$(PY) -m benchmarks.kernel.adam_step
	$(PY) -m benchmarks.engine.offload_step

demo: $(STAMP)
	$(PY) examples/seq2seq/run_demo.py

# Wheels for what the GPU machine's image lacks (it has no network): carry .gpu_wheels with
# benchmarks/gpu/check.sh, which installs them from there. pip resolves markers for the Python running it,
# so pytest's dependencies below 3.11 (tomli, exceptiongroup) are named, as pure wheels, for an older image.
gpu-wheels: | $(PY)
	$(PY) -m pip download -q -d .gpu_wheels pytest pytest-timeout
	$(PY) -m pip download -q -d .gpu_wheels --only-binary=:all: --no-deps --python-version 3.10 \
	  --implementation py --abi none --platform any tomli exceptiongroup typing_extensions

clean:
	rm -rf build output $(STAMP)
