"""deploy/kubernetes/ and the Dockerfile, checked offline (docs/operate.md, "Running on Kubernetes").

Every manifest is validated against the Kubernetes API's JSON schemas that
``kubernetes-validate`` ships (strict: an unknown field is an error), for
the Kubernetes version below. Then the objects are checked against each
other and against the config: the ConfigMap's narwhal.toml passes
``narwhal serve --check-config`` with the files and environment the pod
would give it, the probes reach the port Narwhal listens on, the pod's
termination grace period covers the drain, the Services select the pods
they are meant for, and the Dockerfile installs Narwhal with the README's
line.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from .helpers import REPO

DEPLOY = REPO / "deploy" / "kubernetes"
#: The Kubernetes version the manifests are validated for (the oldest they are meant to run on).
KUBERNETES_VERSION = "1.30"
#: Seconds of the pod's termination grace period left after preStop and shutdown.grace_s.
MIN_MARGIN_S = 5
POD_LABELS = {"app.kubernetes.io/name": "narwhal", "app.kubernetes.io/component": "router"}


@functools.cache
def _documents() -> list[tuple[str, dict[str, Any]]]:
    """Every object in deploy/kubernetes/ with its file's name (read once: the tests only read them)."""
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for _, doc in _documents()}


def _container() -> dict[str, Any]:
    (container,) = _objects()["Deployment", "narwhal"]["spec"]["template"]["spec"]["containers"]
    return container


def _config() -> dict[str, Any]:
    return tomllib.loads(_objects()["ConfigMap", "narwhal-config"]["data"]["narwhal.toml"])


def test_every_manifest_is_valid_for_the_pinned_kubernetes_version() -> None:
    documents = _documents()
    for name, doc in documents:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert sorted(_objects()) == [
        ("ConfigMap", "narwhal-config"), ("Deployment", "narwhal"), ("PodDisruptionBudget", "narwhal"),
        ("Secret", "narwhal-secrets"), ("Service", "narwhal"), ("Service", "narwhal-engines-decode"),
        ("Service", "narwhal-engines-prefill"),
    ]


