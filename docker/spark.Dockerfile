# The Spark image: master, worker and Spark Connect server.
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

# Same Spark as the pyspark pin, Scala 2.13, Java 17, with Python.
FROM apache/spark:4.2.0-scala2.13-java17-python3-ubuntu

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

USER 0
# PySpark refuses Python workers whose minor version differs from the
# driver's, and the drivers (Airflow image) run Python 3.11 while this
# Ubuntu 22.04 base has 3.10: executors get their own 3.11 in /opt/venv.
# curl: the healthchecks.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv curl \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* \
    && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYSPARK_PYTHON=python3.11

# What executors import: Arrow and pandas for Arrow-backed Python work,
# boto3 to read S3, at the lock's versions; the lock constrains everything
# they pull in. spark_jobs itself, because functions shipped from the
# driver are pickled by reference to their module.
COPY requirements.lock /opt/microbatch/requirements.lock
RUN pip install --no-cache-dir --constraint /opt/microbatch/requirements.lock \
        pyarrow==26.0.1 pandas==2.3.3 boto3==1.44.5
COPY pyproject.toml README.md /opt/microbatch/
COPY spark_jobs /opt/microbatch/spark_jobs
RUN pip install --no-cache-dir --no-deps /opt/microbatch

# The same JARs as the Airflow image, for the Connect server (it is the
# driver of Connect sessions, so `format("delta")` runs here) and for jobs
# submitted here directly. spark.jars rather than $SPARK_HOME/jars: they sit
# behind Spark's own class path, so a library Spark also ships stays Spark's.
COPY --from=jars /opt/microbatch/jars/spark /opt/microbatch/jars/spark
RUN printf 'spark.jars %s\n' "$(find /opt/microbatch/jars/spark -name '*.jar' | sort | paste -sd, -)" \
        >> /opt/spark/conf/spark-defaults.conf \
    && printf '%s\n' \
        'spark.sql.extensions io.delta.sql.DeltaSparkSessionExtension' \
        'spark.sql.catalog.spark_catalog org.apache.spark.sql.delta.catalog.DeltaCatalog' \
        >> /opt/spark/conf/spark-defaults.conf \
    && chown -R spark:spark /opt/spark/conf

# the image's spark user
USER 185
