"""The typed configs of the data policies a run config names: its ``filters``, ``serving`` and ``curators`` lists;
and the section of a policy's filter processors (:class:`FilterSection`).

Each entry is one of the built-in policies' configs, picked by its ``name`` (a discriminated union: a misspelled
parameter is refused with its name when the run config is read), or ``{name: "package.module:Class", ...}``, a
user's own class, whose parameters are checked against the class's signature then. The values' ranges are the
policies' own to check: a built-in config is built once when it is read (:func:`policies.registry.build_policy`),
so its class refuses a bad value then; a user's class is built when ``astraflow run`` checks the config
(``preflight``) and when its component starts.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, model_validator

from policies.registry import build_policy, check_params, resolve_policy
from topics.kafka_security import KafkaSecurity


class BuiltinPolicyConfig(BaseModel, extra="forbid"):
    """A built-in policy's config: ``name`` and the parameters its class takes."""

    def params(self) -> dict[str, Any]:
        """The keyword arguments of the policy's class."""
        return self.model_dump(exclude={"name"})

    @model_validator(mode="after")
    def _class_takes_values(self) -> "BuiltinPolicyConfig":
        build_policy(self)  # PolicyConfigError (a ValueError) names the parameter and what is wrong with its value
        return self


class AcceptAllConfig(BuiltinPolicyConfig):
    """``accept_all`` (:class:`policies.filters.AcceptAll`): keep every group, submit every prompt."""

    name: Literal["accept_all"] = Field(description="the identity policy, a filter or a curator")


class FilterZeroAdvConfig(BuiltinPolicyConfig):
    """``filter_zero_adv`` (:class:`policies.filters.FilterZeroAdv`): drop groups whose rewards are all equal."""

    name: Literal["filter_zero_adv"] = Field(description="DAPO's dynamic sampling")


class FilterLengthConfig(BuiltinPolicyConfig):
    """``filter_length`` (:class:`policies.filters.FilterLength`): drop groups with over-long or truncated samples."""

    name: Literal["filter_length"] = Field(description="the length filter")
    max_tokens: int | None = Field(default=None, description="the most generated tokens a sample may have (>= 1); "
                                                             "None: no limit")
    max_truncated_fraction: float = Field(default=0.5, description="the largest tolerated fraction of samples that "
                                                                   "ended at the length limit, in [0, 1]")


class FilterFormatConfig(BuiltinPolicyConfig):
    """``filter_format`` (:class:`policies.filters.FilterFormat`): drop groups with too many malformed samples."""

    name: Literal["filter_format"] = Field(description="the format filter")
    bad_finish_reasons: list[str] | None = Field(default=None, description="finish reasons that mark a malformed "
                                                 "sample; None: format_error, abort, error")
    max_bad_fraction: float = Field(default=0.0, description="the largest tolerated fraction of bad samples, "
                                                             "in [0, 1]")


class FilterSolvedConfig(BuiltinPolicyConfig):
    """``filter_solved`` (:class:`policies.curators.FilterSolved`): skip prompts the policy already solves."""

    name: Literal["filter_solved"] = Field(description="the solved-prompt curator")
    alpha: float = Field(default=0.5, description="EWMA weight of the newest outcome, in (0, 1]")
    threshold: float = Field(default=0.9, description="success-rate EWMA at or above which a prompt is skipped, "
                                                      "in [0, 1]")
    success_reward: float = Field(default=1.0, description="a sample with at least this reward is a success")


class GresoConfig(BuiltinPolicyConfig):
    """``greso`` (:class:`policies.curators.Greso`): GRPO with efficient selective rollout."""

    name: Literal["greso"] = Field(description="the GRESO curator")
    p_easy: float = Field(default=0.5, description="initial exploration probability of easy prompts, in (0, 1]")
    p_hard: float = Field(default=0.5, description="initial exploration probability of hard prompts, in (0, 1]")
    floor: float = Field(default=0.05, description="the least submit probability, in [0, 1]")
    target_easy: float = Field(default=0.25 / 3, description="target easy zero-variance ratio per version, in [0, 1]")
    target_hard: float = Field(default=0.25 * 2 / 3, description="target hard zero-variance ratio per version, "
                                                                 "in [0, 1]")
    step: float = Field(default=0.01, description="the adaptation step of p per version (>= 0)")
    p_min: float = Field(default=0.05, description="the least value p adapts down to, in (0, 1]")
    solved_reward: float = Field(default=1.0, description="a zero-variance group with this reward or more is easy")
    seed: int = Field(default=0, description="seed of the submit draws")


