"""Actuators: who carries the scaling controller's decisions out (``controller.actuator``).

* ``local``: the launcher of ``astraflow run`` reads the target on ``control`` and starts or stops RaaS worker
  processes itself (:meth:`astraflow.launcher.scaling.RaasScaler.scale`); no class here.
* ``compose``: :class:`ComposeActuator` runs ``docker compose [-p PROJECT] -f FILE up -d --no-recreate --scale
  SERVICE=N SERVICE``: new replicas start, running ones are left alone, the newest ones stop on a scale down.
* ``kubernetes``: :class:`KubernetesActuator` sets ``spec.replicas`` of the RaaS Deployment through its
  ``scale`` subresource (the controller's ServiceAccount may get and patch only that, ``deploy/k8s``).

``astraflow controller`` calls an actuator only after its decision is durable on ``control``, through
:class:`Actuation`: one bounded try per target, and a failed try (the daemon or the API server down, a non-zero
exit, a timeout) is logged, reported as metrics and retried, never fatal to the controller.
"""
from __future__ import annotations

import logging
import subprocess
from pathlib import Path

log = logging.getLogger("astraflow.actuators")

#: where a pod finds its own namespace (the service account's mount)
INCLUSTER_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class ActuatorError(RuntimeError):
    """One try at carrying a target out failed; the message says what failed (the command's stderr, the API's
    status and body, or the connection error)."""


class ComposeActuator:
    """Scale a docker compose service.

    Args:
        compose_file: the compose file (``-f``); it must exist.
        service: the service to scale (``raas`` in the repository's docker-compose.yml).
        project: the compose project name (``-p``); None: compose's own default (the file's directory name).
        command: the compose command, e.g. ``["docker", "compose"]`` or ``["docker-compose"]``.
        timeout_s: seconds one ``up`` may take before it is killed and counted as failed.

    Raises:
        ValueError: ``compose_file`` does not exist (named ``controller.compose_file``).
    """

    def __init__(self, compose_file: Path, service: str, project: str | None, command: list[str],
                 timeout_s: float):
        if not Path(compose_file).is_file():
            raise ValueError(f"controller.compose_file {compose_file} does not exist")
        self.compose_file, self.service, self.project = Path(compose_file), service, project
        self.command, self.timeout_s = list(command), timeout_s

    def argv(self, workers: int) -> list[str]:
        """The command line that scales the service to ``workers`` replicas."""
        project = ["-p", self.project] if self.project else []
        return [*self.command, *project, "-f", str(self.compose_file), "up", "-d", "--no-recreate",
                "--scale", f"{self.service}={workers}", self.service]

    def apply(self, workers: int, reason: str) -> None:
        """Scale the service to ``workers`` replicas (idempotent: the same target again changes nothing).

        Args:
            workers: the replicas to run.
            reason: why (the controller's decision), for the log.

        Raises:
            ActuatorError: the command is missing, exited non-zero (its stderr in the message) or ran past
                ``timeout_s``.
        """
        argv = self.argv(workers)
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            raise ActuatorError(f"{' '.join(argv)} took more than {self.timeout_s:.0f} s (killed)") from None
        except OSError as e:
            raise ActuatorError(f"{' '.join(argv)} could not start: {e}") from None
        if done.returncode != 0:
            raise ActuatorError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        log.info("compose: %s scaled to %d (%s)", self.service, workers, reason)


