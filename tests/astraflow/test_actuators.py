"""The scaling actuators (astraflow/actuators.py) against real stand-ins, since no Docker daemon and no
Kubernetes API server run here:

* kubernetes: the official client against a real HTTP server on 127.0.0.1 that serves a Deployment's ``scale``
  subresource, reached through a kubeconfig written to tmp_path;
* compose: the compose command is a real executable script in tmp_path that records its argv (and fails or
  hangs when told to), in place of ``docker compose``, which would need the daemon.

And the config: each actuator's fields are refused with another one, and what an actuator needs is required.
"""
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from astraflow.actuators import Actuation, ActuatorError, ComposeActuator, KubernetesActuator, build_actuator
from astraflow.config import ConfigError, load_config

SCALE = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"


class FakeApiServer:
    """A Kubernetes API server for one Deployment's scale subresource: GET answers the Scale, PATCH (a merge
    patch) sets ``spec.replicas``. ``fail`` holds statuses to answer the next requests with instead; ``hang_s``
    delays every answer. ``requests`` records (method, path, content type, authorization, JSON body)."""

    def __init__(self, namespace: str, name: str, port: int = 0):
        self.path, self.replicas = SCALE.format(ns=namespace, name=name), 1
        self.fail: list[int] = []
        self.hang_s = 0.0
        self.requests: list[tuple[str, str, str, str, dict | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                size = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(size)) if size else None
                server.requests.append((method, self.path.split("?")[0], self.headers.get("Content-Type", ""),
                                        self.headers.get("Authorization", ""), body))
                time.sleep(server.hang_s)
                if server.fail:
                    status = server.fail.pop(0)
                    return self._answer(status, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                 "message": "etcd is sulking", "code": status})
                if self.path.split("?")[0] != server.path:
                    return self._answer(404, {"kind": "Status", "apiVersion": "v1", "code": 404})
                if method == "PATCH":
                    server.replicas = body["spec"]["replicas"]
                self._answer(200, {"kind": "Scale", "apiVersion": "autoscaling/v1",
                                   "metadata": {"name": name, "namespace": namespace},
                                   "spec": {"replicas": server.replicas}, "status": {"replicas": server.replicas}})

            def do_GET(self):
                self._handle("GET")

            def do_PATCH(self):
                self._handle("PATCH")

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):  # a client that timed out and left: expected
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
                    super().handle_error(request, client_address)

        self.httpd = Server(("127.0.0.1", port), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def api():
    server = FakeApiServer("astra", "raas")
    yield server
    server.close()


def kubeconfig(tmp_path, port: int, namespace: str | None = "astra"):
    """A kubeconfig whose current context reaches http://127.0.0.1:<port> with a bearer token."""
    context = {"cluster": "local", "user": "ctl", **({"namespace": namespace} if namespace else {})}
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "here",
        "clusters": [{"name": "local", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "ctl", "user": {"token": "s3cret-token"}}],
        "contexts": [{"name": "here", "context": context}]}))
    return path


def test_kubernetes_patches_the_deployments_scale_with_the_replicas(api, tmp_path):
    actuator = KubernetesActuator("raas", None, kubeconfig(tmp_path, api.port), timeout_s=5)
    assert actuator.namespace == "astra"  # the kubeconfig context's
    actuator.apply(3, "trainers starved")
    assert api.requests == [("PATCH", api.path, "application/merge-patch+json", "Bearer s3cret-token",
                             {"spec": {"replicas": 3}})]
    assert api.replicas == 3
    actuator.apply(3, "again")  # idempotent
    assert api.replicas == 3 and len(api.requests) == 2


def test_kubernetes_namespace_comes_from_the_config_else_the_context_else_default(api, tmp_path):
    assert KubernetesActuator("raas", "other", kubeconfig(tmp_path, api.port), 5).namespace == "other"
    assert KubernetesActuator("raas", None, kubeconfig(tmp_path, api.port, namespace=None), 5).namespace == "default"
    with pytest.raises(ActuatorError, match="no Kubernetes credentials for controller.k8s_deployment raas"):
        KubernetesActuator("raas", None, tmp_path / "missing-kubeconfig", 5)


