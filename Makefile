# The two commands of the README: `make demo` and `make test`. Both create .venv and install first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/aml-app demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(STAMP)
	$(BIN)/python -m bench.gate_overhead
	$(BIN)/python -m bench.gate_latency
	$(BIN)/python -m bench.admin_idle
	$(BIN)/python -m bench.plot

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache
