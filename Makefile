# mlfabric — the two commands: `make demo` and `make test`.
# Both create .venv if missing, install torch first (a CPU build where one is available
# locally, so pip does not fetch CUDA wheels), then the package with its dev extras.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test test-unit test-local install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mlfabric demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

test-unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

test-local: $(STAMP)
	$(PY) -m pytest -q tests/local

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