def test_the_validator_refuses_a_broken_manifest() -> None:
    """The check above can fail: a misspelt field and a wrong type are caught offline."""
    deployment = _objects()["Deployment", "narwhal"]
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    broken = {**deployment, "spec": {**deployment["spec"], "replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def _pod_files(root: Path) -> None:
    """Lay out under ``root`` what the container sees at its mount paths: the volumes' files, empty dirs."""
    objects = _objects()
    volumes = {v["name"]: v for v in objects["Deployment", "narwhal"]["spec"]["template"]["spec"]["volumes"]}
    for mount in _container()["volumeMounts"]:
        target = root / mount["mountPath"].lstrip("/")
        target.mkdir(parents=True)
        volume = volumes[mount["name"]]
        if "emptyDir" in volume:
            continue
        for source in volume["projected"]["sources"]:
            kind, ref = ("ConfigMap", source["configMap"]) if "configMap" in source else ("Secret", source["secret"])
            obj = objects[kind, ref["name"]]
            data = obj.get("data") or obj.get("stringData")
            for item in ref["items"]:
                (target / item["path"]).write_text(data[item["key"]])


def _pod_environment() -> dict[str, str]:
    secrets = {name: obj for (kind, name), obj in _objects().items() if kind == "Secret"}
    env = {}
    for var in _container()["env"]:
        ref = var["valueFrom"]["secretKeyRef"]
        env[var["name"]] = secrets[ref["name"]]["stringData"][ref["key"]]
    return env


def test_the_configmaps_config_passes_check_config_as_the_pod_mounts_it(tmp_path: Path) -> None:
    _pod_files(tmp_path)
    mounts = [m["mountPath"] for m in _container()["volumeMounts"]]
    # The container's paths, moved under tmp_path: the config names them, the args name the config.
    moved = re.compile("(" + "|".join(re.escape(m) for m in mounts) + ")/")
    args = _container()["args"]
    assert args[:2] == ["serve", "--config"], args
    config = tmp_path / args[2].lstrip("/")
    config.write_text(moved.sub(lambda m: f"{tmp_path}{m.group(1)}/", config.read_text()))
    assert str(tmp_path) in config.read_text()  # the keys file and the journal were both moved
    env = {k: v for k, v in os.environ.items() if k != "NARWHAL_ENGINE_API_KEY"}
    result = subprocess.run([sys.executable, "-m", "narwhal", *args[:2], str(config), "--check-config"],
                            cwd=REPO, capture_output=True, text=True, timeout=60, env={**env, **_pod_environment()})
    assert result.returncode == 0, result
    assert result.stdout.startswith(f"narwhal: config {config} is valid (listen 0.0.0.0:8000, auth api_keys, "), result
    assert result.stderr == ""


def _port(name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    (port,) = [p["containerPort"] for p in _container()["ports"] if p["name"] == name_or_number]
    return int(port)


def test_probes_and_service_reach_the_port_narwhal_listens_on() -> None:
    listen = _config()["ingress"]["listen"]
    port = int(listen.rsplit(":", 1)[1])
    container = _container()
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    for probe in ("livenessProbe", "readinessProbe"):
        assert _port(container[probe]["httpGet"]["port"]) == port, probe
    (service_port,) = _objects()["Service", "narwhal"]["spec"]["ports"]
    assert _port(service_port["targetPort"]) == port


def test_the_termination_grace_period_covers_prestop_and_the_drain() -> None:
    pod = _objects()["Deployment", "narwhal"]["spec"]["template"]["spec"]
    command = _container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    pre_stop_s = float(command[1])
    grace_s = float(_config()["shutdown"]["grace_s"])
    assert pod["terminationGracePeriodSeconds"] > grace_s
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + grace_s + MIN_MARGIN_S, (pre_stop_s, grace_s)


def test_the_router_runs_unprivileged_on_a_read_only_root_with_a_writable_journal() -> None:
    deployment = _objects()["Deployment", "narwhal"]
    pod = deployment["spec"]["template"]["spec"]
    container = _container()
    assert deployment["spec"]["replicas"] == 2
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    journal_dir = os.path.dirname(_config()["journal"]["path"])
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == journal_dir]
    assert "emptyDir" in volumes[mount["name"]] and not mount.get("readOnly", False)


def test_services_and_the_budget_select_what_they_are_for() -> None:
    objects = _objects()
    deployment = objects["Deployment", "narwhal"]
    assert deployment["spec"]["selector"]["matchLabels"] == POD_LABELS
    assert deployment["spec"]["template"]["metadata"]["labels"] == POD_LABELS
    assert objects["Service", "narwhal"]["spec"]["selector"] == POD_LABELS
    assert objects["PodDisruptionBudget", "narwhal"]["spec"]["selector"]["matchLabels"] == POD_LABELS
    config = _config()["engine"]
    for role in ("prefill", "decode"):
        service = objects["Service", f"narwhal-engines-{role}"]["spec"]
        assert service["clusterIP"] == "None" and service["selector"] == {"narwhal/engine-role": role}
        # Today's static list names pods under this role's headless Service, on its port.
        for url in config[role]:
            host, port = url.removeprefix("http://").rsplit(":", 1)
            assert host.split(".")[1] == f"narwhal-engines-{role}", url
            assert int(port) == service["ports"][0]["port"], url


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0], line.split(None, 1)[1] if " " in line else "") for line in lines]


def test_the_dockerfile_installs_with_the_readmes_line_and_runs_serve_as_a_non_root_user() -> None:
    readme = (REPO / "README.md").read_text()
    (demo,) = [line.strip() for line in readme.splitlines()
               if line.strip().startswith("python3.11 -m venv .venv") and line.strip().endswith("narwhal demo")]
    install = demo.removesuffix(" && narwhal demo")
    instructions = _dockerfile_instructions()
    runs = [args for op, args in instructions if op == "RUN"]
    assert any(install in run for run in runs), (install, runs)
    assert ("FROM", "python:3.11-slim") in instructions
    assert ("ENTRYPOINT", '["narwhal"]') in instructions
    assert ("CMD", '["serve", "--config", "/etc/narwhal/narwhal.toml"]') in instructions
    (user,) = [args for op, args in instructions if op == "USER"]
    uid = int(user.split(":")[0])
    assert uid != 0 and uid == _objects()["Deployment", "narwhal"]["spec"]["template"]["spec"]["securityContext"][
        "runAsUser"]
    assert _container()["args"] == ["serve", "--config", "/etc/narwhal/narwhal.toml"]  # the image's CMD
    ignored = (REPO / ".dockerignore").read_text().splitlines()
    assert ".git" in ignored and ".venv" in ignored
