"""The config sections of the rollout side: acquisition's data sources, sampling, the engines' servers, the agent
workflow, the RaaS workers and their tools, and the two sections a producer component takes
(:class:`AcquisitionSection`, :class:`RaasSection`). ``astraflow/config.py`` composes them into the run config,
which validates the whole once and cuts each component its section.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.config import CuratorSpec
from producers.sources import source_name
from topics.kafka_security import KafkaSecurity


class _Strict(BaseModel, extra="forbid"):
    """A config section that refuses fields it does not define."""


class SourceConfig(_Strict):
    """One prompt source: a registered name (``arith``, ``gsm8k``, ``math500``, ...) or a file path."""

    name: str = Field(min_length=1, description="a built-in source (arith, gsm8k, math500, ...) or a dataset file or "
                      "directory, whose stem names the source")
    weight: float = Field(default=1.0, gt=0, description="mixing weight across sources")
    adapter: str | None = Field(default=None, description="record adapter for a file source")
    split: str | None = Field(default=None, description="split of a saved HF DatasetDict; None: train, or its only "
                              "split")
    limit: int | None = Field(default=None, ge=1, description="use only the first N records")


class DataConfig(_Strict):
    """Acquisition: sources, group size G, epochs and shuffling, and what a bad record costs.

    A bad record (not UTF-8, not JSON, a missing field, a prompt over ``max_prompt_chars``) is
    logged with its ``path:line``, counted and written to ``deadletter``, and acquisition goes on;
    with ``strict`` it stops there instead and exits non-zero (``producers/acquisition.py``).
    """

    sources: list[SourceConfig] = Field(default_factory=lambda: [SourceConfig(name="arith")], min_length=1,
                                        description="the prompt sources, mixed by weight")
    n_samples: int = Field(default=8, ge=2, description="G: samples per prompt, at least 2 (GRPO's advantage is a "
                           "reward minus its group's mean: a group of one never learns)")
    epochs: int = Field(default=1, ge=1, description="passes over each source")
    shuffle_seed: int = Field(default=0, description="seed of each epoch's shuffle of a source's records")
    max_outstanding: int = Field(default=256, ge=1, description="prompts written but not yet taken by RaaS")
    max_prompt_chars: int | None = Field(
        default=32768, ge=1, description="longest prompt acquisition accepts, counted in characters of the prompt's "
                                         "text (acquisition loads no tokenizer); a longer one is rejected to "
                                         "deadletter. None: no limit. RaaS also rejects, in tokens, a prompt that "
                                         "does not fit its model's context")
    strict: bool = Field(default=False, description="stop acquisition at the first bad record it reads (in the "
                                                    "order data.shuffle_seed gives; exit non-zero) "
                                                    "instead of rejecting it to deadletter and going on")

    @model_validator(mode="after")
    def _distinct_source_names(self) -> "DataConfig":
        seen: dict[str, int] = {}
        for i, src in enumerate(self.sources):
            name = source_name(src.name)
            if name in seen:
                raise ValueError(f"sources[{seen[name]}] ({self.sources[seen[name]].name}) and sources[{i}] ({src.name}) "
                                 f"share the source name {name!r}, which every prompt_id is made of: their records "
                                 "would get the same ids and one's be dropped as the other's duplicates (rename a file)")
            seen[name] = i
        return self


class SamplingConfig(_Strict):
    """Rollout sampling. The trainer divides logits by the same temperature."""

    max_new_tokens: int = Field(default=8, ge=1, description="tokens per turn")
    temperature: float = Field(default=1.0, gt=0, description="sampling temperature; the trainer divides logits by "
                               "it too")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling mass; 1: off")



#: ``sglang.launch_server`` arguments the SGLang engine sets itself (``sglang.launch_args`` must not repeat them)
SGLANG_OWN_ARGS = ("--model-path", "--host", "--port", "--weight-version")


class SGLangConfig(_Strict):
    """How a policy's SGLang engine (``engine: sglang``) reaches its server: attach to ``url``, or (no
    ``url``) launch ``python -m sglang.launch_server`` in each RaaS worker on ``port`` with ``launch_args``
    (``producers/sglang_engine.py``)."""

    url: str | None = Field(default=None, description="attach to a running SGLang server (http://host:port); "
                                                      "None: each worker launches its own")
    port: int | None = Field(default=None, ge=1, le=65535, description="the launched server's port; None: a free "
                             "port, so that two policies or workers on one host never collide")
    launch_args: list[str] = Field(default_factory=list, description="extra sglang.launch_server arguments, "
                                   "e.g. [--mem-fraction-static, '0.5', --tp-size, '2']")
    startup_timeout_s: float = Field(default=600.0, gt=0, description="seconds to wait for the server's /health")
    timeout_s: float = Field(default=600.0, gt=0, description="per-request HTTP timeout, seconds (a generation or "
                             "one weight-update request)")
    bucket_bytes: int = Field(default=256 << 20, ge=1, description="tensor bytes per /update_weights_from_tensor "
                              "request (a larger tensor goes alone)")
    attempts: int = Field(default=5, ge=1, description="tries per HTTP call (connection errors and 5xx answers are "
                          "retried with exponential back-off)")
    pause_mode: Literal["abort", "in_place"] = Field(default="abort", description="how a weight update pauses the "
                                                     "server: abort (other clients' requests in flight are aborted; "
                                                     "the radix cache is flushed) or in_place (they are kept; needs "
                                                     "a server launched with --disable-radix-cache)")

    @model_validator(mode="after")
    def _attach_or_launch(self) -> "SGLangConfig":
        if self.url is not None and (self.port is not None or self.launch_args):
            raise ValueError("sglang.url attaches to a running server: sglang.port and sglang.launch_args are "
                             "for a launched one (leave url unset to launch)")
        own = [a for a in self.launch_args if a.split("=", 1)[0] in SGLANG_OWN_ARGS]
        if own:
            raise ValueError(f"sglang.launch_args has {own}: the engine sets {', '.join(SGLANG_OWN_ARGS)} itself "
                             "(use sglang.port for the port)")
        return self


class VLLMConfig(_Strict):
    """How a policy's vLLM engine (``engine: vllm``) reaches its server: attach to ``url``, or (no ``url``)
    ``astraflow run`` starts one server per policy, the component ``vllm.<policy>`` (``producers/vllm_server.py``,
    its URL given to the RaaS workers as ``astraflow raas --vllm-url <policy>=<url>``),
    in vLLM's own venv, in the dtype the trainer publishes (``trainer.param_dtype``)."""

    url: str | None = Field(default=None, description="attach to a running server (http://host:port), started with "
                            "AstraFlow's worker extension and VLLM_SERVER_DEV_MODE=1; None: astraflow run starts one")
    port: int | None = Field(default=None, ge=1, le=65535, description="the started server's port; None: a free one")
    python: Path = Field(default=Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python",
                         description="the vLLM venv's interpreter (scripts/install_vllm.sh makes it)")
    args: list[str] = Field(default_factory=list, description="extra vllm api_server arguments")
    max_model_len: int | None = Field(default=None, ge=1, description="longest prompt plus completion, tokens "
                                      "(None: the model's own limit)")
    kv_cache_gib: float = Field(default=1.0, gt=0, description="KV cache of the CPU backend (VLLM_CPU_KVCACHE_SPACE)")
    startup_timeout_s: float = Field(default=900.0, gt=0, description="how long RaaS workers wait for its /health")
    @model_validator(mode="after")
    def _attach_or_start(self) -> "VLLMConfig":
        if self.url is not None and ({"port", "args", "max_model_len", "kv_cache_gib", "python"}
                                     & self.model_fields_set):
            raise ValueError("vllm.url attaches to a running server: vllm.port, args, max_model_len, kv_cache_gib "
                             "and python are for a started one (leave url unset)")
        return self



class WorkflowConfig(_Strict):
    """The agent workflow and which policy plays each of its roles."""

    name: str = Field(default="single_turn", description="the registered workflow, e.g. single_turn, multi_turn, "
                      "search_agent")
    module: str | None = Field(default=None, description="a user's module to import first, which registers the "
                               "workflow `name` (@register_workflow); found on sys.path or in the working directory")
    roles: dict[str, str] = Field(default_factory=dict, description="role -> policy name")
    options: dict[str, Any] = Field(default_factory=dict, description="workflow options, e.g. max_turns")

    @model_validator(mode="after")
    def _user_workflow_registers(self) -> "WorkflowConfig":
        if self.module is None:
            return self
        from policies.registry import import_user_module
        from producers.workflows import registered_workflows

        try:
            import_user_module(self.module)
        except ImportError as e:
            raise ValueError(f"workflow.module: cannot import {self.module!r}: {e}") from None
        workflows = registered_workflows()
        if self.name not in workflows:
            raise ValueError(f"workflow.module {self.module!r} registers no workflow {self.name!r} (registered: "
                             f"{sorted(workflows)})")
        return self

    def check_tools(self, tools: ToolsConfig) -> None:
        """Check that ``tools`` configures every tool the workflow declares it calls
        (:attr:`producers.workflows.Workflow.tools`). A workflow not registered is not checked here (building it
        names it).

        Raises:
            ValueError: a declared tool ``tools`` lacks, naming the field ``tools.<name>``.
        """
        from producers.workflows import registered_workflows

        workflow = registered_workflows().get(self.name)
        configured = tools.names()
        for name in workflow.tools if workflow is not None else ():
            if name not in configured:
                raise ValueError(f"tools.{name}: workflow {self.name!r} calls the tool {name!r}, and the config "
                                 f"does not configure it (configured tools: {sorted(configured) or 'none'})")


