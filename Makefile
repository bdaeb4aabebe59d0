# Each target does its own set-up: a virtualenv in .venv with the locked
# versions, and a check for Java 17+ (Spark 4 needs it).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-full test-costs lint soak bench bench-full lock java clean

# The JVM class archives are checked every time (a no-op when built): their
# key changes with the JDK, which can change under an unchanged virtualenv.
#
# The project's bytecode is compiled here, ahead (only what changed): where
# Python does not write it at import (PYTHONDONTWRITEBYTECODE, set on the
# machines this project is built on) every process compiled every module it
# imported: 0.15 to 0.25 CPU-s of a `microbatch run`'s imports. Checked by
# the source's hash, not its time: a file copied with its old time still
# runs as written. A file that does not compile (a DAG being written) or a
# folder that cannot be written is named and left to compile at import.
setup: $(STAMP)
	@$(BIN)/python -m compileall -q --invalidation-mode checked-hash spark_jobs plugins dags \
	  || echo "(the files above compile at import instead)"
	@$(BIN)/python -m spark_jobs.demo.warm_jvm

java:
	@command -v java >/dev/null 2>&1 || { echo "Java 17 or newer is required for Spark: apt-get install openjdk-17-jre-headless"; exit 1; }
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1); \
	  if [ "$${v:-0}" -lt 17 ]; then echo "Java $$v found; Spark 4 needs Java 17 or newer"; exit 1; fi

$(STAMP): requirements.lock pyproject.toml | java
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required"' 
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: setup spark-jars
	$(BIN)/python -m spark_jobs.demo

# How many of the slowest tests to list (0: all).
DURATIONS ?= 25
# Test processes (pytest-xdist). The suite is bound by CPU: on 2026-12-02
# its tests took 58 CPU-minutes of 2 cores (docs/testing.md, "Where the time
# goes"). Three processes took 33.4 minutes and stretched every test (their
# wall times summed to 90 minutes against two's 62); earlier, three starved
# the live Airflows' heartbeats (CI: 82 minutes against 76 with two). A test
# file stays in one process (its module fixtures, such as a live Airflow,
# start once).
# TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: setup tools jars lint
	$(BIN)/python -m pytest -q -m "not slow" --durations=$(DURATIONS) -n $(TEST_WORKERS) --dist loadfile

# pyflakes' checks everywhere, and a bound on a library function's size:
# ruff's statement count (pyproject.toml) and 60 lines (dev/function_size.py).
lint: setup
	$(BIN)/ruff check spark_jobs plugins dags dev bench tests jars docker
	$(BIN)/python -m dev.function_size spark_jobs plugins dags

# Pinned JARs fetched once with Maven into ~/.cache/microbatch/jars (nothing
# downloads at run time): delta-spark and Spark's Kafka connector, which every
# Spark session of this project loads (jars/spark/pom.xml), and a real Kafka
# broker for the tests and the bench (jars/kafka/pom.xml).
.PHONY: jars spark-jars maven
maven:
	@command -v mvn >/dev/null 2>&1 || { echo "Maven is required to fetch the pinned JARs (once, at set-up): apt-get install maven"; exit 1; }
spark-jars: setup maven
	@$(BIN)/python jars/fetch.py spark >/dev/null
jars: spark-jars
	@$(BIN)/python jars/fetch.py kafka >/dev/null

# tests/docker needs docker-compose (`config` only, no engine), the storage
# fault tests need strace, the console's browser test needs chromium and the
# Kafka broker's JARs are fetched with maven, the live Airflow keeps its
# metadata in PostgreSQL and its Celery profile uses Redis; CI runs as root on Debian, so
# install what is missing.
.PHONY: tools
tools:
	@missing=""; \
	  command -v docker-compose >/dev/null || missing="$$missing docker-compose"; \
	  command -v strace >/dev/null || missing="$$missing strace"; \
	  command -v chromium >/dev/null || missing="$$missing chromium"; \
	  command -v mvn >/dev/null || missing="$$missing maven"; \
	  ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null || missing="$$missing postgresql"; \
	  command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	  if [ -n "$$missing" ]; then \
	    { [ "$$(id -u)" = 0 ] && apt-get update -q && apt-get install -y -q $$missing; } \
	      || echo "missing:$$missing (apt-get install$$missing); the tests that need them say so"; \
	  fi

# make test runs one test of each class (docs/testing.md lists them); make
# soak runs the long variants of those classes (every crash point with
# every seed, the chaos suites' long runs, the whole type matrix, ...), and
# make test-full both. The soak's tests are as independent as make test's,
# so they run in as many processes, and test by test rather than file by
# file: 29 of its tests are test_chaos.py's, which alone would keep one
# process busy for hours while the other sat idle. (What must not run
# beside itself is grouped: `make airflow`'s tests, `xdist_group`.)
soak: setup tools jars
	$(BIN)/python -m pytest -q -m slow --durations=$(DURATIONS) -n $(TEST_WORKERS) --dist loadgroup

test-full: setup tools jars lint
	$(BIN)/python -m pytest -q --durations=$(DURATIONS) -n $(TEST_WORKERS) --dist loadfile

# make test, each test's cost measured (tests/costs.py): its wall time, the
# CPU of every process it started, the JVMs, CLI runs and Airflow stacks it
# started, its sleeps; the tables docs/testing.md holds, printed at the end.
COSTS ?= .test-costs.jsonl
test-costs: setup tools jars lint
	rm -f $(COSTS)
	$(BIN)/python -m pytest -q -m "not slow" --durations=$(DURATIONS) -n $(TEST_WORKERS) --dist loadfile -p tests.costs --costs $(COSTS)
	$(BIN)/python -m tests.costs $(COSTS)

# The Flink anchor's own virtualenv: PyFlink pins pandas<2.3, pyarrow<21 and
# py4j 0.10.9.7, which clash with ours (bench/anchors/README.md).
FLINK_VENV  := .venv-flink
FLINK_STAMP := $(FLINK_VENV)/.installed

$(FLINK_STAMP): bench/anchors/flink_requirements.txt | java
	test -x $(FLINK_VENV)/bin/python || $(PYTHON) -m venv $(FLINK_VENV)
	$(FLINK_VENV)/bin/python -m pip install -q --upgrade pip
	$(FLINK_VENV)/bin/python -m pip install -q -r bench/anchors/flink_requirements.txt
	touch $(FLINK_STAMP)

# The headline figures beside Structured Streaming in under half an hour:
# one batch, no-op, steady, catch-up, users coming back to 20M keys and a
# fleet of 50 (docs/benchmarks.md, "Headline (make bench)").
bench: setup jars
	$(BIN)/python bench/headline.py

# Side by side with Structured Streaming and Flink, Kafka beside Structured
# Streaming's Kafka source and the two readers of a Delta source
# (docs/benchmarks.md), then micro-batches against continuous snapshots
# (docs/micro-batch-vs-continuous.md), each state layout beside Structured
# Streaming as users come back, event-time windows beside Structured
# Streaming's withWatermark (docs/benchmarks.md), what a fleet at rest costs
# a live Airflow, fleets of 10 to 200 pipelines beside Structured Streaming,
# and a hundred on Celery workers, one of them killed (docs/fleet.md). Under
# 4.5 h. The scripts share bench/harness.py; BENCH_DOCS=DIR writes into a copy
# of docs/ instead.
bench-full: setup jars $(FLINK_STAMP)
	$(BIN)/python bench/run.py
	$(BIN)/python bench/run.py --delta-reads
	$(BIN)/python bench/kafka_vs_ss.py
	$(BIN)/python bench/continuous.py
	$(BIN)/python bench/state_vs_ss.py
	$(BIN)/python bench/windows_vs_ss.py
	$(BIN)/python bench/windows_vs_ss.py --dedup
	$(BIN)/python bench/idle_fleet.py
	$(BIN)/python bench/fleet.py
	$(BIN)/python bench/fleet.py --sizes 100 --engines celery,connect --drain 400 \
		--section "## Celery workers, one killed, beside the shared engine (issue 48, item 5)"

# Re-resolve requirements.txt into requirements.lock in a scratch venv.
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/python -m pip install -q --upgrade pip
	.venv-lock/bin/python -m pip install -q -r requirements.txt
	{ echo "# Every package, pinned: generated by 'make lock' from requirements.txt on Python 3.11."; \
	  echo "# Install with: pip install -r requirements.lock"; \
	  .venv-lock/bin/python -m pip freeze; } > requirements.lock
	rm -rf .venv-lock

clean:
	rm -rf $(VENV) .demo .pytest_cache

