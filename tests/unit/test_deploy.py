"""deploy/: the Kubernetes manifests against the Kubernetes JSON schemas (kubernetes-validate ships them:
nothing is fetched), and every file checked for what makes a deployment work: selectors that match
their pods, the router's selector matching the replicas, probes on /health and /health_generate,
container flags that the real `strata` CLI accepts, and Grafana queries over metrics that exist."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip(
    "yaml", reason="PyYAML is not installed: pip install -e '.[deploy-test]'"
)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSION = "1.33.0"


def manifests() -> list[dict]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def find(kind: str, name: str) -> dict:
    matches = [
        d for d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name
    ]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def parse_cli(argv: list[str]):
    from strata.cli import build_parser

    return build_parser().parse_args(argv)


def serve_configs(argv: list[str]):
    """The server and engine configs `strata <argv>` would run with (ValueError if the flags are wrong)."""
    from strata.config import engine_config_from_args
    from strata.server.launch import server_config_from_args

    args = parse_cli(argv)
    assert args.command == "serve"
    return server_config_from_args(args), engine_config_from_args(args)


def router_config(argv: list[str]):
    from strata.router.cli import config_from_args

    args = parse_cli(argv)
    assert args.command == "router"
    return config_from_args(args)


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    return all(
        labels.get(k) == v
        for k, v in (term.split("=", 1) for term in selector.split(","))
    )


# ------------------------------------------------------------------ Kubernetes


def test_manifests_validate_against_the_kubernetes_schemas():
    kv = pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed: pip install -e '.[deploy-test]'",
    )
    docs = manifests()
    assert {d["kind"] for d in docs} >= {
        "Namespace",
        "Deployment",
        "Service",
        "ServiceAccount",
        "Role",
        "RoleBinding",
    }
    for doc in docs:
        kv.validate(
            doc, K8S_VERSION, strict=True
        )  # raises on an unknown field or a wrong type
    broken = json.loads(json.dumps(find("Deployment", "strata-replica")))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"][
        "port"
    ] = ["http"]
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    listed = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())[
        "resources"
    ]
    assert sorted(listed) == sorted(
        p.name
        for p in (DEPLOY / "k8s").glob("*.yaml")
        if p.name != "kustomization.yaml"
    )


def test_every_deployment_and_service_selects_what_it_means_to():
    docs = manifests()
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    for dep in deployments:
        pod_labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items(), (
            dep["metadata"]["name"]
        )
    for svc in (d for d in docs if d["kind"] == "Service"):
        selected = [
            dep
            for dep in deployments
            if svc["spec"]["selector"].items()
            <= dep["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, (
            f"service {svc['metadata']['name']} selects {len(selected)} deployments"
        )
        port_names = {
            p["name"]
            for c in selected[0]["spec"]["template"]["spec"]["containers"]
            for p in c["ports"]
        }
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names, (svc["metadata"]["name"], port)


def test_replicas_run_strata_serve_with_redis_as_l3_and_health_probes():
    dep = find("Deployment", "strata-replica")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    server, engine = serve_configs(container["args"])
    http = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    assert server.host == "0.0.0.0" and server.port == http
    assert engine.hicache_storage_backend == "redis"
    redis_host, redis_port = re.fullmatch(
        r"redis://([\w-]+):(\d+)/\d+", engine.hicache_storage_path
    ).groups()
    redis_svc = find("Service", redis_host)
    assert int(redis_port) in {p["port"] for p in redis_svc["spec"]["ports"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    liveness = " ".join(container["livenessProbe"]["exec"]["command"])
    assert (
        f"127.0.0.1:{http}/health_generate" in liveness and "STRATA_API_KEY" in liveness
    )
    assert {e["name"] for e in container["env"]} == {
        "STRATA_API_KEY"
    }  # the key never on the command line
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_router_discovers_exactly_the_replica_pods_and_may_only_read_pods():
    router = find("Deployment", "strata-router")
    pod_spec = router["spec"]["template"]["spec"]
    container = pod_spec["containers"][0]
    config = router_config(container["args"])
    assert config.service_discovery == "k8s"
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in manifests()
        if d["kind"] == "Deployment"
    }
    assert [
        name
        for name, labels in pods.items()
        if selector_matches(config.selector, labels)
    ] == ["strata-replica"]
    assert {e["name"] for e in container["env"]} == {
        "STRATA_API_KEY",
        "STRATA_WORKER_API_KEY",
    }
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert (
        "tcpSocket" in container["livenessProbe"]
    )  # not /health: 503 while no replica is up
    # RBAC: the router's service account may get/list/watch pods, and nothing else
    assert (
        pod_spec["serviceAccountName"]
        == find("ServiceAccount", "strata-router")["metadata"]["name"]
    )
    role = find("Role", "strata-router")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    binding = find("RoleBinding", "strata-router")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "strata-router", "namespace": "strata"}
    ]


# ------------------------------------------------------------------ compose, Docker, Grafana


def test_compose_runs_a_router_over_two_replicas_sharing_redis():
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    services = compose["services"]
    replicas = [
        name for name, s in services.items() if s.get("command", [None])[0] == "serve"
    ]
    assert len(replicas) == 2
    for name in replicas:
        server, engine = serve_configs(services[name]["command"])
        assert engine.hicache_storage_backend == "redis"
        assert engine.hicache_storage_path.startswith("redis://redis:")
        assert "redis" in services[name]["depends_on"]
    config = router_config(services["router"]["command"])
    assert sorted(config.worker_urls) == sorted(
        f"http://{name}:{server.port}" for name in replicas
    )
    assert set(services["router"]["depends_on"]) == set(replicas)
    assert set(services["router"]["environment"]) == {
        "STRATA_API_KEY",
        "STRATA_WORKER_API_KEY",
    }
    prometheus = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    targets = {
        t
        for job in prometheus["scrape_configs"]
        for sc in job["static_configs"]
        for t in sc["targets"]
    }
    assert targets == {f"{name}:{server.port}" for name in replicas} | {
        f"router:{config.port}"
    }


def test_dockerfile_builds_the_kernels_and_model_and_runs_unprivileged():
    lines = (DEPLOY / "docker" / "Dockerfile").read_text().splitlines()
    text = "\n".join(lines)

    def line_of(pattern: str) -> int:
        hits = [i for i, ln in enumerate(lines) if re.search(pattern, ln)]
        assert len(hits) == 1, pattern
        return hits[0]

    user = line_of(r"^USER strata$")
    assert "useradd" in text and not re.search(r"^USER root", text, re.M)
    # the install takes requirements.lock's versions, in a stage of its own (its wheels and CA bundle
    # stay out of the image), on the base given as BASE (a registry's image by default)
    assert re.search(r"^ARG BASE=python:3\.11-slim-bookworm$", text, re.M)
    install = line_of(r"pip install .*-c requirements\.lock \.")
    assert (
        line_of(r"^FROM \$\{BASE\} AS install$")
        < install
        < line_of(r"^FROM \$\{BASE\}$")
    )
    assert line_of(r"^COPY --from=install /opt/venv /opt/venv$") < user
    # the model conversion and the kernel build run as the user that will load them, after the install
    assert (
        install
        < user
        < line_of(r"^RUN .*default_model_dir\(\)")
        < line_of(r"^RUN .*cpu_ops\(\)")
    )
    assert user < line_of(r"^ENTRYPOINT")
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    server, _ = serve_configs(cmd)
    assert server.host == "0.0.0.0"
    assert re.search(rf"^EXPOSE .*\b{server.port}\b", text, re.M)


def test_grafana_dashboard_queries_only_metrics_strata_exports():
    from strata.router.metrics import RouterMetrics
    from strata.server.metrics import ServerMetrics

    exported = set()
    for registry in (ServerMetrics("m").registry, RouterMetrics().registry):
        for family in registry.collect():
            exported.add(family.name)
            exported |= {
                family.name + suffix
                for suffix in ("_total", "_bucket", "_sum", "_count")
            }
    dashboard = json.loads((DEPLOY / "grafana" / "strata-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    used = {name for e in exprs for name in re.findall(r"strata:[a-z0-9_]+", e)}
    assert used and not used - exported, f"not exported: {sorted(used - exported)}"
    # every exported family is on the dashboard somewhere
    families = {
        n for n in exported if not n.endswith(("_bucket", "_sum", "_count", "_total"))
    }
    covered = {
        n for n in families if any(u == n or u.startswith(n + "_") for u in used)
    }
    assert covered == families, f"not on the dashboard: {sorted(families - covered)}"


def test_docs_commands_match_the_cli():
    """Every `strata router ...` / `strata serve ...` line in docs/DEPLOY.md parses."""
    text = (DEPLOY.parent / "docs" / "DEPLOY.md").read_text()
    commands = re.findall(
        r"^\s*(?:\.venv/bin/)?strata ((?:serve|router)\b[^\n#]*)", text, re.M
    )
    assert commands
    for command in commands:
        parse_cli(shlex.split(command.replace("\\", "")))
