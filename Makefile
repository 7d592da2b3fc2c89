# `make demo` and `make test` install into .venv when it is missing or stale, then run.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mariana-installed
DATA ?= ../shared/data
RUNS ?= runs/demo

.PHONY: install demo test lint format bench clean

$(STAMP): requirements.txt pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	DATA=$(DATA) RUNS=$(RUNS) PY=$(PY) bash scripts/demo.sh

test: $(STAMP)
	$(PY) -m pytest -q --durations=15 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) runs .pytest_cache
