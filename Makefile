# The two front-door commands are `make run` and `make test`; everything else serves them.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# Bytecode is cached even where the environment says not to (some base images set
# PYTHONDONTWRITEBYTECODE=1): without it every process the suite starts (workers, reapers,
# servers, pytest itself with its assertion rewriting) compiled the project again, about
# a third of an end-to-end test's CPU (D391). The caches are git- and docker-ignored.
unexport PYTHONDONTWRITEBYTECODE
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)

.PHONY: run test docs lint install tools migrate browser chaos chaos-long bench crash-bench webhooks durable-loop \
	table-health table-growth fillfactor archive-bench fuzz schedules-long workflow-bench workflow-linear flow-batch \
	stop-db reset-db clean \
	fresh-project test-matrix test-long

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# A truncated index page from the package index fails pip at once: the upgrade of pip
	# itself is optional, and the project's install is tried a second time.
	$(PY) -m pip install --quiet --upgrade pip || echo "pip not upgraded: the venv's own is used"
	$(PY) -m pip install --quiet -e '.[deploy,dev,docs]' || $(PY) -m pip install --quiet -e '.[deploy,dev,docs]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

# The bench's own extra (matplotlib for the scaling plot), on top of install.
BENCH_STAMP := $(VENV)/.bench-$(shell cat pyproject.toml | md5sum | cut -c1-12)
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[deploy,dev,docs,bench]'
	rm -f $(VENV)/.bench-*
	touch $(BENCH_STAMP)

# $(call apt_tool,COMMAND,PACKAGE,WITHOUT IT): install a Debian package as root when its
# command is missing (the package lists are refreshed only if the first try fails).
define apt_tool
	@command -v $(1) >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing $(1) (Debian package $(2))"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(2) >/dev/null \
	      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	           apt-get install -y -qq --no-install-recommends $(2) >/dev/null; } \
	      || echo "could not install $(1): $(3)"; \
	  else \
	    echo "$(1) missing (apt-get install $(2)): $(3)"; \
	  fi; }
endef

## tools: system tools the tests call. promtool (Debian package prometheus) checks the alert rules;
## wrk (Debian package wrk) is the C load generator of the http-single-wrk bench scenario;
## haproxy (Debian package haproxy) is the deployment's front (python -m jobservice.proxy).
tools:
	$(call apt_tool,wrk,wrk,http-single-wrk will say NOT MEASURED)
	$(call apt_tool,promtool,prometheus,the promtool checks will be skipped)
	$(call apt_tool,pgbouncer,pgbouncer,the PgBouncer tests will be skipped)
	$(call apt_tool,haproxy,haproxy,the front's slow-client tests and http-front will be skipped)

## migrate: create the database DATABASE_URL names when missing (or the embedded one), migrate.
migrate: install
	$(PY) manage.py ensuredb
	$(PY) manage.py migrate --noinput

## run: API (gunicorn), WORKERS workers and the reaper; embedded PostgreSQL when DATABASE_URL is
## unset (stopped again on exit). Metrics: worker n on 9101 + 100 × (n - 1), the reaper on 9102;
## RUN_ARGS="--bind 127.0.0.1:8001 --metrics-port 9501" moves them.
## The built-in test tasks the README's walk-through submits are opened to clients for `make run`
## only, by name (D196); a deployment opens none. JOBS_PUBLIC_TASKS= in the environment wins.
WORKERS ?= 1
RUN_PUBLIC_TASKS ?= echo,sleep,fail
run: install
	JOBS_PUBLIC_TASKS="$${JOBS_PUBLIC_TASKS-$(RUN_PUBLIC_TASKS)}" \
	  $(PY) manage.py runstack --workers $(WORKERS) $(RUN_ARGS)

## stop-db: stop the embedded PostgreSQL (var/pgdata) that manage.py commands start when
## DATABASE_URL is unset; it keeps running between them (it runs as the user pgserver under root).
stop-db: install
	$(PY) -m jobservice.embedded stop

## reset-db: stop the embedded PostgreSQL and delete its data; the next command starts it empty.
reset-db: install
	$(PY) -m jobservice.embedded reset

## browser: Debian's chromium for the admin's browser tests (Playwright drives /usr/bin/chromium).
browser:
	@test -x /usr/bin/chromium || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }

## PYTEST_ARGS: three worker processes by default, on two cores too (at two, a quarter of
## the CPU sat idle while tests waited for processes, D368; tests/conftest.py groups the tests that
## must share one); PYTEST_ARGS= runs everything in one process, in file order.
PYTEST_ARGS ?= -n 3 --dist loadgroup

## test: the whole suite against the real PostgreSQL and Redis on 127.0.0.1, but for the
## long runs (marker `long`: the quick bench, each documented make target at its quickest,
## the quick table growth, the fresh-project and host-project installs), which
## `make test-long` runs; .ci/run runs both.
test: install browser tools
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	DATABASE_URL=$${DATABASE_URL:-postgres://root@127.0.0.1:5432/postgres} $(PY) manage.py makemigrations --check --dry-run --settings=jobservice.test_settings
	$(VENV)/bin/pytest -m "not long" $(PYTEST_ARGS)

## test-long: the suite's long runs (marker `long`), the rest of what CI runs after make test.
test-long: install browser tools
	$(VENV)/bin/pytest -m long $(PYTEST_ARGS)

## docs: the documentation site from docs/ (mkdocs.yml) into site/, offline, with its search
## index; strict: a broken link or anchor, or a page missing from the navigation, fails it.
## `python -m http.server -d site` serves it (search needs a served site, never the network);
## `.venv/bin/mkdocs serve` shows it on http://127.0.0.1:8000 while you edit.
docs: install
	$(VENV)/bin/mkdocs build --strict --site-dir site

## test-matrix: the app's contract tests on every supported Python x Django cell (noxfile.py,
## docs/django.md "Supported versions"), each in its virtualenv under .nox/ (kept between runs);
## NOX_ARGS="-t py3.13-django6.1" runs one cell. .ci/run runs it after `make test`.
NOX_ARGS ?=
test-matrix: install
	$(VENV)/bin/nox $(NOX_ARGS)

## fuzz: the schema fuzz (schemathesis) with FUZZ_EXAMPLES cases per operation and mode,
## fresh random cases each run (`make test` runs 15, derandomised). FUZZ_EXAMPLES=20 for a quick run.
FUZZ_EXAMPLES ?= 300
fuzz: install
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) FUZZ_RANDOM=1 $(VENV)/bin/pytest -q -s -p no:cacheprovider \
	  tests/api/test_fuzz.py $(FUZZ_ARGS)

## bench: throughput and latency figures against real processes on a scratch database
## (BENCH_ARGS="--scenario drain-2 --baseline main" for a side-by-side run; --quick to smoke-test).
bench: install tools $(BENCH_STAMP)
	$(PY) -m bench $(BENCH_ARGS)

## crash-bench: kill -9 a worker mid-job CRASH_KILLS times (default 20) with the default lease
## and sweep; prints kill -> running on another worker p50/p99/max (from the database clock).
CRASH_KILLS ?= 20
crash-bench: install
	CRASH_KILLS=$(CRASH_KILLS) $(VENV)/bin/pytest -q -s -p no:cacheprovider \
	  tests/test_crash_detection_e2e.py::test_kill_9_mid_job_runs_again_elsewhere_within_seconds

## schedules-long: three runreapers race for every slot of a 1 s interval, a 5 s and a per-minute
## cron for SCHEDULE_E2E_SECONDS (default 120; `make test` runs 25): each slot fires exactly once.
SCHEDULE_E2E_SECONDS ?= 120
schedules-long: install
	SCHEDULE_E2E_SECONDS=$(SCHEDULE_E2E_SECONDS) $(VENV)/bin/pytest -q -s -p no:cacheprovider \
	  tests/test_schedules_e2e.py::test_three_reapers_fire_every_slot_exactly_once
## workflow-bench: a WORKFLOW_NODES-job workflow (default 1000: fan-out 1 → 498 → 1 and a
## 500-deep chain) through two workers; prints last parent's end -> child's claim p50/p99.
WORKFLOW_NODES ?= 1000
workflow-bench: install
	WORKFLOW_NODES=$(WORKFLOW_NODES) $(VENV)/bin/pytest -q -s -p no:cacheprovider \
	  tests/test_workflow_scale_e2e.py
