"""Unit: the deployment files a CI run can check without Docker or a cluster (issue 43).
deploy/k8s/loraplex.yaml validates against the Kubernetes JSON schemas (kubernetes-validate
ships them: offline; strict, so a misspelt field fails) and its parts refer to each other;
docker-compose.yml gives the API and the worker every setting that has no safe default (from
service.core.config.Settings and the daemon's flags), pointing at the compose services."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from service.core.config import Settings

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s" / "loraplex.yaml"
COMPOSE = REPO / "docker-compose.yml"
# The oldest Kubernetes the example claims to run on, and the newest the package knows.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
# The daemon's settings (worker/config.py) that name another machine or a secret.
DAEMON_REQUIRED = {"LORAPLEX_SERVICE_URL", "LORAPLEX_WORKER_TOKEN", "LORAPLEX_REDIS_URL",
                   "LORAPLEX_WORK_DIR"}
PRIVATE_DEFAULT = re.compile(r"127\.0\.0\.1|localhost|^dev-")


def _no_safe_default(default: Any) -> bool:
    """A default that only fits a developer's machine: a loopback URL, a dev token, a relative
    path (var/...: the directory the process started in)."""
    if isinstance(default, Path):
        return not default.is_absolute()
    return isinstance(default, str) and bool(PRIVATE_DEFAULT.search(default))


def required_settings() -> set[str]:
    """The API's settings a deployment must set: LORAPLEX_<NAME>."""
    return {f"LORAPLEX_{name.upper()}" for name, field in Settings.model_fields.items()
            if field.is_required() or _no_safe_default(field.default)}


def dockerfile_env(target: str) -> dict[str, str]:
    """The ENV of a Dockerfile stage, with what it inherits (FROM <stage>)."""
    stages: dict[str, tuple[str | None, dict[str, str]]] = {}
    name = None
    for line in (REPO / "Dockerfile").read_text().replace("\\\n", " ").splitlines():
        if m := re.match(r"FROM (\S+)(?: AS (\S+))?", line):
            name = m[2] or m[1]
            stages[name] = (m[1] if m[1] in stages else None, {})
        elif line.startswith("ENV ") and name is not None:
            stages[name][1].update(re.findall(r"(\w+)=(\S+)", line[4:]))
    env: dict[str, str] = {}
    stage: str | None = target
    while stage is not None:
        parent, own = stages[stage]
        env = {**own, **env}
        stage = parent
    return env


def _documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_required_settings_are_the_ones_without_a_safe_default() -> None:
    """What the checks below ask of every deployment, derived from Settings (a new setting
    with a loopback, dev or relative default joins by itself)."""
    assert {"LORAPLEX_DATABASE_URL", "LORAPLEX_REDIS_URL", "LORAPLEX_WORKER_TOKEN",
            "LORAPLEX_STORAGE_DIR", "LORAPLEX_MODELS_FILE",
            "LORAPLEX_WANDB_DIR"} == required_settings()


# -- Kubernetes ------------------------------------------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifests_validate_against_the_kubernetes_schemas(version: str) -> None:
    docs = _documents(K8S)
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "DaemonSet"]
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {where}: {exc.message}")


