# The Airflow image: every Airflow component (api-server, scheduler,
# dag-processor, triggerer) runs from it, and the scheduler's LocalExecutor
# runs the microbatch job (the Spark driver) in it.
# Build context: the repository root (see docker-compose.yml).

# The pinned JARs, fetched by the same script from the same POM as `make`
# does natively (jars/fetch.py, jars/spark/pom.xml: delta-spark, Spark's
# Kafka connector and Hadoop's S3A, minus what Spark ships), so both images
# and a native run carry the same set. Maven checks every artifact's checksum.
FROM maven:3.9.11-eclipse-temurin-17 AS jars
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY jars jars
COPY spark_jobs/jar_cache.py spark_jobs/jar_cache.py
RUN folder="$(MICROBATCH_JARS_CACHE=/tmp/jar-cache python3 jars/fetch.py spark)" \
    && mkdir -p /opt/microbatch/jars \
    && cp -r "${folder}" /opt/microbatch/jars/spark

# Same Airflow and Python as requirements.txt / requirements.lock.
FROM apache/airflow:3.3.2-python3.11

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

USER 0
# Spark 4 needs Java 17. The base image is Debian bookworm, which ships
# OpenJDK 17; the man folder is missing in slim images and the JRE's
# post-install step needs it. JAVA_HOME gets an architecture-free path.
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* \
    && ln -s "$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")" /usr/lib/jvm/java-17 \
    && mkdir -p /opt/microbatch \
    && chown airflow:0 /opt/microbatch
ENV JAVA_HOME=/usr/lib/jvm/java-17

# the image's airflow user (uid 50000, group 0)
USER 50000
# Every package at the lock's version. apache-airflow is pinned in the lock
# to the base image's own version, so pip keeps it as it is.
COPY --chown=airflow:0 requirements.lock /opt/microbatch/requirements.lock
RUN pip install --no-cache-dir -r /opt/microbatch/requirements.lock

# The job itself (non-editable; its dependencies came from the lock above).
COPY --chown=airflow:0 pyproject.toml README.md /opt/microbatch/
COPY --chown=airflow:0 spark_jobs /opt/microbatch/spark_jobs
RUN pip install --no-cache-dir --no-deps /opt/microbatch

# The JARs for sessions that query Delta (`default_session(delta=True)`,
# what users' own reads of the state, ledger and quarantine tables use): the
# job finds them through MICROBATCH_SPARK_JARS, as a native run finds them in
# ~/.cache/microbatch/jars; the job's own batch sessions do without them.
COPY --from=jars --chown=airflow:0 /opt/microbatch/jars/spark /opt/microbatch/jars/spark
ENV MICROBATCH_SPARK_JARS=/opt/microbatch/jars/spark

# DAGs, plugins and the docker example pipeline (docker-compose.yml also
# mounts docker/pipelines over it, so specs can be edited without a rebuild).
COPY --chown=airflow:0 dags /opt/airflow/dags
COPY --chown=airflow:0 plugins /opt/airflow/plugins
COPY --chown=airflow:0 docker/pipelines /opt/microbatch/pipelines
# Their bytecode compiled now: a process that cannot write it (a read-only
# image, PYTHONDONTWRITEBYTECODE) would compile them at every import.
RUN python -m compileall -q /opt/airflow/dags /opt/airflow/plugins
ENV MICROBATCH_PIPELINES_DIR=/opt/microbatch/pipelines

# Mount point of the airflow-auth volume (simple auth manager passwords):
# created here so a new volume starts out owned by the airflow user.
RUN mkdir -p /opt/airflow/auth