class RaasConfig(_Strict):
    """Rollout workers."""

    workers: int = Field(default=1, ge=1, description="RaaS worker processes astraflow run starts (the scaling "
                         "controller's starting point)")
    batch_prompts: int = Field(default=8, ge=1, description="prompts per rollout batch")
    max_inflight_groups: int | None = Field(
        default=None, ge=1, description="per policy: pause while more of its groups than this wait for its filters "
                                        "and trainer; at least each policy's batch_groups (else a trainer could "
                                        "starve); None: batch_groups x max(max_staleness, 1) per policy")
    session_timeout_s: float = Field(default=30.0, gt=0, description="seconds before a dead worker's prompts move")
    max_episodes: int = Field(default=256, ge=1, description="the most samples (episodes) a worker rolls out at "
                              "once, over every prompt in flight (a sample that ended while the others of its group "
                              "run does not count); a prompt starts while fewer are running")




class SearchLatency(_Strict):
    """The search server's latency per request: log-normal with this median and 99th percentile (seconds;
    mu = ln(median), sigma = ln(p99 / median) / 2.3263). median_s 0: no delay."""

    median_s: float = Field(default=0.0, ge=0, description="median latency, seconds; 0: no delay")
    p99_s: float = Field(default=0.0, ge=0, description="99th percentile latency, seconds (>= median_s)")

    @model_validator(mode="after")
    def _ordered(self) -> "SearchLatency":
        if self.median_s == 0 and self.p99_s > 0:
            raise ValueError(f"p99_s={self.p99_s} with median_s=0 (no delay): set median_s too")
        if self.p99_s < self.median_s:
            raise ValueError(f"p99_s ({self.p99_s}) is below median_s ({self.median_s})")
        return self


