"""Run configuration: pydantic models, YAML files and ``key=value`` overrides.

A run config names the bus and the store, the policies with their models,
trainers and filter chains, the workflow, the data sources, the curators, the
RaaS workers and the evaluation. Every component command (``astraflow run``,
``acquire``, ``raas``, ``policy``, ``trainer``) reads the same file.

The sections a package's components need live in that package (:mod:`producers.config`, :mod:`policies.config`,
:mod:`trainer.config`, :mod:`consumers.config`); this module composes them into :class:`RunConfig`, validates the
whole file once, and cuts each component its own section (:meth:`RunConfig.raas_section`,
:meth:`RunConfig.filter_section`, :meth:`RunConfig.acquisition_section`, :meth:`RunConfig.controller_section`,
:meth:`RunConfig.metrics_section`, :meth:`RunConfig.replay_section`, :meth:`RunConfig.trainer_section`,
:meth:`RunConfig.eval_section`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from consumers.config import EvalSection
from policies.config import (AcceptAllConfig, CuratorSpec, FilterProcessorConfig, FilterSection, FilterSpec,
                             ServingSpec)
from producers.config import (AcquisitionSection, DataConfig, RaasConfig, RaasSection, RolloutPolicyConfig, RunAddress,
                              SamplingConfig, ToolsConfig, WorkflowConfig)
from topics.kafka_security import KafkaSecurity
from trainer.config import TrainerConfig, TrainerSection


class ConfigError(ValueError):
    """A config file or override is invalid; the message names each field and what was wrong."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Placement(_Strict):
    """Where one kind of component runs on the launcher's machine, as one would give it GPUs."""

    cpus: list[Annotated[int, Field(strict=True, ge=0)]] | None = Field(
        default=None, min_length=1, description="CPU ids it may run on (sched_setaffinity); default: any")
    threads: int | None = Field(default=None, ge=1, strict=True, description="its torch / OpenMP threads "
                                "(OMP_NUM_THREADS); default: the launcher's OMP_NUM_THREADS, else 1")
    nice: int | None = Field(default=None, ge=0, le=19, strict=True,
                             description="its niceness (setpriority), at least the launcher's: higher yields the CPU "
                                         "to the other components; default: the launcher's")


class PolicyConfig(RolloutPolicyConfig):
    """One trained policy: its model, engine (:class:`~producers.config.RolloutPolicyConfig`), trainer and data
    policies."""

    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="its trainer: optimiser and loss "
                                   "(trainer/config.py)")
    steps: int = Field(default=100, ge=1, description="training steps on the lineage of the final weights, then stop "
                       "(the final version is higher by the versions a resume skipped: trainer/service.py)")
    keep_versions: int | None = Field(default=None, ge=1, description="weight versions kept in the store: after each "
                                      "publish, objects no chain to the newest N needs are deleted; None keeps all")
    filters: list[FilterSpec] = Field(default_factory=lambda: [AcceptAllConfig(name="accept_all")],
                                      description="the filter chain, in order (policies/config.py)")
    filter_processor: FilterProcessorConfig = Field(default_factory=FilterProcessorConfig, description="its filter "
                                                    "processors: how many, and their transaction shape")
    serving: list[ServingSpec] = Field(default_factory=list, description="at most one serving policy, e.g. "
                                       "[{name: replay, ratio: 0.5}] (policies/config.py)")
    stop_on_collapse: bool = Field(default=False, description="stop the run, exiting non-zero, when this policy's "
                                   "reward collapses (under half its best 10-step window while the entropy moves "
                                   "by over 1.25x: trainer/collapse.py), and keep the checkpoint of the best window in "
                                   "<run_dir>/trainer.<policy>/best-checkpoint; false: the collapse is only alerted")
    trainer_placement: Placement = Field(default_factory=Placement, description="where its trainer runs: each "
                                       "field set here replaces placement.trainer's (astraflow/placement.py)")

    @model_validator(mode="after")
    def _serving_within_bound(self) -> "PolicyConfig":
        for i, spec in enumerate(self.serving):
            bound = getattr(spec, "max_staleness", None)
            if isinstance(bound, int) and bound > self.max_staleness:
                raise ValueError(f"serving[{i}].max_staleness {bound} is above max_staleness {self.max_staleness}: "
                                 "a serving policy obeys the policy's bound (left out, it is that bound)")
        return self


