# The two commands of the README: `make demo` and `make test`. Both create .venv and install first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# mypy checks aml_app as it installs ([tool.mypy] in pyproject.toml): var/typecheck/aml_app links the files
# of aml_app/ and, as setuptools' package-dir does, the folders agents/ and tables/. Made anew each run.
TYPECHECK_TREE := rm -rf var/typecheck && mkdir -p var/typecheck/aml_app && \
	ln -s $(CURDIR)/aml_app/* $(CURDIR)/agents $(CURDIR)/tables var/typecheck/aml_app/

# Two pytest processes each, a module to each (its fixtures made once): a unit test keeps one core busy,
# and an integration test leaves the cores idle about 45 % of its time, waiting on its brokers' group
# joins, its processes' starts and its deadlines. Each integration process starts its own broker,
# PostgreSQL server and SparkSession.
UNIT_TESTS := tests/unit -n 2 --dist loadfile
INTEGRATION_TESTS := tests/integration -n 2 --dist loadfile

.PHONY: demo test lint bench model clean system-deps

$(STAMP): pyproject.toml docker/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c docker/constraints.txt -e '.[dev]'
	touch $(STAMP)

system-deps:
	@.ci/system-deps

demo: system-deps $(STAMP)
	$(BIN)/aml-app demo

test: system-deps $(STAMP)
	@java -version 2>&1 | head -1
	@chromium --version 2>/dev/null | tail -1 || true
	@ls -d /usr/lib/postgresql/*/bin 2>/dev/null | tail -1 || true
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@$(TYPECHECK_TREE)
	$(BIN)/mypy
	$(BIN)/pytest $(UNIT_TESTS); unit=$$?; $(BIN)/pytest $(INTEGRATION_TESTS); test $$unit -eq 0 -a $$? -eq 0

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@$(TYPECHECK_TREE)
	$(BIN)/mypy

bench: system-deps $(STAMP)
	$(BIN)/python -m bench.gate_overhead
	$(BIN)/python -m bench.gate_latency
	$(BIN)/python -m bench.admin_idle
	$(BIN)/python -m bench.validation_rate
	$(BIN)/python -m bench.fetch_backoff
	$(BIN)/python -m bench.pipeline_throughput
	$(BIN)/python -m bench.spark_batch_cost
	$(BIN)/python -m bench.pipeline_floor
	$(BIN)/python -m bench.api_latency
	$(BIN)/python -m bench.window_query
	$(BIN)/python -m bench.evidence_parse
	$(BIN)/python -m bench.end_to_end
	$(BIN)/python -m bench.training_binning
	$(BIN)/python -m bench.gate_matters
	$(BIN)/python -m bench.partition_skew
	$(BIN)/python -m bench.amlworld_detection
	$(BIN)/python -m bench.model_vs_rules
	$(BIN)/python -m bench.model_spread
	$(BIN)/python -m bench.scaling
	$(BIN)/python -m bench.chaos_soak --seed 1 --duration 240
	$(BIN)/python -m bench.broker_growth
	$(BIN)/python -m bench.edge_growth
	$(BIN)/python -m bench.plot

# Train the AML model (AML_MODEL=amlworld) again from the calibrated simulator: the same file, byte for byte.
model: $(STAMP)
	$(BIN)/aml-app train-model --simulated --out aml_app/detection/amlworld_model.json

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache
