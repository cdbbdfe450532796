"""The deployment files: docker-compose.yml validates (docker-compose's own schema check, offline: no Docker
engine runs here), every AstraFlow service runs an `astraflow` command that exists with a config and overrides
that load, and the Dockerfile copies what exists."""
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import typer.main
import yaml

from astraflow.cli import app
from astraflow.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict:
    """docker-compose.yml as docker-compose resolves it (anchors merged, `$$` kept)."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed (scripts/test.sh installs Debian's docker-compose)")
    done = subprocess.run([exe, "-f", str(ROOT / "docker-compose.yml"), "config"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def _astraflow_argv(entrypoint: list[str] | None, command: list[str]) -> list[str]:
    """The arguments after `astraflow` of a container of the AstraFlow image (its entrypoint is `astraflow`): its
    command (compose `command`, Kubernetes `args`), or an `sh -c` that execs astraflow where it replaces the
    entrypoint (compose `entrypoint`, Kubernetes `command`), $$VAR read as a value."""
    if entrypoint:
        assert entrypoint[:2] == ["sh", "-c"], entrypoint
        argv = shlex.split(entrypoint[2].replace("$$", ""))
        assert argv[:2] == ["exec", "astraflow"], argv
        return argv[2:]
    return list(command)


def _check_astraflow_argv(where: str, argv: list[str], root: Path) -> RunConfig:
    """Check that ``argv`` (after `astraflow`) is a command astraflow has, with flags it takes, and that its config
    (the first positional argument, a path in the container, whose file system is under ``root``) loads with its
    ``key=value`` overrides; the config.

    Raises:
        AssertionError, KeyError, ConfigError: it is not (``where`` names the service).
    """
    command = typer.main.get_command(app).commands[argv[0]]  # a command astraflow has
    flags = {opt for p in command.params for opt in p.opts}
    positional = [a for a in argv[1:] if not a.startswith("--")]
    for flag in (a for a in argv[1:] if a.startswith("--")):
        assert flag.split("=")[0] in flags, (where, flag)
    return load_config(root / positional[0].lstrip("/"), [a for a in positional[1:] if "=" in a])


def test_the_compose_file_validates_and_runs_every_component_of_the_example():
    services = _compose()["services"]
    ours = {name: s for name, s in services.items() if s.get("image") == "astraflow:cpu"}
    assert {"acquire", "raas", "policy", "trainer", "exporter"} <= set(ours)
    assert {"kafka", "s3", "s3-init"} <= set(services)
    for name, service in ours.items():
        cfg = _check_astraflow_argv(name, _astraflow_argv(service.get("entrypoint"), service.get("command")), ROOT)
        assert cfg.bus == "kafka://kafka:19092" and cfg.store == "s3://astraflow/weights", name
        assert service["environment"]["AWS_ENDPOINT_URL"] == "http://s3:8333"
        assert "container_name" not in service  # scalable
    raas = ours["raas"]
    assert "--worker-id" in _astraflow_argv(raas.get("entrypoint"), raas.get("command"))  # distinct group members
    assert "9400" in str(ours["exporter"]["ports"])


def test_the_dockerfile_copies_what_exists_and_installs_from_the_lock():
    text = (ROOT / "Dockerfile").read_text()
    sources = [src for line in re.findall(r"^COPY (.+)$", text, re.M) for src in line.split()[:-1]]
    assert sources and all((ROOT / s).exists() for s in sources), [s for s in sources if not (ROOT / s).exists()]
    assert "scripts/install.sh dev" in text and 'ENTRYPOINT ["astraflow"]' in text


K8S = ROOT / "deploy" / "k8s"


def _validate_manifests(paths: list[Path]) -> dict[tuple[str, str], dict]:
    """Validate every document of ``paths`` with kubernetes-validate (offline: it bundles the published schemas),
    strictly (an unknown field is an error), against the oldest and the newest Kubernetes it has schemas for.

    Returns:
        (kind, name) -> the document.

    Raises:
        kubernetes_validate.ValidationError: a document does not fit its schema.
        kubernetes_validate.SchemaNotFoundError: a kind/apiVersion Kubernetes does not have.
    """
    import kubernetes_validate
    from kubernetes_validate.utils import all_versions

    versions = (min(all_versions(), key=lambda v: tuple(map(int, v.split(".")))), kubernetes_validate.latest_version())
    docs = {}
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is None:
                continue
            for version in versions:
                kubernetes_validate.validate(doc, version, strict=True)
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in docs, f"{path.name}: a second {key}"
            docs[key] = doc
    return docs


def _k8s() -> dict[tuple[str, str], dict]:
    """deploy/k8s's manifests, validated: every file kustomization.yaml lists (and it lists every manifest)."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kustomization["resources"]) == manifests
    return _validate_manifests([K8S / name for name in kustomization["resources"]])


def test_the_k8s_manifests_validate_against_the_kubernetes_schemas():
    docs = _k8s()
    assert {("StatefulSet", "kafka"), ("StatefulSet", "minio"), ("Job", "minio-init"), ("Job", "acquire"),
            ("Service", "exporter"), ("ServiceAccount", "astraflow-controller"), ("Role", "astraflow-controller"),
            ("RoleBinding", "astraflow-controller"), ("ConfigMap", "astraflow-config")} <= set(docs)
    assert all("namespace" not in doc["metadata"] for doc in docs.values())  # kustomization.yaml sets it


def test_a_broken_manifest_fails_validation(tmp_path):
    import kubernetes_validate

    good = yaml.safe_load_all((K8S / "astraflow.yaml").read_text())
    deployment = next(d for d in good if d["kind"] == "Deployment" and d["metadata"]["name"] == "raas")
    _validate_manifests([K8S / "astraflow.yaml"])
    for breakage in ({"replicas": "three"}, {"replica": 3}):  # a wrong type; an unknown field (a typo)
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump({**deployment, "spec": {**deployment["spec"], **breakage}}))
        with pytest.raises(kubernetes_validate.ValidationError):
            _validate_manifests([bad])
    bad.write_text(yaml.safe_dump({**deployment, "apiVersion": "apps/v1beta9"}))
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        _validate_manifests([bad])


