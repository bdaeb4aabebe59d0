# The Airflow image: every Airflow component (api-server, scheduler,
# dag-processor, triggerer) runs from it, and the scheduler's LocalExecutor
# runs the microbatch job (the Spark driver) in it.
# Build context: the repository root (see docker-compose.yml).

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
    && mkdir -p /opt/microbatch /opt/delta \
    && chown airflow:0 /opt/microbatch /opt/delta
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

# delta-spark for Spark 4.2 / Scala 2.13 (Delta 4.x names its artifacts per
# Spark line: delta-spark_<spark major.minor>_<scala>), so that Spark-native
# reads of the state, ledger and quarantine tables work in this image.
# pip-installed pyspark reads spark-defaults.conf from SPARK_CONF_DIR.
ARG DELTA_SPARK_PACKAGE=io.delta:delta-spark_4.2_2.13:4.4.0
ENV SPARK_CONF_DIR=/opt/microbatch/spark-conf
COPY --chown=airflow:0 docker/fetch-delta-jars.sh /opt/microbatch/fetch-delta-jars.sh
RUN /opt/microbatch/fetch-delta-jars.sh spark-submit "${DELTA_SPARK_PACKAGE}" /opt/delta/jars \
        "${SPARK_CONF_DIR}/spark-defaults.conf"

# DAGs, plugins and the docker example pipeline (docker-compose.yml also
# mounts docker/pipelines over it, so specs can be edited without a rebuild).
COPY --chown=airflow:0 dags /opt/airflow/dags
COPY --chown=airflow:0 plugins /opt/airflow/plugins
COPY --chown=airflow:0 docker/pipelines /opt/microbatch/pipelines
ENV MICROBATCH_PIPELINES_DIR=/opt/microbatch/pipelines

# Mount point of the airflow-auth volume (simple auth manager passwords):
# created here so a new volume starts out owned by the airflow user.
RUN mkdir -p /opt/airflow/auth
