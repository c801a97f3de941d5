# hookscope developer entry points. Each target creates .venv (pinned) when missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO   := $(VENV)/.installed-demo

.PHONY: demo test test-fast lint bench docs clean venv

# pip keeps no second copy of the wheels it downloads (torch's CUDA build and its libraries are
# about 5.5 GB in the venv; a cache would double that on a fresh machine with a small disk)
export PIP_NO_CACHE_DIR := 1

venv: $(STAMP)

$(STAMP): pyproject.toml requirements-dev.txt requirements-nodeps.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

# the demo needs only hookscope[viz,cli] (a few minutes less of pip than the dev set)
$(DEMO): pyproject.toml requirements-demo.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-demo.txt
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

demo: $(DEMO)
	$(VENV)/bin/hookscope demo

# the suite in TEST_WORKERS processes (pytest-xdist), a test file per process at a time (module
# fixtures built once); TEST_WORKERS=0 runs it in this process
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples docs
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples docs
	$(VENV)/bin/lint-imports
	$(PY) -m ruff format --check src tests benchmarks examples docs

# the site: guides, executed tutorials, the API reference from hookscope.__all__; warnings are errors
DOCS_OUT := docs/_build/html
docs: $(STAMP)
	MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m sphinx -W --keep-going -b html \
		-d docs/_build/doctrees docs $(DOCS_OUT)
	@echo "site: $(DOCS_OUT)/index.html"

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache docs/_build docs/api \
		docs/auto_tutorials