class SearchFaults(_Strict):
    """Faults the search server injects, each a probability per request (seeded: ``tools.search.seed``)."""

    hang: float = Field(default=0.0, ge=0, le=1, description="never answer in time (sleep hang_s)")
    error: float = Field(default=0.0, ge=0, le=1, description="answer HTTP 500 with a text body")
    garbage: float = Field(default=0.0, ge=0, le=1, description="answer HTTP 200 with a body that is not JSON")
    hang_s: float = Field(default=3600.0, gt=0, description="seconds a hung request sleeps")

    @model_validator(mode="after")
    def _at_most_one(self) -> "SearchFaults":
        if self.hang + self.error + self.garbage > 1 + 1e-9:
            raise ValueError(f"hang + error + garbage = {self.hang + self.error + self.garbage:g} > 1")
        return self


class SearchToolConfig(_Strict):
    """The ``search`` tool of agent episodes (:mod:`producers.search_tool`): attach to the server at ``url``, or
    (no ``url``) ``astraflow run`` starts one, the component ``search`` (``astraflow search-server``,
    :mod:`producers.search_server`), and gives its URL to the RaaS workers (``astraflow raas --search-url``)."""

    url: str | None = Field(default=None, description="attach to a running search server (http://host:port); "
                            "None: astraflow run starts one")
    corpus: Path | None = Field(default=None, description="the started server's JSONL corpus ({doc_id, text} a "
                                "line); None: the built-in producers/data/search_kb.jsonl")
    port: int | None = Field(default=None, ge=1, le=65535, description="the started server's port; None: a free one")
    latency: SearchLatency = Field(default_factory=SearchLatency, description="the started server's latency per "
                                   "request")
    faults: SearchFaults = Field(default_factory=SearchFaults, description="faults the started server injects")
    seed: int = Field(default=0, description="seed of the started server's latency and fault draws")
    timeout_s: float = Field(default=5.0, gt=0, description="the client's bound on one call, seconds")
    top_k: int = Field(default=1, ge=1, description="results per call")
    @model_validator(mode="after")
    def _attach_or_start(self) -> "SearchToolConfig":
        started = sorted({"corpus", "port", "latency", "faults", "seed"} & self.model_fields_set)
        if self.url is not None and started:
            raise ValueError(f"url attaches to a running server: {', '.join(started)} are for a started one "
                             "(leave url unset)")
        return self


class CustomToolConfig(BaseModel):
    """A user's own tool, ``{class: "package.module:Class", **params}``: an async callable (argument in, answer out,
    never raising for a failed call), built as ``Class(**params)`` in each RaaS worker. The module is imported and
    ``params`` checked against the class's signature when the config is read."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    cls: str = Field(alias="class", pattern=r"^[\w.]+:\w+$", description="package.module:Class of the tool")

    def params(self) -> dict[str, Any]:
        """The keyword arguments of the tool's class."""
        return dict(self.model_extra or {})

    def tool_class(self) -> type:
        """The tool's class, imported (:func:`policies.registry.user_class`).

        Raises:
            ValueError: the module cannot be imported or has no such class.
        """
        from policies.registry import user_class

        return user_class(self.cls)

    @model_validator(mode="after")
    def _class_takes_params(self) -> "CustomToolConfig":
        from policies.registry import check_params

        check_params(self.cls, self.tool_class(), self.params())
        return self


class ToolsConfig(_Strict):
    """The tools agent episodes may call: ``search`` (built in) and the user's own, by the name a workflow calls
    them by (``tools: {calculator: {class: "my_tools:Calculator", digits: 6}}``)."""

    model_config = ConfigDict(extra="allow")

    search: SearchToolConfig | None = Field(default=None, description="the search tool; None: no search")
    __pydantic_extra__: dict[str, CustomToolConfig] = Field(init=False)  # the user's tools, validated as such

    def custom(self) -> dict[str, CustomToolConfig]:
        """The user's own tools, by name."""
        return dict(self.model_extra or {})

    def names(self) -> set[str]:
        """The names of every tool configured: ``search`` when set, and the user's own."""
        return ({"search"} if self.search is not None else set()) | set(self.custom())


