# mlfabric — the two commands: `make demo` and `make test`.
# Both create .venv if missing, install torch first (a CPU build where one is available
# locally, so pip does not fetch CUDA wheels), then the package with its dev extras.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test test-unit test-local test-emu install system-deps compiler clean

# The emulator needs iproute2 (ip, tc). As root on Debian, install it when missing; elsewhere
# the emulation tests skip and `mlfabric emu doctor` says what is missing.
system-deps:
	@if ! command -v tc >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2; \
	  else echo "note: iproute2 (ip, tc) missing: emulation tests will be skipped"; fi; \
	fi

# The flow solver's compiled kernel (mlfabric/flow/_fill.c) needs a C compiler and the
# Python headers at install time; without them the install still works (numpy fallback),
# but the simulator is several times slower and test_native_kernel_is_built fails.
compiler:
	@if ! command -v cc >/dev/null 2>&1 || ! $(PYTHON) -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc python3-dev; \
	  else echo "note: no C compiler or Python headers: the flow solver falls back to numpy"; fi; \
	fi

$(STAMP): pyproject.toml setup.py mlfabric/flow/_fill.c mlfabric/ps/scheduler/_sched.c | compiler
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mlfabric demo

test: $(STAMP) system-deps
	$(PY) -m pytest -q -p no:cacheprovider tests

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-local: $(STAMP)
	$(PY) -m pytest -q tests/local

test-emu: $(STAMP) system-deps
	$(PY) -m pytest -q tests/emu

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache mlfabric/flow/_fill*.so
