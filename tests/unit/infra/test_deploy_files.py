"""Deployment files checked statically (no Docker engine runs here): they parse, every command is
a real entry point of this project with flags its parser accepts, and every LAZYSERVE_* variable
is a setting the code reads. The same processes are started for real by the integration tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from services.cli import build_parser
from services.decode.settings import DecodeSettings
from services.prefill.settings import PrefillSettings
from services.router.settings import GatewaySettings
from shared.settings import EngineSettings

ROOT = Path(__file__).resolve().parents[3]
PREFIXES = {
    "LAZYSERVE_DECODE_": DecodeSettings,
    "LAZYSERVE_PREFILL_": PrefillSettings,
    "LAZYSERVE_GATEWAY_": GatewaySettings,
}
ALIASES = {"LAZYSERVE_REDIS_URL", "LAZYSERVE_INTERNAL_TOKEN"}  # read by every service (validation_alias)


def _known(name: str) -> bool:
    if name in ALIASES:
        return True
    for prefix, settings in PREFIXES.items():
        if name.startswith(prefix):
            return name.removeprefix(prefix).lower() in settings.model_fields
    if name in ("LAZYSERVE_CACHE_DIR",):
        return True
    return name.removeprefix("LAZYSERVE_").lower() in EngineSettings.model_fields


def _env_names(env) -> list[str]:
    if isinstance(env, dict):
        return list(env)
    return [item["name"] for item in env or []]


def _check_lazyserve_command(args: list[str]) -> None:
    """args as given to the `lazyserve` entry point: the real parser must take them all."""
    parsed, rest = build_parser().parse_known_args(args)
    assert parsed.command in {"gateway", "decode-worker", "prefill-worker", "up", "run-batch"}, args
    assert not rest, f"flags the CLI does not know: {rest}"


def _compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_services_and_healthchecks():
    services = _compose()["services"]
    assert {"redis", "ray-head", "prefill-node", "prefill", "decode", "gateway", "otel-collector", "jaeger"} <= set(
        services
    )
    for name in ("redis", "ray-head", "decode", "gateway"):
        assert "healthcheck" in services[name], name


@pytest.mark.parametrize("name", ["prefill", "decode", "gateway"])
def test_compose_commands_are_entry_points(name):
    service = _compose()["services"][name]
    assert service["build"]["dockerfile"] == "infra/Dockerfile"
    assert "entrypoint" not in service  # the image's ENTRYPOINT: lazyserve
    _check_lazyserve_command(service["command"])


def test_compose_ray_nodes_start_ray_with_the_prefill_resource():
    services = _compose()["services"]
    head, node = services["ray-head"], services["prefill-node"]
    assert head["entrypoint"] == ["ray"] and head["command"][:2] == ["start", "--head"]
    assert node["entrypoint"] == ["ray"] and any('"prefill"' in arg for arg in node["command"])
    assert any(arg.startswith("--prefill-resource") for arg in services["prefill"]["command"])
    for service in (head, node, services["prefill"]):
        assert service["environment"]["RAY_AUTH_MODE"] == "token"


def test_compose_environment_names_are_settings():
    for name, service in _compose()["services"].items():
        for variable in _env_names(service.get("environment")):
            if variable.startswith("LAZYSERVE_"):
                assert _known(variable), f"{name}: {variable} is not a setting the code reads"


def test_compose_ports_match_the_commands():
    services = _compose()["services"]
    gateway_port = int(next(a for a in services["gateway"]["command"] if a.startswith("--port=")).split("=")[1])
    assert services["gateway"]["ports"] == [f"{gateway_port}:{gateway_port}"]
    assert str(gateway_port) in " ".join(services["gateway"]["healthcheck"]["test"])
    decode_port = next(a for a in services["decode"]["command"] if a.startswith("--port=")).split("=")[1]
    assert f"localhost:{decode_port}" in " ".join(services["decode"]["healthcheck"]["test"])
    collector = yaml.safe_load((ROOT / "infra/otel-collector.yaml").read_text())
    endpoint = services["decode"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert endpoint.endswith(collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].split(":")[1])


def test_dockerfile_entrypoint_is_the_project_script():
    dockerfile = (ROOT / "infra/Dockerfile").read_text()
    assert 'ENTRYPOINT ["lazyserve"]' in dockerfile
    assert re.search(r"^FROM .* AS build$", dockerfile, re.M) and re.search(r"^FROM .* AS runtime$", dockerfile, re.M)
    assert "ARG TORCH_SPEC" in dockerfile and "ARG TORCH_INDEX" in dockerfile
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'lazyserve = "services.cli:main"' in pyproject


def _containers(document):
    spec = document.get("spec", {})
    templates = []
    if document["kind"] == "RayCluster":
        templates.append(spec["headGroupSpec"]["template"])
        templates += [group["template"] for group in spec["workerGroupSpecs"]]
    elif document["kind"] == "Deployment":
        templates.append(spec["template"])
    return [c for t in templates for c in t["spec"]["containers"]]


def test_kubernetes_manifests():
    documents = [
        d for path in sorted((ROOT / "infra/k8s").glob("*.yaml")) for d in yaml.safe_load_all(path.read_text()) if d
    ]
    kinds = {d["kind"] for d in documents}
    assert {"RayCluster", "Deployment", "Service", "ConfigMap"} <= kinds
    [cluster] = [d for d in documents if d["kind"] == "RayCluster"]
    [group] = cluster["spec"]["workerGroupSpecs"]
    assert "prefill" in group["rayStartParams"]["resources"]
    roles = set()
    for document in documents:
        for container in _containers(document):
            if container["image"].startswith("lazyserve") and "args" in container:
                _check_lazyserve_command(container["args"])
                roles.add(container["args"][0])
            for variable in _env_names(container.get("env")):
                if variable.startswith("LAZYSERVE_"):
                    assert _known(variable), f"{container['name']}: {variable}"
    assert roles == {"prefill-worker", "decode-worker", "gateway"}


def test_ray_cluster_launcher_config():
    config = yaml.safe_load((ROOT / "infra/ray/cluster.yaml").read_text())
    assert config["provider"]["type"] == "local"
    assert any('"prefill": 1' in command for command in config["worker_start_ray_commands"])
    assert all(
        "RAY_AUTH_MODE=token" in c
        for c in config["head_start_ray_commands"] + config["worker_start_ray_commands"]
        if "ray start" in c
    )


def test_an_unknown_variable_would_be_caught():
    assert not _known("LAZYSERVE_DECODE_PROT")
    assert not _known("LAZYSERVE_GATEWAY_LOCAL_TRESHOLD")
    with pytest.raises(AssertionError):
        _check_lazyserve_command(["gateway", "--prot=8000"])


def test_decode_workers_are_given_time_to_drain():
    """SIGTERM drains a decode worker for drain_seconds, then hands its streams over: the stack must
    not SIGKILL it first (compose's default grace is 10 s, Kubernetes' 30 s)."""
    from services.decode.settings import DecodeSettings

    drain = DecodeSettings.model_fields["drain_seconds"].default
    compose = _compose()["services"]["decode"]["stop_grace_period"]
    assert compose.endswith("s") and float(compose[:-1]) > drain
    deployments = [
        d for d in yaml.safe_load_all((ROOT / "infra/k8s/services.yaml").read_text()) if d and d["kind"] == "Deployment"
    ]
    [decode] = [d for d in deployments if d["metadata"]["name"] == "lazyserve-decode"]
    assert decode["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