class RolloutPolicyConfig(_Strict):
    """What rollout needs of one trained policy: its model, its engine and how the engine reaches its server, and
    what bounds the groups RaaS keeps in flight for it (the run config's policy section holds these and the
    trainer's own)."""

    model: str = Field(min_length=1, description="an HF model directory, or 'tiny' for the built-in tiny model")
    engine: Literal["hf", "sglang", "vllm"] = Field(default="hf", description="the inference engine of RaaS")
    sglang: SGLangConfig = Field(default_factory=SGLangConfig, description="the SGLang server (engine: sglang)")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig, description="the vLLM server (engine: vllm)")
    batch_groups: int = Field(default=16, ge=1, description="groups per training step")
    max_staleness: int = Field(default=8, ge=0, description="versions; older samples are dropped")
    checkpoint_every: int = Field(default=10, ge=1, description="steps between checkpoints (RaaS counts the "
                                  "samples a restarted trainer would read again as in flight)")

    @model_validator(mode="after")
    def _engine_settings_fit(self) -> "RolloutPolicyConfig":
        for engine in ("sglang", "vllm"):
            if engine in self.model_fields_set and self.engine != engine:
                raise ValueError(f"{engine} settings apply to engine: {engine}, and engine is {self.engine!r}")
        if self.engine == "vllm" and self.vllm.url is None and not self.vllm.python.exists():
            raise ValueError(f"engine: vllm starts a server with {self.vllm.python}, which does not exist: run "
                             "scripts/install_vllm.sh, or set vllm.python, or vllm.url for a running server")
        return self

    def rollout_part(self) -> "RolloutPolicyConfig":
        """This section's rollout fields alone (of a subclass's instance: without the subclass's fields)."""
        return RolloutPolicyConfig.model_construct(self.model_fields_set & set(RolloutPolicyConfig.model_fields),
                                                   **{k: getattr(self, k) for k in RolloutPolicyConfig.model_fields})


class RunAddress(_Strict):
    """Where a component finds its run: the run's name and its bus (with Kafka's security settings)."""

    run: str = Field(pattern=r"^[A-Za-z0-9._-]+$", description="the run name every topic and group is prefixed with")
    bus: str = Field(description="kafka://host:port or local://PATH")
    kafka: KafkaSecurity = Field(default_factory=KafkaSecurity, description="SASL and TLS of a kafka:// bus")


class AcquisitionSection(RunAddress):
    """What acquisition takes (:func:`producers.acquisition.acquire_run`)."""

    run_dir: Path = Field(description="the run's directory; acquisition keeps its positions under <run_dir>/acquisition")
    seed: int = Field(description="seed of the sources' own sampling")
    data: DataConfig = Field(description="the prompt sources and what a bad record costs")
    workflow: str = Field(description="the workflow whose RaaS group takes the prompts")
    curators: list[CuratorSpec] = Field(default_factory=list, description="the curators' configs, in order")
    curated_policy: str = Field(description="the policy whose curator group reads outcomes")


class RaasSection(RunAddress):
    """What one RaaS worker takes (:class:`producers.raas.RaasWorker`)."""

    store: str = Field(description="the weight store, file:///abs/dir or s3://bucket/prefix")
    policies: dict[str, RolloutPolicyConfig] = Field(min_length=1, description="the run's policies, by name")
    workflow: WorkflowConfig = Field(description="the agent workflow and its roles")
    sampling: SamplingConfig = Field(description="rollout sampling")
    n_samples: int = Field(ge=1, description="G: samples per prompt")
    raas: RaasConfig = Field(description="the rollout workers' own settings")
    tools: ToolsConfig = Field(description="the tools agent episodes may call")
    fresh_fraction: dict[str, float] = Field(default_factory=dict, description="per policy, the fraction of each "
                                             "training batch made of fresh groups: 1 - its serving policy's replay "
                                             "ratio (from policies.<p>.serving; a policy not named: 1)")

    @model_validator(mode="after")
    def _workflow_tools_configured(self) -> "RaasSection":
        self.workflow.check_tools(self.tools)
        return self
