# The Spark image: master, worker and Spark Connect server.
# Build context: the repository root (see docker-compose.yml).

# Same Spark as the pyspark pin, Scala 2.13, Java 17, with Python.
FROM apache/spark:4.2.0-scala2.13-java17-python3-ubuntu

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

USER 0
# PySpark refuses Python workers whose minor version differs from the
# driver's, and the drivers (Airflow image) run Python 3.11 while this
# Ubuntu 22.04 base has 3.10: executors get their own 3.11 in /opt/venv.
# curl: the Delta checksum check below and the healthchecks.
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

# The same delta-spark as the Airflow image, for the Connect server (it is
# the driver of Connect sessions) and for jobs submitted here directly.
ARG DELTA_SPARK_PACKAGE=io.delta:delta-spark_4.2_2.13:4.4.0
COPY docker/fetch-delta-jars.sh /opt/microbatch/fetch-delta-jars.sh
RUN /opt/microbatch/fetch-delta-jars.sh /opt/spark/bin/spark-submit "${DELTA_SPARK_PACKAGE}" \
        /opt/delta/jars /opt/spark/conf/spark-defaults.conf \
    && printf '%s\n' \
        'spark.sql.extensions io.delta.sql.DeltaSparkSessionExtension' \
        'spark.sql.catalog.spark_catalog org.apache.spark.sql.delta.catalog.DeltaCatalog' \
        >> /opt/spark/conf/spark-defaults.conf \
    && chown -R spark:spark /opt/delta /opt/spark/conf

# the image's spark user
USER 185
