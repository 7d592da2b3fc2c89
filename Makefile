# `make demo` and `make test` install into .venv when it is missing or stale, then run.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mariana-installed
DATA ?= ../shared/data
RUNS ?= runs/demo

.PHONY: install demo test test-fast lint format bench clean browser slurm

# torch's CUDA build and its libraries take about 7.5 GB in .venv, and pip needs room for the wheels
# while it unpacks them: say so up front rather than fail deep inside pip with "No space left on device".
NEED_GB ?= 12

$(STAMP): requirements.txt pyproject.toml setup.py
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	if [ "$$free" -lt $(NEED_GB) ]; then \
		echo "make install: needs about $(NEED_GB) GB free on the disk holding $$(pwd) for .venv (torch and its" \
			"libraries); only $$free GB are free. Free some space (old runs/ folders, pip's cache) and run make again," \
			"or set NEED_GB=N to try with less." >&2; exit 1; fi
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# torch's wheel is large and PyPI downloads get cut off: resume partial downloads, and
	@# retry the whole install (pip's cache keeps the wheels that did arrive).
	@for i in 1 2 3 4; do \
		$(PY) -m pip install -q --resume-retries 20 -r requirements.txt && break; \
		[ $$i = 4 ] && { echo "pip install failed 4 times" >&2; exit 1; }; \
		echo "pip install failed (attempt $$i of 4); retrying in 20 s" >&2; sleep 20; \
	done
	$(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	DATA=$(DATA) RUNS=$(RUNS) PY=$(PY) bash scripts/demo.sh

# tests/test_jobs_ui.py drives the system Chromium (Debian package) through Playwright; install it if missing.
browser:
	@command -v chromium >/dev/null || { SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update && $$SUDO apt-get install -y chromium; }

# tests/test_jobs_slurm.py starts a throwaway single-host Slurm (scripts/slurm-local.sh): Debian's slurm-wlm + munge;
# tests/test_multihost_*.py hosts in network namespaces (scripts/cluster-local.sh): ip (iproute2), nsenter, unshare.
slurm:
	@{ command -v slurmctld || [ -x /usr/sbin/slurmctld ]; } >/dev/null && { command -v munged || [ -x /usr/sbin/munged ]; } >/dev/null && \
		{ command -v ip || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ]; } >/dev/null && command -v nsenter >/dev/null || \
		{ SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); $$SUDO apt-get update && $$SUDO apt-get install -y slurm-wlm munge iproute2 util-linux; }

# Two pytest workers (pytest-xdist), one test file at a time each: module fixtures (the Slurm cluster, shared
# services, a trained run) stay in one process, and one file's waits (process start-ups, rendezvous, polling)
# overlap with the other's work on a 2-core machine. Files with slow tests go first (tests/conftest.py).
PYTEST := $(PY) -m pytest -q --durations=15 -n 2 --dist loadfile --no-loadscope-reorder
test: $(STAMP) browser slurm
	$(PYTEST) tests

# What a developer runs after each change: everything but the accuracy gates (minutes of training each), the
# browser and Slurm tests (system packages) and the multi-host ones (markers in pyproject.toml).
test-fast: $(STAMP)
	$(PYTEST) -m "not accuracy and not browser and not slurm and not multihost" tests

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) runs .pytest_cache