class EvalConfig(_Strict):
    """Evaluation: pass@1 as avg@k."""

    benchmarks: list[str] = Field(default_factory=list, description="benchmarks to evaluate; empty: gsm8k, math500, "
                                  "humaneval, mbpp")
    k: int = Field(default=4, ge=1, description="samples per prompt")
    temperature: float = Field(default=0.6, gt=0, description="sampling temperature")
    limit: int | None = Field(default=None, ge=1, description="first N prompts per benchmark; None: all")


class TrackingConfig(_Strict):
    """TensorBoard and W&B (``astraflow tracker``, :mod:`astraflow.tracker`): a component of its own that writes
    every figure on ``metrics`` to them. With ``tensorboard_dir`` or ``wandb_project`` set, ``astraflow run`` starts
    it. Needs the ``tracking`` install profile (``scripts/install.sh tracking``)."""

    tensorboard_dir: Path | None = Field(default=None, description="write TensorBoard event files under "
                                         "<tensorboard_dir>/<run>/<component>/")
    wandb_project: str | None = Field(default=None, min_length=1, description="log to this W&B project, one W&B "
                                      "run per AstraFlow run (entity and key: W&B's own WANDB_* settings)")
    wandb_mode: Literal["online", "offline"] | None = Field(
        default=None, description="W&B's mode; offline writes the W&B run under <run_dir>/wandb for `wandb sync` "
                                  "later; None: W&B's own default (WANDB_MODE, else online)")
    flush_every_s: float = Field(default=10.0, gt=0, description="seconds between two flushes; the tracker's "
                                 "offsets are committed after each flush, so a restart resumes after it")

    @property
    def enabled(self) -> bool:
        """Whether any sink is configured (then ``astraflow run`` starts the tracker)."""
        return self.tensorboard_dir is not None or self.wandb_project is not None

    @model_validator(mode="after")
    def _mode_needs_project(self) -> "TrackingConfig":
        if "wandb_mode" in self.model_fields_set and self.wandb_mode is not None and self.wandb_project is None:
            raise ValueError(f"tracking.wandb_mode={self.wandb_mode} applies to W&B: set tracking.wandb_project")
        return self


class PlacementConfig(_Strict):
    """``astraflow run``'s placement of each kind of component (:mod:`astraflow.placement`): ``placement.trainer:
    {cpus: [0], threads: 1}`` pins every trainer process (all its ranks) to CPU 0 with one thread. Components
    started on their own (``astraflow raas ...``, compose, Kubernetes) are placed by whoever starts them."""

    acquire: Placement = Field(default_factory=Placement, description="acquisition")
    raas: Placement = Field(default_factory=Placement, description="the RaaS workers")
    policy: Placement = Field(default_factory=Placement, description="the filter processors")
    trainer: Placement = Field(default_factory=Placement, description="the trainers, every rank; a policy's "
                               "trainer_placement overrides it field by field")
    controller: Placement = Field(default_factory=Placement, description="the scaling controller")
    exporter: Placement = Field(default_factory=Placement, description="the Prometheus exporter")
    tracker: Placement = Field(default_factory=Placement, description="the tracker (TensorBoard, W&B)")
    search: Placement = Field(default_factory=Placement, description="the search tool's server")


class ExporterConfig(_Strict):
    """The Prometheus exporter (``astraflow exporter``, :mod:`astraflow.exporter`). With ``port`` set,
    ``astraflow run`` starts it as a component; ``astraflow exporter`` serves on ``port`` (default 9400)."""

    port: int | None = Field(default=None, ge=0, le=65535, description="serve /metrics here; 0: any free port")
    host: str = Field(default="127.0.0.1", description="the address to bind (0.0.0.0 for every interface)")
    lag_every_s: float = Field(default=5.0, gt=0, description="the least seconds between two consumer-lag reads")


#: the fields of ``controller`` that only an actuator uses, by actuator
ACTUATOR_FIELDS = {"compose": ("compose_file", "compose_project", "compose_service", "compose_command",
                               "apply_timeout_s"),
                   "kubernetes": ("k8s_deployment", "k8s_namespace", "k8s_kubeconfig", "apply_timeout_s")}


