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

.PHONY: run test test-long test-fast test-slurm lint lint-imports dgl-env test-dgl bench clean

$(STAMP): pyproject.toml requirements/cpu.lock.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.lock.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

venv: $(STAMP)

# --rerun-incomplete: a job cut short (Ctrl-C, a killed node) is redone, not a hard stop;
# --show-failed-logs: a failed job's log (its one-line reason) on the terminal, not only in results/logs/
run: $(STAMP)
	$(VENV)/bin/snakemake --cores $(CORES) --rerun-incomplete --show-failed-logs --configfile config/config.yaml

# lint-imports: the layering contracts of pyproject.toml (imports point down), before the tests
# The suite's processes are mostly single-threaded start-ups (python, torch, MLflow imports) that
# leave the second core idle: two pytest workers, a test file each (module fixtures are shared
# within a file: --dist loadfile). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -m "not long" $(XDIST) $(PYTEST_ARGS)

test-long: $(STAMP)
	$(PY) -m pytest -m long $(XDIST) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/snakemake --lint --configfile config/config.yaml

lint-imports: $(STAMP)
	$(VENV)/bin/lint-imports

# The lock is the exact closure, installed --no-deps into a cleared venv (see its header);
# the import at the end fails the build, not the tests, if the environment is broken.
# The stamp is named by the lock's content, not dated by it: the environment is shared by every
# clone and worktree of this machine, and a fresh checkout (a newer lock file, same content)
# must not clear it under another clone's running benchmark.
DGL_STAMP := $(DGL_VENV)/.installed-$(shell sha256sum requirements/dgl.lock.txt | cut -c1-16)
$(DGL_STAMP):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "dgl-env: the DGL lock is for Python 3.11; run make dgl-env PYTHON=python3.11")'
	$(PYTHON) -m venv --clear $(DGL_VENV)
	$(DGL_VENV)/bin/python -m pip install -q --upgrade "pip<25"
	$(DGL_VENV)/bin/python -m pip install -q --no-deps -r requirements/dgl.lock.txt
	$(DGL_VENV)/bin/python -c "import torch, dgl, dgl.nn; print('dgl-env:', 'dgl', dgl.__version__, 'torch', torch.__version__)"
	touch $@

dgl-env: $(DGL_STAMP)

# GNNPIPE_REQUIRE_DGL: in this environment a missing dgl fails the tests instead of skipping them.
test-dgl: $(DGL_STAMP)
	PYTHONPATH=src GNNPIPE_REQUIRE_DGL=1 $(DGL_VENV)/bin/python -m pytest -m dgl tests/test_dgl_parity.py $(PYTEST_ARGS)

# The Slurm profile against a real Slurm: SLURM_UP starts a cluster here, two nodes on this
# machine (root, apt-get; see .ci/slurm-up.sh). On a machine that has a cluster already:
#   make test-slurm SLURM_UP=true GNNPIPE_SLURM_PARTITION=<partition>
# GNNPIPE_REQUIRE_SLURM: a cluster that does not answer fails the test instead of skipping it.
SLURM_UP ?= SLURM_NODES=2 .ci/slurm-up.sh
test-slurm: $(STAMP)
	$(SLURM_UP)
	GNNPIPE_REQUIRE_SLURM=1 $(PY) -m pytest -m slurm tests/test_slurm_real.py $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/run.py

clean:
	rm -rf results logs .snakemake