class KubernetesActuator:
    """Scale a Kubernetes Deployment through its ``scale`` subresource (``AppsV1Api.patch_namespaced_deployment_scale``
    with a merge patch of ``spec.replicas``).

    Credentials: ``kubeconfig`` when given; else the pod's service account when running in a cluster; else the
    default kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``), its current context.

    Args:
        deployment: the RaaS Deployment's name.
        namespace: its namespace; None: the pod's own (in a cluster), else the kubeconfig context's, else
            ``default`` (as kubectl).
        kubeconfig: a kubeconfig file, or None (see above).
        timeout_s: seconds one request may take (connect and read).

    Raises:
        ActuatorError: no credentials could be loaded (not in a cluster and no usable kubeconfig).
    """

    def __init__(self, deployment: str, namespace: str | None, kubeconfig: Path | None, timeout_s: float):
        from kubernetes import client, config

        conf = client.Configuration()
        conf.retries = 0  # one try per apply: Actuation retries, and each try stays within timeout_s
        try:
            incluster = False
            if kubeconfig is None:
                try:
                    config.load_incluster_config(client_configuration=conf)
                    incluster = True
                except config.ConfigException:
                    pass  # not in a cluster: the default kubeconfig
            if incluster:
                namespace = namespace or INCLUSTER_NAMESPACE_FILE.read_text().strip()
            else:
                path = str(kubeconfig) if kubeconfig is not None else None
                config.load_kube_config(config_file=path, client_configuration=conf, persist_config=False)
                if namespace is None:
                    _, context = config.list_kube_config_contexts(path)
                    namespace = context.get("context", {}).get("namespace") or "default"
        except (config.ConfigException, OSError) as e:
            raise ActuatorError(f"no Kubernetes credentials for controller.k8s_deployment {deployment}: {e}") from None
        self.deployment, self.namespace, self.timeout_s = deployment, namespace, timeout_s
        self._api = client.AppsV1Api(client.ApiClient(conf))

    def apply(self, workers: int, reason: str) -> None:
        """Set the Deployment's replicas to ``workers`` (idempotent).

        Args:
            workers: the replicas to run.
            reason: why (the controller's decision), for the log.

        Raises:
            ActuatorError: the API server refused (its status and body in the message), could not be reached, or
                did not answer within ``timeout_s``.
        """
        import urllib3
        from kubernetes.client.exceptions import ApiException

        where = f"deployment {self.namespace}/{self.deployment}"
        try:
            self._api.patch_namespaced_deployment_scale(
                self.deployment, self.namespace, {"spec": {"replicas": workers}}, field_manager="astraflow-controller",
                _content_type="application/merge-patch+json", _request_timeout=float(self.timeout_s))
        except ApiException as e:
            raise ActuatorError(f"{where}: scale to {workers} refused: {e.status} {e.reason}: "
                                f"{(e.body or '')[:2000]}") from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise ActuatorError(f"{where}: scale to {workers} failed: {e}") from None
        log.info("kubernetes: %s scaled to %d (%s)", where, workers, reason)


def build_actuator(c) -> ComposeActuator | KubernetesActuator | None:
    """The actuator ``controller.actuator`` names, from a :class:`~astraflow.config.ControllerConfig`; None for
    ``local`` (the launcher reads ``control`` itself).

    Raises:
        ValueError: the compose file does not exist.
        ActuatorError: no Kubernetes credentials.
    """
    if c.actuator == "compose":
        return ComposeActuator(c.compose_file, c.compose_service, c.compose_project, c.compose_command,
                               c.apply_timeout_s)
    if c.actuator == "kubernetes":
        return KubernetesActuator(c.k8s_deployment, c.k8s_namespace, c.k8s_kubeconfig, c.apply_timeout_s)
    return None


class Actuation:
    """The newest target, carried out by an actuator and retried until it is applied.

    Args:
        actuator: anything with ``apply(workers, reason)`` that raises :class:`ActuatorError` on failure.
        retry_s: seconds between two tries of a target that failed.

    Attributes:
        target: the newest wanted number of workers (None until :meth:`want`).
        applied: the newest target the actuator carried out (None until one was).
        errors: failed tries so far, in all.
        failing: tries of the current target that failed in a row (0 once it is applied).
        last_error: the newest failure's message.
    """

    def __init__(self, actuator, retry_s: float):
        self.actuator, self.retry_s = actuator, retry_s
        self.target: int | None = None
        self.reason = ""
        self.applied: int | None = None
        self.errors = self.failing = 0
        self.last_error = ""
        self._due: float | None = None  # when to try the target next (monotonic s); None: nothing to try

    def want(self, workers: int, reason: str) -> None:
        """A new target, tried at the next :meth:`step` (a pending one it replaces is not tried again)."""
        self.target, self.reason, self.failing, self._due = workers, reason, 0, float("-inf")

    def step(self, now: float) -> bool | None:
        """Try the target if a try is due at ``now`` (monotonic seconds).

        Returns:
            True: applied; False: the try failed (logged; the next is due ``retry_s`` later); None: nothing tried.
        """
        if self._due is None or now < self._due:
            return None
        try:
            self.actuator.apply(self.target, self.reason)
        except ActuatorError as e:
            self.errors += 1
            self.failing += 1
            self.last_error = str(e)
            self._due = now + self.retry_s
            log.warning("actuator: %d workers not applied (try %d, retrying in %.0f s): %s", self.target,
                        self.failing, self.retry_s, e)
            return False
        if self.failing:
            log.info("actuator: %d workers applied after %d failed tries", self.target, self.failing)
        self.applied, self.failing, self._due = self.target, 0, None
        return True

    def values(self) -> dict[str, float]:
        """The state as metric values: ``target_workers``, ``applied_workers`` (-1 before any),
        ``actuator_errors`` (in all) and ``actuator_failing`` (failed tries in a row of the current target)."""
        return {"target_workers": float(self.target if self.target is not None else -1),
                "applied_workers": float(self.applied if self.applied is not None else -1),
                "actuator_errors": float(self.errors), "actuator_failing": float(self.failing)}