# Airflow on this machine: its metadata in a PostgreSQL server of its own
# (dev/postgres.py: kept with the Airflow home, started and stopped with
# Airflow), the project's DAGs and plugins, UI and API on
# http://127.0.0.1:8080 with no login (local use only). EXECUTOR=local (the
# default): `airflow standalone`, LocalExecutor. EXECUTOR=celery: the
# CeleryExecutor with a Redis broker of its own (dev/redis.py) and
# CELERY_WORKERS workers. ENGINE=connect: one Spark Connect server that
# every task uses as a thin client, instead of a JVM in each task.
# PARSE_INTERVAL: seconds between the dag-processor's parses of the DAG files
# (Airflow's 30 by default); a fleet whose specs rarely change sets 300, and
# after adding or editing a spec, or pausing or unpausing a DAG, runs
# `make airflow-cli ARGS="dags reserialize"` to apply it at once
# (docs/fleet.md, "A fleet at rest, all in"). SCHEDULER_IDLE_SLEEP: seconds
# the scheduler sleeps after a loop that found nothing to do (Airflow's 1);
# a watcher's run may wait up to that long to be made, and 5 s brought an
# idle fleet no measured gain (docs/fleet.md, "A fleet at rest, all in"). One
# Ctrl-C stops everything, a
# running batch included (dev/airflow.py says how).
AIRFLOW_ENV = AIRFLOW_HOME=$(LOCAL_AIRFLOW_HOME) \
	AIRFLOW__CORE__DAGS_FOLDER=$(CURDIR)/dags \
	AIRFLOW__CORE__PLUGINS_FOLDER=$(CURDIR)/plugins \
	AIRFLOW__CORE__LOAD_EXAMPLES=False \
	AIRFLOW__CORE__EXECUTOR=LocalExecutor \
	AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS=True \
	$(TASK_IMPORTS_ONCE) \
	AIRFLOW__API__HOST=127.0.0.1 \
	AIRFLOW__API__PORT=$(AIRFLOW_PORT) \
	AIRFLOW__CORE__EXECUTION_API_SERVER_URL=http://127.0.0.1:$(AIRFLOW_PORT)/execution/ \
	$(if $(PARSE_INTERVAL),AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL=$(PARSE_INTERVAL)) \
	$(if $(SCHEDULER_IDLE_SLEEP),AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME=$(SCHEDULER_IDLE_SLEEP)) \
	PATH=$(CURDIR)/$(BIN):$$PATH
AIRFLOW_PORT ?= 8080
# The LocalExecutor's workers start from a forkserver that imported what a
# task imports (plugins/microbatch_airflow/task_imports.py): each task, forked
# from a worker, has them at no cost (docs/fleet.md, "Where a task's CPU goes").
TASK_IMPORTS_ONCE = AIRFLOW__SCHEDULER__MP_START_METHOD=forkserver \
	AIRFLOW__SCHEDULER__MP_FORKSERVER_PRELOAD=airflow,microbatch_airflow.task_imports
LOCAL_AIRFLOW_HOME ?= $(CURDIR)/.airflow
AIRFLOW_DB = $(BIN)/python -m dev.postgres
EXECUTOR ?= local
CELERY_WORKERS ?= 2
ENGINE ?= local
CONNECT_PORT ?= 15002
# More JVM options for the Connect server, after its own C1-only one
# (spark_jobs/engine/connect_server.py): "-XX:TieredStopAtLevel=4" brings C2
# back, for a server whose batches are large (docs/fleet.md).
CONNECT_JAVA_OPTIONS ?=
# Empty: Airflow's own setting (30 s unless airflow.cfg or the environment says otherwise).
PARSE_INTERVAL ?=
SCHEDULER_IDLE_SLEEP ?=
AIRFLOW_STOP_GRACE ?= 30

.PHONY: airflow airflow-cli
airflow: setup spark-jars
	@$(AIRFLOW_ENV) $(BIN)/python -m dev.airflow $(LOCAL_AIRFLOW_HOME) --executor $(EXECUTOR) \
	  --workers $(CELERY_WORKERS) --engine $(ENGINE) --connect-port $(CONNECT_PORT) \
	  --connect-java-options="$(CONNECT_JAVA_OPTIONS)" --grace $(AIRFLOW_STOP_GRACE)

# Run any airflow command against the same local instance: make airflow-cli ARGS="dags list"
# (It starts the database if `make airflow` is not running, and leaves it running.)
airflow-cli: setup
	@url=$$($(AIRFLOW_DB) start $(LOCAL_AIRFLOW_HOME)) || exit 1; \
	$(AIRFLOW_ENV) AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=$$url $(BIN)/airflow $(ARGS)