def test_kubernetes_a_server_error_is_reported_and_retried_not_raised(api, tmp_path):
    actuation = Actuation(KubernetesActuator("raas", None, kubeconfig(tmp_path, api.port), 5), retry_s=10)
    api.fail = [500]
    actuation.want(2, "trainers starved")
    assert actuation.step(100.0) is False
    assert "500" in actuation.last_error and "etcd is sulking" in actuation.last_error
    assert actuation.values() == {"target_workers": 2.0, "applied_workers": -1.0, "actuator_errors": 1.0,
                                  "actuator_failing": 1.0}
    assert actuation.step(105.0) is None and len(api.requests) == 1  # not before retry_s
    assert actuation.step(110.0) is True and api.replicas == 2
    assert actuation.values() == {"target_workers": 2.0, "applied_workers": 2.0, "actuator_errors": 1.0,
                                  "actuator_failing": 0.0}
    assert actuation.step(200.0) is None and len(api.requests) == 2  # applied: nothing more to try


def test_kubernetes_an_unreachable_or_slow_server_is_a_bounded_failure_then_retried(tmp_path):
    server = FakeApiServer("astra", "raas")
    port = server.port
    actuation = Actuation(KubernetesActuator("raas", None, kubeconfig(tmp_path, port), timeout_s=0.5), retry_s=1)
    server.hang_s = 60
    actuation.want(4, "trainers starved")
    t0 = time.monotonic()
    assert actuation.step(0.0) is False
    # one try is bounded by apply_timeout_s (0.5 s), not by the server's 60 s hang (15 s: a busy machine's slack)
    assert time.monotonic() - t0 < 15, "one try is bounded by apply_timeout_s"
    assert "timed out" in actuation.last_error.lower()
    server.close()
    assert actuation.step(1.0) is False  # connection refused: reported, not raised
    assert "refused" in actuation.last_error.lower() and actuation.failing == 2
    server = FakeApiServer("astra", "raas", port=port)  # the API server is back
    try:
        assert actuation.step(2.0) is True and server.replicas == 4 and actuation.errors == 2
    finally:
        server.close()


def recorder(tmp_path):
    """An executable standing in for `docker compose` (no Docker daemon here): it appends its argv as a JSON line
    to calls.jsonl, then exits with the code in exit_code (stderr 'Cannot connect to the Docker daemon') or sleeps
    for the seconds in sleep_s, when those files exist."""
    script = tmp_path / "fake-compose"
    script.write_text(f"#!{sys.executable}\n"
                      "import json, pathlib, sys, time\n"
                      "here = pathlib.Path(sys.argv[0]).parent\n"
                      "with open(here / 'calls.jsonl', 'a') as f:\n"
                      "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
                      "if (here / 'sleep_s').exists():\n"
                      "    time.sleep(float((here / 'sleep_s').read_text()))\n"
                      "if (here / 'exit_code').exists():\n"
                      "    print('Cannot connect to the Docker daemon', file=sys.stderr)\n"
                      "    sys.exit(int((here / 'exit_code').read_text()))\n")
    script.chmod(0o755)
    return script


def calls(tmp_path) -> list[list[str]]:
    path = tmp_path / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_compose_runs_up_with_the_scale_of_the_service(tmp_path):
    compose_file = tmp_path / "docker-compose.yml"
    compose_file.write_text("services: {}\n")
    actuator = ComposeActuator(compose_file, "raas", "astra", [str(recorder(tmp_path)), "compose"], timeout_s=10)
    actuator.apply(3, "trainers starved")
    assert calls(tmp_path) == [["compose", "-p", "astra", "-f", str(compose_file), "up", "-d", "--no-recreate",
                                "--scale", "raas=3", "raas"]]
    ComposeActuator(compose_file, "rollout", None, [str(recorder(tmp_path))], 10).apply(1, "busy")
    assert calls(tmp_path)[1] == ["-f", str(compose_file), "up", "-d", "--no-recreate", "--scale", "rollout=1",
                                  "rollout"]


def test_compose_a_failure_is_reported_with_its_stderr_and_retried(tmp_path):
    compose_file = tmp_path / "docker-compose.yml"
    compose_file.write_text("services: {}\n")
    actuation = Actuation(ComposeActuator(compose_file, "raas", None, [str(recorder(tmp_path))], 10), retry_s=5)
    (tmp_path / "exit_code").write_text("1")
    actuation.want(2, "trainers starved")
    assert actuation.step(0.0) is False
    assert "exited 1: Cannot connect to the Docker daemon" in actuation.last_error
    (tmp_path / "exit_code").unlink()
    assert actuation.step(4.0) is None
    assert actuation.step(5.0) is True and actuation.applied == 2 and actuation.errors == 1
    assert len(calls(tmp_path)) == 2 and calls(tmp_path)[0] == calls(tmp_path)[1]


def test_compose_a_hung_or_missing_command_is_a_bounded_failure(tmp_path):
    compose_file = tmp_path / "docker-compose.yml"
    compose_file.write_text("services: {}\n")
    (tmp_path / "sleep_s").write_text("30")
    t0 = time.monotonic()
    with pytest.raises(ActuatorError, match="took more than 1 s"):
        ComposeActuator(compose_file, "raas", None, [str(recorder(tmp_path))], timeout_s=1).apply(2, "starved")
    assert time.monotonic() - t0 < 15  # stopped at its 1 s timeout, not after the 30 s the command sleeps
    with pytest.raises(ActuatorError, match="could not start"):
        ComposeActuator(compose_file, "raas", None, [str(tmp_path / "no-such-compose")], 10).apply(2, "starved")
    with pytest.raises(ValueError, match="controller.compose_file .* does not exist"):
        ComposeActuator(tmp_path / "nope.yml", "raas", None, ["docker", "compose"], 10)


def config(tmp_path, *overrides):
    return load_config(None, ["policies.actor.model=tiny", f"run_dir={tmp_path}", *overrides])


def test_the_config_builds_the_chosen_actuator_with_its_fields(tmp_path, api):
    compose_file = tmp_path / "docker-compose.yml"
    compose_file.write_text("services: {}\n")
    assert build_actuator(config(tmp_path).controller) is None  # local: the launcher reads control
    c = config(tmp_path, "controller.actuator=compose", f"controller.compose_file={compose_file}",
               "controller.compose_project=astra", "controller.compose_service=rollout",
               "controller.compose_command=[docker-compose]", "controller.apply_timeout_s=7").controller
    compose = build_actuator(c)
    assert compose.argv(2) == ["docker-compose", "-p", "astra", "-f", str(compose_file), "up", "-d", "--no-recreate",
                               "--scale", "rollout=2", "rollout"] and compose.timeout_s == 7
    c = config(tmp_path, "controller.actuator=kubernetes", "controller.k8s_deployment=raas",
               "controller.k8s_namespace=astra", f"controller.k8s_kubeconfig={kubeconfig(tmp_path, api.port)}").controller
    build_actuator(c).apply(2, "starved")
    assert api.replicas == 2 and api.requests[0][1] == SCALE.format(ns="astra", name="raas")


@pytest.mark.parametrize("overrides, error", [
    (["controller.actuator=compose"], "controller.actuator: compose needs controller.compose_file"),
    (["controller.actuator=kubernetes"], "controller.actuator: kubernetes needs controller.k8s_deployment"),
    (["controller.compose_service=rollout"], "controller.compose_service applies to actuator: compose, and actuator "
                                             "is 'local'"),
    (["controller.actuator=kubernetes", "controller.k8s_deployment=raas", "controller.compose_file=x.yml"],
     "controller.compose_file applies to actuator: compose, and actuator is 'kubernetes'"),
    (["controller.actuator=compose", "controller.compose_file=x.yml", "controller.k8s_namespace=astra"],
     "controller.k8s_namespace applies to actuator: kubernetes, and actuator is 'compose'"),
    (["controller.apply_timeout_s=5"], "controller.apply_timeout_s applies to actuator: compose or kubernetes"),
    (["controller.actuator=swarm"], "controller.actuator: Input should be 'local', 'compose' or 'kubernetes'"),
])
def test_the_config_refuses_an_actuator_without_its_fields_or_with_anothers(tmp_path, overrides, error):
    with pytest.raises(ConfigError, match=error.replace("(", r"\(").replace(")", r"\)")):
        config(tmp_path, *overrides)


@pytest.mark.parametrize("overrides, error", [
    (["controller.actuator=kubernetes", "controller.k8s_deployment=raas"],
     "no Kubernetes credentials for controller.k8s_deployment raas"),
    (["controller.actuator=compose"], "controller.compose_file {missing} does not exist"),
])
@pytest.mark.parametrize("command", ["controller", "run"])
def test_a_controller_without_kubernetes_credentials_or_compose_file_is_refused_in_one_line(
        tmp_path, monkeypatch, overrides, error, command):
    """``astraflow controller`` (and ``astraflow run`` with the controller enabled) with actuator kubernetes and
    no kubeconfig, or compose with a compose file that does not exist, exits 2 with one line naming the field,
    before anything starts: no traceback, no topics."""
    from typer.testing import CliRunner

    from astraflow.cli import app

    missing = tmp_path / "missing-compose.yml"
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config either
    args = [command, "examples/arith-tiny.yaml", f"run_dir={tmp_path / 'run'}", f"bus=local://{tmp_path / 'bus'}",
            *overrides]
    if "controller.actuator=compose" in overrides:
        args.append(f"controller.compose_file={missing}")
    if command == "run":
        args.append("controller.enabled=true")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert error.format(missing=missing) in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "bus").exists()  # nothing started