class ControllerConfig(_Strict):
    """The rollout scaling controller (``astraflow controller``, :mod:`astraflow.controller`): with ``enabled``,
    ``astraflow run`` starts it, starting from ``raas.workers``. Its decisions are carried out by the
    ``actuator`` (:mod:`astraflow.actuators`): ``local`` (the launcher of ``astraflow run`` adds and stops RaaS
    worker processes), ``compose`` (``docker compose ... up --scale compose_service=N``, needs ``compose_file``)
    or ``kubernetes`` (the scale of the Deployment ``k8s_deployment``). Each actuator's fields are refused with
    another actuator."""

    enabled: bool = Field(default=False, description="astraflow run starts the controller")
    actuator: Literal["local", "compose", "kubernetes"] = Field(
        default="local", description="who carries a decision out: local (the launcher of astraflow run), compose "
                                     "or kubernetes (astraflow controller, after the decision is on control)")
    compose_file: Path | None = Field(default=None, description="compose: the compose file (docker compose -f)")
    compose_project: str | None = Field(default=None, min_length=1, description="compose: the project name (-p); "
                                        "None: compose's default (the file's directory)")
    compose_service: str = Field(default="raas", min_length=1, description="compose: the RaaS service to scale")
    compose_command: list[str] = Field(default_factory=lambda: ["docker", "compose"], min_length=1,
                                       description="compose: the compose command, e.g. [docker-compose]")
    k8s_deployment: str | None = Field(default=None, min_length=1, description="kubernetes: the RaaS Deployment")
    k8s_namespace: str | None = Field(default=None, min_length=1, description="kubernetes: its namespace; None: "
                                      "the controller pod's own, else the kubeconfig context's, else default")
    k8s_kubeconfig: Path | None = Field(default=None, description="kubernetes: a kubeconfig file; None: the pod's "
                                        "service account in a cluster, else $KUBECONFIG or ~/.kube/config")
    apply_timeout_s: float = Field(default=30.0, gt=0, description="compose, kubernetes: seconds one try to carry "
                                   "a decision out may take; a failed try is retried every interval_s")
    min_workers: int = Field(default=1, ge=1, description="fewest RaaS workers it scales down to")
    max_workers: int = Field(default=4, ge=1, description="most RaaS workers it scales up to")
    starved_above: float = Field(default=0.3, ge=0, le=1, description="trainer wait_frac above this: scale up")
    busy_below: float = Field(default=0.05, ge=0, le=1, description="trainer wait_frac below this (and workers "
                              "paused by backpressure): scale down")
    paused_above: float = Field(default=0.5, ge=0, le=1, description="mean RaaS paused share that counts as held back")
    window: int = Field(default=3, ge=1, description="consecutive observations that must agree")
    interval_s: float = Field(default=5.0, gt=0, description="seconds between observations")
    cooldown_s: float = Field(default=60.0, ge=0, description="seconds after a decision before the next")
    grace_s: float = Field(default=60.0, gt=0, description="a worker that reported within this is alive, however slow")

    @model_validator(mode="after")
    def _actuator_fields(self) -> "ControllerConfig":
        for name in sorted(self.model_fields_set):
            users = [a for a, fields in ACTUATOR_FIELDS.items() if name in fields]
            if users and self.actuator not in users:
                raise ValueError(f"controller.{name} applies to actuator: {' or '.join(users)}, and actuator is "
                                 f"{self.actuator!r}")
        need = {"compose": "compose_file", "kubernetes": "k8s_deployment"}.get(self.actuator)
        if need and getattr(self, need) is None:
            raise ValueError(f"controller.actuator: {self.actuator} needs controller.{need}")
        return self

    @model_validator(mode="after")
    def _bounds(self) -> "ControllerConfig":
        if self.min_workers > self.max_workers:
            raise ValueError(f"controller.min_workers ({self.min_workers}) > controller.max_workers ({self.max_workers})")
        if self.busy_below >= self.starved_above:
            raise ValueError(f"controller.busy_below ({self.busy_below}) must be below controller.starved_above "
                             f"({self.starved_above}): the band between them is where nothing changes")
        return self


class ControllerSection(_Strict):
    """What the scaling controller takes (:func:`astraflow.controller.run_controller`)."""

    run: str = Field(description="the run name every topic and group is prefixed with")
    workflow: str = Field(description="the workflow whose RaaS workers it scales")
    policies: list[str] = Field(min_length=1, description="the run's policies, whose trainers it observes")
    workers: int = Field(ge=1, description="the workers it starts from when control holds no decision yet")
    controller: ControllerConfig = Field(description="its own settings")


class ReplaySection(RunAddress):
    """What a replay of one policy takes (:func:`astraflow.replay.replay_run`)."""

    store: str = Field(description="the run's weight store, file:///abs/dir or s3://bucket/prefix")
    policy: str = Field(description="the policy replayed")
    model: str = Field(description="its model, as the config names it")
    trainer: TrainerConfig = Field(description="its trainer config as its trainer used it (RunConfig.trainer_config)")
    steps: int = Field(ge=1, description="versions to replay at most")
    batch_groups: int = Field(ge=1, description="groups per step when re-served")
    max_staleness: int = Field(ge=0, description="the staleness bound when re-served")


class MetricsSection(RunAddress):
    """What the readers of the run's ``metrics`` take: ``astraflow status`` (:func:`astraflow.monitor.observe_run`),
    the exporter (:func:`astraflow.exporter.main`) and the tracker (:func:`astraflow.tracker.main`)."""

    run_dir: Path = Field(description="the run's directory (the launcher's components.json, W&B's offline runs)")
    policies: list[str] = Field(min_length=1, description="the run's policies")
    workflow: str = Field(description="the workflow whose RaaS workers' group is shown")
    exporter: ExporterConfig = Field(description="the Prometheus exporter's settings")
    tracking: TrackingConfig = Field(description="the tracker's sinks")


class RunConfig(_Strict):
    """A whole run. ``bus`` and ``store`` default to the embedded bus and a local store in ``run_dir``."""

    run: str = Field(default="astraflow", pattern=r"^[A-Za-z0-9._-]+$", description="the run name every topic and "
                     "group is prefixed with")
    run_dir: Path | None = Field(default=None, description="default: runs/<run>")
    bus: str | None = Field(default=None, description="kafka://host:port or local://PATH")
    kafka: KafkaSecurity = Field(default_factory=KafkaSecurity,
                                 description="SASL and TLS of a kafka:// bus; unset fields come from the "
                                             "ASTRAFLOW_KAFKA_<FIELD> environment variables")
    store: str | None = Field(default=None, description="file:///abs/dir or s3://bucket/prefix")
    seed: int = Field(default=0, description="seed of the sources' own sampling (arith) and of evaluation's sampling")
    policies: dict[str, PolicyConfig] = Field(min_length=1, description="the trained policies, by name")
    workflow: WorkflowConfig = Field(default_factory=WorkflowConfig, description="the agent workflow and which "
                                     "policy plays each role")
    data: DataConfig = Field(default_factory=DataConfig, description="acquisition: the prompt sources, G, epochs "
                             "and bad records")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="rollout sampling")
    curators: list[CuratorSpec] = Field(default_factory=list, description="the curators acquisition's prompts "
                                        "pass, in order (policies/config.py)")
    raas: RaasConfig = Field(default_factory=RaasConfig, description="the rollout (RaaS) workers")
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="the tools agent episodes may call")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="evaluation: pass@1 as avg@k")
    exporter: ExporterConfig = Field(default_factory=ExporterConfig, description="the Prometheus exporter")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="TensorBoard and W&B (the tracker)")
    controller: ControllerConfig = Field(default_factory=ControllerConfig, description="the rollout scaling "
                                         "controller")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="the CPUs, threads and "
                                       "niceness astraflow run gives each kind of component")
    coupling: Literal["independent", "barrier"] = Field(
        default="independent", description="independent trainers, or lockstep versions across policies")
    max_wall_s: float | None = Field(default=None, gt=0, description="stop the run after this many seconds")
    watchdog_s: float = Field(default=120.0, gt=0, description="name what blocks a trainer whose version has not "
                                                               "moved for this many seconds (then again as often)")

    @field_validator("kafka", mode="before")
    @classmethod
    def _kafka_with_environment(cls, value: Any) -> Any:
        """A ``kafka:`` section from a file: what it leaves unset still comes from the environment."""
        return KafkaSecurity(**value) if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _defaults(self) -> "RunConfig":
        if self.run_dir is None:
            self.run_dir = Path("runs") / self.run
        self.run_dir = self.run_dir.absolute()
        if self.bus is None:
            self.bus = f"local://{self.run_dir / 'bus'}"
        if self.store is None:
            self.store = (self.run_dir / "weights").as_uri()
        if "kafka" in self.model_fields_set and not self.bus.startswith("kafka://") and not self.kafka.is_default:
            raise ValueError(f"kafka.security_protocol={self.kafka.security_protocol}: kafka settings apply to a "
                             f"kafka:// bus, and bus is {self.bus}")
        unknown = set(self.workflow.roles.values()) - set(self.policies)
        if unknown:
            raise ValueError(f"workflow.roles names policies {sorted(unknown)} that are not in policies "
                             f"({sorted(self.policies)})")
        need = max(p.batch_groups for p in self.policies.values())
        if self.raas.max_inflight_groups is not None and self.raas.max_inflight_groups < need:
            raise ValueError(f"raas.max_inflight_groups={self.raas.max_inflight_groups} is below a policy's "
                             f"batch_groups ({need}): paused workers would leave its trainer waiting")
        for name, p in self.policies.items():
            t = p.trainer
            if "policy" in t.model_fields_set and t.policy != name:
                raise ValueError(f"policies.{name}.trainer.policy={t.policy!r}: a policy's trainer is named after it "
                                 f"({name!r}); leave it unset")
            if "temperature" in t.model_fields_set and t.temperature != self.sampling.temperature:
                raise ValueError(f"policies.{name}.trainer.temperature ({t.temperature}) differs from "
                                 f"sampling.temperature ({self.sampling.temperature}): the trainer must divide logits "
                                 "by the temperature the rollouts were sampled at, or the importance ratios are "
                                 "biased; leave it unset to follow sampling.temperature")
        return self

    def filter_section(self, policy: str) -> FilterSection:
        """What ``policy``'s filter processors take of this config.

        Raises:
            KeyError: ``policy`` is not in ``policies``.
        """
        pc = self.policies[policy]
        return FilterSection(run=self.run, bus=self.bus, kafka=self.kafka, policy=policy, filters=pc.filters,
                             processor=pc.filter_processor)

    def raas_section(self) -> RaasSection:
        """What a RaaS worker takes of this config."""
        return RaasSection(run=self.run, bus=self.bus, kafka=self.kafka, store=self.store,
                           policies={p: pc.rollout_part() for p, pc in self.policies.items()},
                           workflow=self.workflow, sampling=self.sampling, n_samples=self.data.n_samples,
                           raas=self.raas, tools=self.tools,
                           fresh_fraction={p: 1.0 - sum(getattr(s, "ratio", 0.0) or 0.0 for s in pc.serving)
                                           for p, pc in self.policies.items()})

    def acquisition_section(self) -> AcquisitionSection:
        """What acquisition takes of this config: its curators gate the prompts of the first policy."""
        return AcquisitionSection(run=self.run, bus=self.bus, kafka=self.kafka, run_dir=self.run_dir, seed=self.seed,
                                  data=self.data, workflow=self.workflow.name, curators=self.curators,
                                  curated_policy=next(iter(self.policies)))

    def controller_section(self) -> ControllerSection:
        """What the scaling controller takes of this config."""
        return ControllerSection(run=self.run, workflow=self.workflow.name, policies=list(self.policies),
                                 workers=self.raas.workers, controller=self.controller)

    def metrics_section(self) -> MetricsSection:
        """What the readers of the run's metrics take of this config."""
        return MetricsSection(run=self.run, bus=self.bus, kafka=self.kafka, run_dir=self.run_dir,
                              policies=list(self.policies), workflow=self.workflow.name, exporter=self.exporter,
                              tracking=self.tracking)

    def replay_section(self, policy: str) -> ReplaySection:
        """What a replay of ``policy`` takes of this config.

        Raises:
            KeyError: ``policy`` is not in ``policies``.
        """
        pc = self.policies[policy]
        return ReplaySection(run=self.run, bus=self.bus, kafka=self.kafka, store=self.store, policy=policy,
                             model=pc.model, trainer=self.trainer_config(policy), steps=pc.steps,
                             batch_groups=pc.batch_groups, max_staleness=pc.max_staleness)

    def trainer_section(self, policy: str) -> TrainerSection:
        """What ``policy``'s trainer process takes of this config: its own directory ``<run_dir>/trainer.<policy>``,
        and with ``coupling: barrier`` among several policies, the others' steps as its barrier peers.

        Raises:
            KeyError: ``policy`` is not in ``policies``.
        """
        pc = self.policies[policy]
        peers = ({q: c.steps for q, c in self.policies.items() if q != policy}
                 if self.coupling == "barrier" and len(self.policies) > 1 else None)
        return TrainerSection(run=self.run, bus=self.bus, kafka=self.kafka, store=self.store, policy=policy,
                              model=pc.model, run_dir=self.run_dir / f"trainer.{policy}",
                              trainer=self.trainer_config(policy), steps=pc.steps, batch_groups=pc.batch_groups,
                              max_staleness=pc.max_staleness, checkpoint_every=pc.checkpoint_every,
                              keep_versions=pc.keep_versions, serving=pc.serving, barrier_peers=peers,
                              stop_on_collapse=pc.stop_on_collapse)

    def eval_section(self, policy: str) -> EvalSection:
        """What an evaluation of ``policy`` takes of this config (``eval``, ``sampling.max_new_tokens``).

        Raises:
            KeyError: ``policy`` is not in ``policies``.
        """
        pc = self.policies[policy]
        return EvalSection(run=self.run, bus=self.bus, kafka=self.kafka, store=self.store, run_dir=self.run_dir,
                           seed=self.seed, policy=policy, engine=pc.rollout_part(), param_dtype=pc.trainer.param_dtype,
                           benchmarks=self.eval.benchmarks, k=self.eval.k, temperature=self.eval.temperature,
                           limit=self.eval.limit, max_new_tokens=self.sampling.max_new_tokens)

    def trainer_config(self, policy: str) -> TrainerConfig:
        """Policy ``policy``'s trainer config as its trainer uses it: named ``policy``, dividing logits by
        ``sampling.temperature``. The config itself is not changed.

        Raises:
            KeyError: ``policy`` is not in ``policies``.
        """
        return self.policies[policy].trainer.model_copy(update={"policy": policy,
                                                                "temperature": self.sampling.temperature})


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None and i == 1 and parts[0] == "policies" and node:  # a typo, not a new policy made field by field
            raise ConfigError(f"override {dotted}: no policy {part!r} (the config has {', '.join(node)}); a new policy "
                              f"is given whole: policies.{part}={{model: ..., ...}}")
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def _nested(a: str, b: str) -> bool:
    """Whether one of two dotted paths (each ending in a dot) is inside the other, or they are the same."""
    return a.startswith(b) or b.startswith(a)


def _format(e: ValidationError, origin: str, overrides: list[str] = ()) -> str:
    """Pydantic's errors, one line per field (``<dotted field>: <reason>``), each field that an item of
    ``overrides`` (``key=value``) set or is inside named with that override."""
    lines = [f"invalid config {origin}:"]
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        # a validator's ValueError reads "Value error, <message>"; whole-config checks name their fields
        msg = str(err["ctx"]["error"]) if err["type"] == "value_error" and "error" in err.get("ctx", {}) else err["msg"]
        given = [o for o in overrides if loc and _nested(f"{o.partition('=')[0].strip()}.", f"{loc}.")]
        if given:
            msg += f" (the override {given[-1]})"
        lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")
    return "\n".join(lines)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML run config and apply ``key.sub=value`` overrides (values parsed as YAML).

    Raises:
        ConfigError: the file is missing or not a YAML mapping, an override is
            not ``key=value``, or a field is invalid (each field and reason listed).
    """
    tree: dict[str, Any] = {}
    origin = str(path) if path else "(overrides)"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} is a directory; give a YAML file (see examples/)" if p.is_dir()
                              else f"config file {p} does not exist")
        try:
            with p.open(encoding="utf-8") as f:  # a stream: the parser's messages name the file
                tree = yaml.safe_load(f) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 ({e.reason} at byte {e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. policies.actor.steps=5)")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({e.problem})") from None
        _set_dotted(tree, key.strip(), value)
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format(e, origin, list(overrides))) from None