def test_the_validator_catches_a_wrong_type_and_a_misspelt_field() -> None:
    deployment = _documents(K8S)[0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    for bad in ({"ports": [{"containerPort": "8000"}]}, {"envfrom": []}):
        broken = yaml.safe_load(yaml.safe_dump(deployment))
        broken["spec"]["template"]["spec"]["containers"][0] = {**container, **bad}
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_k8s_parts_refer_to_each_other_and_to_the_app(app_paths: set[str]) -> None:
    api, service, worker = _documents(K8S)
    for workload in (api, worker):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pod = api["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert service["spec"]["selector"].items() <= api["spec"]["template"]["metadata"][
        "labels"].items()
    ports = {p["containerPort"] for p in container["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] in app_paths
        assert container[probe]["httpGet"]["port"] in ports
    # the image's paths (Dockerfile ENV) lie on the volumes mounted there
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    env = dockerfile_env("api")
    for setting in ("LORAPLEX_STORAGE_DIR", "LORAPLEX_MODELS_FILE", "LORAPLEX_WANDB_DIR"):
        assert any(env[setting].startswith(m + "/") for m in mounts), (setting, mounts)
    # the worker reaches the API through the Service, with the API's secret
    worker_env = {e["name"]: e.get("value") for e in
                  worker["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert urlsplit(worker_env["LORAPLEX_SERVICE_URL"]).hostname == service["metadata"]["name"]
    secrets = {ref["secretRef"]["name"] for doc in (api, worker)
               for c in doc["spec"]["template"]["spec"]["containers"] for ref in c["envFrom"]}
    assert len(secrets) == 1


def test_the_env_example_holds_every_required_setting() -> None:
    """The k8s secret's keys and a systemd EnvironmentFile are "as in" this file."""
    example = (REPO / "deploy" / "loraplex.env.example").read_text()
    keys = set(re.findall(r"^(LORAPLEX_\w+)=", example, re.M))
    assert required_settings() | DAEMON_REQUIRED <= keys
    assert keys <= known_variables(), keys - known_variables()


# -- docker compose --------------------------------------------------------------------------

def known_variables() -> set[str]:
    daemon = set(re.findall(r"\"(LORAPLEX_\w+)\"", (REPO / "worker" / "config.py").read_text()))
    return {f"LORAPLEX_{name.upper()}" for name in Settings.model_fields} | daemon


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # `<<: *anchor` merges as compose does


def _service_env(compose: dict, name: str, target: str) -> dict[str, str]:
    """What the container sees: the image's ENV, then the service's environment."""
    return {**dockerfile_env(target), **compose["services"][name]["environment"]}


def test_compose_gives_the_api_and_the_worker_every_required_setting() -> None:
    compose = _compose()
    api = _service_env(compose, "api", "api")
    worker = _service_env(compose, "worker", "worker")
    assert not required_settings() - api.keys(), required_settings() - api.keys()
    assert not DAEMON_REQUIRED - worker.keys(), DAEMON_REQUIRED - worker.keys()
    for env in (api, worker):
        unknown = {k for k in env if k.startswith("LORAPLEX_")} - known_variables()
        assert not unknown, unknown
        # a secret comes from .env, and compose refuses to start without it
        assert re.fullmatch(r"\$\{LORAPLEX_WORKER_TOKEN:\?[^}]+\}", env["LORAPLEX_WORKER_TOKEN"])
    for setting in ("LORAPLEX_DATABASE_URL", "LORAPLEX_REDIS_URL", "LORAPLEX_WORKER_TOKEN"):
        assert api[setting] == worker.get(setting, api[setting]), setting


def test_compose_urls_name_its_own_services_and_their_credentials() -> None:
    compose = _compose()
    services = compose["services"]
    api = _service_env(compose, "api", "api")
    db = urlsplit(api["LORAPLEX_DATABASE_URL"])
    postgres = services[db.hostname]
    assert postgres["image"].startswith("postgres:")
    pg_env = postgres["environment"]
    assert (db.username, db.password, db.path.lstrip("/")) == (
        pg_env["POSTGRES_USER"], pg_env["POSTGRES_PASSWORD"], pg_env["POSTGRES_DB"])
    assert services[urlsplit(api["LORAPLEX_REDIS_URL"]).hostname]["image"].startswith("redis:")
    for dependency in (db.hostname, urlsplit(api["LORAPLEX_REDIS_URL"]).hostname):
        assert services["api"]["depends_on"][dependency] == {"condition": "service_healthy"}
    # the worker reaches the API on the port it publishes
    service_url = urlsplit(services["worker"]["environment"]["LORAPLEX_SERVICE_URL"])
    assert service_url.hostname == "api"
    assert any(p.endswith(f":{service_url.port}") for p in services["api"]["ports"])


def test_compose_paths_lie_on_its_volumes() -> None:
    compose = _compose()
    for name, target, settings in (
            ("api", "api", ("LORAPLEX_STORAGE_DIR", "LORAPLEX_MODELS_FILE", "LORAPLEX_WANDB_DIR")),
            ("worker", "worker", ("LORAPLEX_WORK_DIR",))):
        env = _service_env(compose, name, target)
        mounts = [v.split(":")[1] for v in compose["services"][name]["volumes"]]
        for setting in settings:
            path = env[setting]
            assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts), (
                name, setting, path, mounts)
    named = {v.split(":")[0] for s in compose["services"].values() for v in s.get("volumes", [])
             if not v.startswith((".", "/"))}
    assert named <= set(compose["volumes"]), named - set(compose["volumes"])


@pytest.fixture(scope="module")
def app_paths() -> set[str]:
    from service.api.openapi import render

    return set(yaml.safe_load(render())["paths"])
