# GNNPipe: two commands, `make run` and `make test` (README). Both build the
# virtual environment first; it is rebuilt when the pins or pyproject change.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CORES  ?= all
PYTEST_ARGS ?=
# The optional DGL oracle lives outside the clone: it is large and slow to build.
DGL_VENV ?= $(HOME)/.cache/gnnpipe/dgl-venv

.PHONY: run test test-fast lint dgl-env test-dgl bench clean

$(STAMP): pyproject.toml requirements/cpu.lock.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.lock.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

venv: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/snakemake --cores $(CORES) --configfile config/config.yaml

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/snakemake --lint --configfile config/config.yaml

$(DGL_VENV)/.installed: requirements/dgl.lock.txt
	$(PYTHON) -m venv $(DGL_VENV)
	$(DGL_VENV)/bin/python -m pip install -q --upgrade "pip<25"
	$(DGL_VENV)/bin/python -m pip install -q -r requirements/dgl.lock.txt
	touch $@

dgl-env: $(DGL_VENV)/.installed

test-dgl: $(DGL_VENV)/.installed
	PYTHONPATH=src $(DGL_VENV)/bin/python -m pytest -m dgl tests/test_dgl_parity.py $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf results logs .snakemake