class ReplayConfig(BuiltinPolicyConfig):
    """``replay`` (:class:`policies.replay.Replay`): serve a fraction of each batch from a pool of past groups."""

    name: Literal["replay"] = Field(description="the replay serving policy")
    capacity: int = Field(default=10000, description="the most groups the pool holds (>= 1)")
    ratio: float = Field(default=0.25, description="the fraction of each batch served from the pool, in [0, 1)")
    max_staleness: int | None = Field(default=None, description="groups more than this many versions old are "
                                      "evicted; None: the policy's max_staleness")
    seed: int = Field(default=0, description="seed of the draws from the pool")


class CustomPolicyConfig(BaseModel):
    """A user's own policy class, ``{name: "package.module:Class", **params}``: the module must be importable, and
    the class take ``params`` (checked against its signature here)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[\w.]+:\w+$", description="package.module:Class, a subclass of policies.base.Policy")

    def params(self) -> dict[str, Any]:
        """The keyword arguments of the policy's class."""
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _class_takes_params(self) -> "CustomPolicyConfig":
        check_params(self.name, resolve_policy(self.name), self.params())
        return self


def _tag(entry: Any) -> str | None:
    name = entry.get("name") if isinstance(entry, dict) else getattr(entry, "name", None)
    return "custom" if isinstance(name, str) and ":" in name else name


def _union(*configs: type[BuiltinPolicyConfig]) -> Any:
    names = [c.model_fields["name"].annotation.__args__[0] for c in configs]
    tagged = [Annotated[c, Tag(name)] for c, name in zip(configs, names)]
    return Annotated[Union[(*tagged, Annotated[CustomPolicyConfig, Tag("custom")])], Discriminator(
        _tag, custom_error_type="unknown_policy",
        custom_error_message=f"unknown policy name; known here: {', '.join(names)}, or package.module:Class")]


#: one entry of a policy's ``filters``
FilterSpec = _union(AcceptAllConfig, FilterZeroAdvConfig, FilterLengthConfig, FilterFormatConfig)
#: one entry of the run's ``curators``
CuratorSpec = _union(AcceptAllConfig, FilterSolvedConfig, GresoConfig)
#: one entry of a policy's ``serving``
ServingSpec = _union(ReplayConfig)
#: a data policy's config, of any kind
PolicySpec = BuiltinPolicyConfig | CustomPolicyConfig

_ANY_SPEC = TypeAdapter(_union(AcceptAllConfig, FilterZeroAdvConfig, FilterLengthConfig, FilterFormatConfig,
                               FilterSolvedConfig, GresoConfig, ReplayConfig))


def policy_spec(entry: dict[str, Any]) -> PolicySpec:
    """The typed config of one policy entry ``{"name": ..., **params}``, of any kind (a run config reads its lists
    through :data:`FilterSpec`, :data:`CuratorSpec` and :data:`ServingSpec`, which admit only their kind).

    Raises:
        pydantic.ValidationError: an unknown name (the known ones listed), a parameter the policy does not take,
            a value of the wrong type.
    """
    return _ANY_SPEC.validate_python(entry)


class FilterProcessorConfig(BaseModel, extra="forbid"):
    """A policy's filter processors (``policies/processor.py``): how many, and their transaction shape."""

    instances: int = Field(default=1, ge=1, description="processors in consumer group filter.<policy>; instance i "
                           "has transactional.id <run>.filter.<policy>.<i> and they share trajectories' partitions")
    max_records: int = Field(default=200, ge=1, description="records per poll batch (= per transaction)")
    linger_s: float = Field(default=0.1, ge=0, description="seconds to keep collecting after the first record")
    metrics_interval_s: float = Field(default=5.0, gt=0, description="seconds between metrics records")
    session_timeout_s: float = Field(default=10.0, gt=0, description="seconds before a killed processor's "
                                     "partitions move to the others")
    step_deadline_s: float = Field(default=200.0, gt=0, description="seconds one batch (poll, filters, sends, "
                                   "commit; its bounded calls add up to ~150 s) may take before the processor writes "
                                   "its stacks to its log and exits to be restarted; astraflow run also kills a "
                                   "processor that leaves records waiting at unmoved committed offsets for 40 s more")


class FilterSection(BaseModel, extra="forbid"):
    """What a policy's filter processor takes (:func:`policies.processor.main`)."""

    run: str = Field(pattern=r"^[A-Za-z0-9._-]+$", description="the run name every topic and group is prefixed with")
    bus: str = Field(description="kafka://host:port or local://PATH")
    kafka: KafkaSecurity = Field(default_factory=KafkaSecurity, description="SASL and TLS of a kafka:// bus")
    policy: str = Field(description="the policy whose filter chain runs")
    filters: list[FilterSpec] = Field(description="the filter chain, in order")
    processor: FilterProcessorConfig = Field(description="the processors' count and transaction shape")