def _container_root(pod: dict, docs: dict, root: Path) -> Path:
    """The ConfigMaps ``pod`` mounts, written under ``root`` at their mount paths (the container's file system)."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in pod["containers"][0]["volumeMounts"]:
        if "configMap" in volumes[mount["name"]]:
            data = docs["ConfigMap", volumes[mount["name"]]["configMap"]["name"]]["data"]
            for key, text in data.items():
                (root / mount["mountPath"].lstrip("/")).mkdir(parents=True, exist_ok=True)
                (root / mount["mountPath"].lstrip("/") / key).write_text(text)
    return root


def _command_shape(argv: list[str]) -> list[str]:
    """``argv`` (after `astraflow`) less what differs by deployment: the config's path, its ``bus=`` and ``store=``
    overrides (deploy/k8s's run config holds them) and the worker id (each replica's own)."""
    return [a if i < 2 or argv[i - 1] != "--worker-id" else "<worker id>" for i, a in enumerate(argv)
            if i != 1 and not a.startswith(("bus=", "store="))]


def test_the_k8s_components_run_the_astraflow_commands_of_the_compose_services(tmp_path):
    docs = _k8s()
    pods = {name: doc["spec"]["template"]["spec"] for (kind, name), doc in docs.items() if kind in ("Deployment", "Job")
            and doc["spec"]["template"]["spec"]["containers"][0]["image"] == "astraflow:cpu"}
    commands = {}
    for name, pod in pods.items():
        container = pod["containers"][0]
        argv = _astraflow_argv(container.get("command"), container["args"])
        cfg = _check_astraflow_argv(name, argv, _container_root(pod, docs, tmp_path / name))
        assert cfg.bus == "kafka://kafka:9092" and cfg.store == "s3://astraflow/weights", name
        assert container["envFrom"] == [{"configMapRef": {"name": "astraflow-env"}},
                                        {"secretRef": {"name": "astraflow-s3"}}], name
        commands[name] = argv
    # every AstraFlow service of docker-compose.yml runs here too, as the same command
    compose = {name: s for name, s in _compose()["services"].items() if s.get("image") == "astraflow:cpu"}
    for name, service in compose.items():
        assert name in commands, name
        assert _command_shape(commands[name]) == _command_shape(_astraflow_argv(service.get("entrypoint"),
                                                                                service.get("command"))), name
    env = docs["ConfigMap", "astraflow-env"]["data"]
    assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert docs["Service", "minio"]["spec"]["ports"][0]["port"] == 9000
    assert docs["Service", "kafka"]["spec"]["ports"][0]["port"] == 9092
    # RaaS: each pod a distinct group member, named by the downward API
    raas = pods["raas"]["containers"][0]
    assert raas["args"][raas["args"].index("--worker-id") + 1] == "$(POD_NAME)"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in raas["env"]
    # the run config is the example's, with this deployment's bus, store and controller
    run_yaml = yaml.safe_load(docs["ConfigMap", "astraflow-config"]["data"]["run.yaml"])
    example = yaml.safe_load((ROOT / "examples" / "arith-tiny.yaml").read_text())
    assert {k: v for k, v in run_yaml.items() if k not in ("bus", "store", "controller")} == example
    # the exporter's Service reaches its port
    service, exporter = docs["Service", "exporter"]["spec"], pods["exporter"]["containers"][0]
    assert service["selector"] == docs["Deployment", "exporter"]["spec"]["selector"]["matchLabels"]
    assert service["ports"][0]["targetPort"] == exporter["ports"][0]["name"]
    assert "exporter.port=9400" in exporter["args"] and exporter["ports"][0]["containerPort"] == 9400


def test_the_k8s_controller_may_scale_the_raas_deployment_and_nothing_else(tmp_path):
    docs = _k8s()
    pod = docs["Deployment", "controller"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    cfg = _check_astraflow_argv("controller", _astraflow_argv(container.get("command"), container["args"]),
                                _container_root(pod, docs, tmp_path))
    c = cfg.controller
    assert c.actuator == "kubernetes" and c.k8s_namespace is None  # the pod's own namespace
    assert docs["Deployment", c.k8s_deployment]["spec"]["template"]["spec"]["containers"][0]["args"][0] == "raas"
    assert docs["Role", "astraflow-controller"]["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": [c.k8s_deployment],
         "verbs": ["get", "patch"]}]
    binding = docs["RoleBinding", "astraflow-controller"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "astraflow-controller"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"]}]
    assert ("ServiceAccount", pod["serviceAccountName"]) in docs
    assert docs["Deployment", "controller"]["spec"]["replicas"] == 1


def test_the_kustomization_builds_into_one_namespace(tmp_path):
    """kubernetes-validate knows no Kustomization (not a Kubernetes kind): kustomize builds it here, and what it
    builds validates, everything in the kustomization's namespace, the controller's RoleBinding included."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its kustomize) is not installed: the kustomization is only checked by "
                    "test_the_k8s_manifests_validate_against_the_kubernetes_schemas (it lists every manifest)")
    done = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    built = tmp_path / "built.yaml"
    built.write_text(done.stdout)
    docs = _validate_manifests([built])
    assert ("Namespace", namespace) in docs
    assert all(doc["metadata"]["namespace"] == namespace for (kind, _), doc in docs.items() if kind != "Namespace")
    assert docs["RoleBinding", "astraflow-controller"]["subjects"][0]["namespace"] == namespace