## durable-loop: the issue-45 durable loop: DURABLE_LOOP_TOTAL iterations (default 10000; `make
## test` runs 400) continuing as new every DURABLE_LOOP_EVERY (500), with kill -9 of workers.
DURABLE_LOOP_TOTAL ?= 10000
DURABLE_LOOP_EVERY ?= 500
DURABLE_LOOP_KILLS ?= 6
durable-loop: install
	DURABLE_LOOP_TOTAL=$(DURABLE_LOOP_TOTAL) DURABLE_LOOP_EVERY=$(DURABLE_LOOP_EVERY) \
	  DURABLE_LOOP_KILLS=$(DURABLE_LOOP_KILLS) $(VENV)/bin/pytest -q -s -p no:cacheprovider \
	  tests/test_durable_loop_e2e.py::test_a_long_loop_continues_as_new_under_kill_9
## workflow-linear: create, fail the root of and cancel 1,000-step workflows at the edge cap
## (two shapes), database time and rows touched, beside the dependents trigger of 0012.
WORKFLOW_LINEAR_ARGS ?= --repeat 3 --previous
workflow-linear: install
	$(PY) -m bench.workflow_linear $(WORKFLOW_LINEAR_ARGS)
## flow-batch: one batch of FLOW_BATCH_JOBS no-op jobs (the issue's 100,000) with a callback:
## rows written, run time, callbacks made (exactly one) and their delay after the last job.
FLOW_BATCH_JOBS ?= 100000
flow-batch: install
	$(PY) -m bench.flow_batch --jobs $(FLOW_BATCH_JOBS)
## webhooks: the webhook end-to-end runs (flaky receiver; kill -9 and a Redis restart with the
## stream's consumer group) with WEBHOOK_JOBS jobs: the issue's 1,000 by default, `make test` 200.
WEBHOOK_JOBS ?= 1000
webhooks: install
	WEBHOOK_JOBS=$(WEBHOOK_JOBS) $(VENV)/bin/pytest -q -s -p no:cacheprovider \
	  tests/test_webhooks_e2e.py::test_flaky_receiver_gets_every_event_signed_in_seq_order \
	  tests/test_webhooks_e2e.py::test_kill_9_of_dispatcher_and_worker_and_a_redis_restart_lose_nothing

## table-health: claim latency and table size with N finished jobs, before and after
## prunejobs, in a scratch database of its own (not part of `make test`; N=1000000 takes minutes).
## TABLE_HEALTH_ARGS passes more options (--claims, --queued; see --help).
N ?= 1000000
table-health: install
	$(PY) -m bench.table_health --rows $(N) $(TABLE_HEALTH_ARGS)

## table-growth: today's layout beside the partitioned one, each filled in turn to
## TABLE_GROWTH_JOBS jobs with their history (SQL fill) in a scratch database of its own: claim
## and submission latency, a week's retention, a day's churn, the claim's plan, disk per million.
## 50 M takes hours and ~70 GB per layout (docs/performance/storage.md "Table growth").
TABLE_GROWTH_JOBS ?= 50000000
table-growth: install
	$(PY) -m bench --scenario table-growth --growth-jobs $(TABLE_GROWTH_JOBS) $(TABLE_GROWTH_ARGS)

## fillfactor: the same churn on the hot job table at fillfactor 100, 90 and 70 (HOT share,
## dead tuples, size); FILLFACTOR_JOBS jobs each.
FILLFACTOR_JOBS ?= 50000
fillfactor: install
	$(PY) -m bench --scenario fillfactor --jobs $(FILLFACTOR_JOBS)

## archive-bench: retention of one period of N finished jobs (three history rows each):
## prunejobs by partition (DETACH, Parquet, verify, DROP) against the row-wise DELETE, on
## copies of one scratch database (docs/operations.md "Retention and archive").
archive-bench: install
	$(PY) -m bench.archive_retention --jobs $(N)

## fresh-project: docs/django.md in a startproject project, the wheel installed with its
## dependencies by pip into a clean virtualenv, no extras (`make test` runs it with this
## checkout's dependencies on a path line, and the app from the wheel alone; every cell of
## test-matrix runs it as here).
fresh-project: install
	FRESH_PROJECT_FULL=1 $(VENV)/bin/pytest -q -s -p no:cacheprovider tests/test_fresh_project.py

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
