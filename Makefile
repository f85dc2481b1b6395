# The two front-door commands are `make run` and `make test`; everything else serves them.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)

.PHONY: run test lint install migrate chaos chaos-long bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

migrate: install
	$(PY) manage.py migrate --noinput

## run: API (gunicorn), one worker and the reaper; embedded PostgreSQL when DATABASE_URL is unset.
run: install
	$(PY) manage.py runstack

## test: the whole suite against the real PostgreSQL and Redis on 127.0.0.1.
test: install
	$(VENV)/bin/ruff check .
	$(PY) manage.py makemigrations --check --dry-run --settings=jobservice.test_settings
	$(VENV)/bin/pytest

lint: install
	$(VENV)/bin/ruff check .

## chaos: the fault suite, short profile (lease 3 s, < 3 min); `make test` runs it too.
## Replay a run with CHAOS_ARGS="--seed N".
chaos: install
	$(PY) -m chaos --profile short $(CHAOS_ARGS)

## chaos-long: the long profile with the SPEC timings (lease 15 s, sweep 5 s); the SLO is asserted.
CHAOS_DURATION ?= 660
CHAOS_RATE ?= 36
chaos-long: install
	$(PY) -m chaos --profile long --duration $(CHAOS_DURATION) --rate $(CHAOS_RATE) $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache .hypothesis
