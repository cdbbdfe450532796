"""Message schemas: the values carried on AstraFlow topics (DESIGN.md, "Message shapes").

Each schema is a pydantic model, validated when it is built and when it is
decoded. Numeric per-token arrays are 1-D numpy arrays with a fixed dtype; on
the wire they travel as raw little-endian buffers (msgpack ``bin``), see
:mod:`topics.codec`.

Every schema has a class-level ``SCHEMA`` name and ``VERSION``. A reader
rejects a name it does not expect and a version newer than its own.
"""
from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, model_validator


def _array_type(dtype: str) -> Any:
    """An annotated numpy array field of ``dtype``, serialised as little-endian bytes.

    Accepts a numpy array, a list, or ``bytes`` (the wire form). Arrays decoded
    from bytes are read-only views of the message buffer (no copy).

    Raises:
        ValueError: the value is not 1-D, or bytes are not a multiple of the item size.
    """
    wire = np.dtype(dtype).newbyteorder("<")

    def coerce(value: Any) -> np.ndarray:
        if isinstance(value, (bytes, bytearray, memoryview)):
            if len(value) % wire.itemsize:
                raise ValueError(f"{len(value)} bytes is not a whole number of {dtype} items")
            return np.frombuffer(value, dtype=wire)
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise ValueError(f"expected a 1-D {dtype} array, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "biuf":
            raise ValueError(f"expected numbers for a {dtype} array, got dtype {arr.dtype}")
        return np.ascontiguousarray(arr, dtype=wire)

    def to_wire(arr: np.ndarray) -> bytes:
        return np.ascontiguousarray(arr, dtype=wire).tobytes()

    return Annotated[np.ndarray, BeforeValidator(coerce), PlainSerializer(to_wire, return_type=bytes)]


Int32Array = _array_type("int32")
UInt8Array = _array_type("uint8")
Float32Array = _array_type("float32")


class Message(BaseModel):
    """Base of all topic messages: strict fields, a schema name and a version."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=False)
    SCHEMA: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1

    def routing(self) -> dict[str, str]:
        """Routing metadata repeated in Kafka headers (DESIGN.md): str -> str."""
        return {}


class Prompt(Message):
    """One prompt for a rollout. ``prompt_id`` is stable: a hash of source and record index."""

    SCHEMA: ClassVar[str] = "Prompt"
    prompt_id: str = Field(min_length=1)
    source: str = Field(min_length=1)
    task_type: str = Field(min_length=1, description="math, code, arith, ...")
    messages: list[dict[str, str]] | None = Field(default=None, description="chat turns {role, content}")
    text: str | None = None
    answer: str | None = Field(default=None, description="gold answer for math tasks")
    tests: str | None = Field(default=None, description="test code for code tasks")
    entry_point: str | None = None
    workflow: str = "single_turn"
    n_samples: int = Field(default=8, ge=1, description="G, samples per group")
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _has_content(self) -> "Prompt":
        if not self.messages and not self.text:
            raise ValueError("a Prompt needs `messages` or `text`")
        for i, turn in enumerate(self.messages or []):
            if "role" not in turn or "content" not in turn:
                raise ValueError(f"messages[{i}] needs `role` and `content`")
        return self

    def routing(self) -> dict[str, str]:
        return {"task_type": self.task_type, "workflow": self.workflow}


class Sample(BaseModel):
    """One trajectory of a group. All arrays have the same length L (tokens).

    - ``input_ids`` int32[L]: prompt and generated tokens.
    - ``loss_mask`` uint8[L]: 1 on tokens this policy generated.
    - ``behavior_logprobs`` float32[L]: log-probability of each token under the
      weights that sampled it (0 where ``loss_mask`` is 0).
    - ``versions`` int32[L]: weight version that produced each token, -1 on prompt tokens.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)
    input_ids: Int32Array
    loss_mask: UInt8Array
    behavior_logprobs: Float32Array
    versions: Int32Array
    reward: float
    finish_reason: str = "stop"
    turns: int = Field(default=1, ge=0)

    @model_validator(mode="after")
    def _same_length(self) -> "Sample":
        n = len(self.input_ids)
        for name in ("loss_mask", "behavior_logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has length {len(getattr(self, name))}, input_ids has {n}")
        if not np.isfinite(self.reward):
            raise ValueError(f"reward must be finite, got {self.reward}")
        return self


class TrajectoryGroup(Message):
    """G samples for one prompt and one policy, with the group's reward statistics."""

    SCHEMA: ClassVar[str] = "TrajectoryGroup"
    prompt_id: str = Field(min_length=1)
    group_id: str = Field(min_length=1, description="unique per rollout; the de-duplication key")
    policy: str = Field(min_length=1)
    source: str = ""
    task_type: str = ""
    workflow: str = "single_turn"
    samples: list[Sample] = Field(min_length=1)
    reward_mean: float
    reward_std: float
    zero_adv: bool
    producer_id: str = ""
    created_ts: float = Field(default_factory=time.time, description="seconds since the epoch")
    min_version: int
    max_version: int

    @model_validator(mode="after")
    def _versions(self) -> "TrajectoryGroup":
        if self.min_version > self.max_version:
            raise ValueError(f"min_version {self.min_version} > max_version {self.max_version}")
        return self

    @classmethod
    def build(cls, *, samples: list[Sample], **fields: Any) -> "TrajectoryGroup":
        """Build a group, deriving reward mean/std, ``zero_adv`` and the version range from ``samples``.

        The version range covers generated tokens (``versions >= 0``); a group
        with none gets ``min_version = max_version = -1``.
        """
        rewards = np.array([s.reward for s in samples], dtype=np.float64)
        gen = [s.versions[s.versions >= 0] for s in samples]
        gen = np.concatenate(gen) if gen else np.zeros(0, np.int32)
        return cls(
            samples=samples,
            reward_mean=float(rewards.mean()),
            reward_std=float(rewards.std()),
            zero_adv=bool(np.all(rewards == rewards[0])),
            min_version=int(gen.min()) if gen.size else -1,
            max_version=int(gen.max()) if gen.size else -1,
            **fields,
        )

    def routing(self) -> dict[str, str]:
        return {
            "policy": self.policy,
            "model_version_min": str(self.min_version),
            "model_version_max": str(self.max_version),
            "task_type": self.task_type,
            "producer_id": self.producer_id,
            "zero_adv": "1" if self.zero_adv else "0",
        }


class RolloutOutcome(Message):
    """The rewards of one group, for curators and dashboards (no tokens)."""

    SCHEMA: ClassVar[str] = "RolloutOutcome"
    prompt_id: str = Field(min_length=1)
    group_id: str = Field(min_length=1)
    policy: str = Field(min_length=1)
    rewards: list[float] = Field(min_length=1)
    zero_adv: bool
    version: int
    source: str = ""
    task_type: str = ""
    producer_id: str = ""
    ts: float = Field(default_factory=time.time)

    def routing(self) -> dict[str, str]:
        return {"policy": self.policy, "model_version_min": str(self.version),
                "model_version_max": str(self.version), "task_type": self.task_type,
                "producer_id": self.producer_id, "zero_adv": "1" if self.zero_adv else "0"}


class WeightAnnouncement(Message):
    """A new weight version is durable in the object store."""

    SCHEMA: ClassVar[str] = "WeightAnnouncement"
    VERSION: ClassVar[int] = 2  # 2: samples_consumed
    policy: str = Field(min_length=1)
    version: int = Field(ge=0)
    base_version: int | None = Field(default=None, description="the version a delta applies to; None for full")
    kind: Literal["delta", "full"]
    uri: str = Field(min_length=1)
    bytes: int = Field(ge=0, description="size of the stored object, bytes")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$",
                        description="checksum of the resulting full parameters: weights.codec.state_sha256 "
                                    "(sha256 over names, dtypes, shapes and each tensor's xxh3-128)")
    sparsity: float = Field(ge=0.0, le=1.0, description="fraction of elements unchanged vs base_version")
    reason: str = ""
    samples_consumed: int | None = Field(
        default=None, ge=0, description="the trainer's position on samples.<policy> after the batch that made "
                                        "this version (records, summed over partitions); None when unknown")
    created_ts: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _base(self) -> "WeightAnnouncement":
        if self.kind == "delta" and (self.base_version is None or self.base_version >= self.version):
            raise ValueError(f"a delta needs base_version < version, got {self.base_version} -> {self.version}")
        return self

    def routing(self) -> dict[str, str]:
        return {"policy": self.policy, "model_version_min": str(self.version),
                "model_version_max": str(self.version)}


class Control(Message):
    """An operator or controller command for a component, on the compacted ``control`` topic under
    :meth:`key` (the newest command of each kind per component is its state).

    Commands RaaS workers obey (``component`` ``raas.<workflow>`` for every worker of a workflow, or
    ``raas.<workflow>/raas-<id>`` for one): ``pause`` / ``resume``, and ``throttle`` with ``value`` the
    prompts a minute a worker may roll out, batches spaced to that rate (``value`` None lifts it). ``target_replicas`` (``value``
    workers, keyed ``raas.<workflow>``) is the scaling controller's decision, carried out by an actuator.

    Raises:
        pydantic.ValidationError: ``value`` missing or below 1 for ``target_replicas``, below 1 for
            ``throttle``, or set for ``pause`` / ``resume``.
    """

    SCHEMA: ClassVar[str] = "Control"
    component: str = Field(min_length=1)
    action: Literal["pause", "resume", "throttle", "target_replicas", "barrier", "stop"]
    value: int | None = None
    policy: str | None = None
    reason: str | None = Field(default=None, description="why (a controller's decision says what it saw)")
    ts: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _check_value(self) -> "Control":
        if self.action == "target_replicas" and (self.value is None or self.value < 1):
            raise ValueError(f"target_replicas needs a value of at least 1 worker, got {self.value}")
        if self.action == "throttle" and self.value is not None and self.value < 1:
            raise ValueError(f"throttle value is prompts a minute, at least 1 (None lifts it), got {self.value}")
        if self.action in ("pause", "resume") and self.value is not None:
            raise ValueError(f"{self.action} takes no value, got {self.value}")
        return self

    def key(self) -> str:
        """The record key on ``control``: pause and resume share ``<component>:pause``, a throttle has
        ``<component>:throttle`` (so compaction keeps one of each), every other action the component."""
        if self.action in ("pause", "resume"):
            return f"{self.component}:pause"
        if self.action == "throttle":
            return f"{self.component}:throttle"
        return self.component


class TrainerProgress(Message):
    """A trainer's heartbeat on ``control`` (compacted, keyed ``trainer.<policy>``): how far it has read.

    ``consumed`` is the trainer's position on ``samples.<policy>``: records taken out of the
    topic (trained, or dropped as stale or duplicate), summed over partitions, so that
    ``sum(end offsets) - consumed`` is the policy's backlog. ``finished``: the trainer reached
    its steps or was stopped; it consumes nothing more and holds no rollout back.
    ``at_barrier``: it waits for peer policies (``coupling: barrier``), not for its own data;
    while it does its backlog holds no rollout back either, so that the peers can get data.
    ``starving``: its last wait for a batch ran out with nothing to train (a short batch is trained): whatever
    ``sum(end offsets) - consumed`` says, its backlog holds no rollout back (backpressure never decides progress:
    offsets it will never read, such as aborted transactions, cannot hold RaaS at its limit).
    """

    SCHEMA: ClassVar[str] = "TrainerProgress"
    VERSION: ClassVar[int] = 2  # 2: starving
    policy: str = Field(min_length=1)
    consumed: int = Field(ge=0, description="records, summed over the partitions of samples.<policy>")
    version: int = Field(ge=0, description="the trainer's weight version")
    finished: bool = False
    at_barrier: bool = False
    starving: bool = False
    ts: float = Field(default_factory=time.time)

    def routing(self) -> dict[str, str]:
        return {"policy": self.policy, "model_version_min": str(self.version),
                "model_version_max": str(self.version)}


class TrainedBatch(Message):
    """The groups one trainer step trained, on ``trained`` (compacted, keyed ``<policy>/<version>``).

    Sent when the step's checkpoint is taken, before it is written. A version is never reused: a
    trainer resumed from checkpoint ``c`` after versions up to ``u > c`` were published gives the
    checkpoint's weights version ``u + 1`` and records that as a batch of no groups with
    ``base_version`` ``c``; versions ``c + 1 .. u`` are then off the policy's lineage, and
    :func:`trainer.service.trained_batches` leaves their records out (the steps were redone). Replay
    (:mod:`astraflow.replay`) and the exactly-once audit (:mod:`astraflow.audit`) read it.
    """

    SCHEMA: ClassVar[str] = "TrainedBatch"
    policy: str = Field(min_length=1)
    version: int = Field(ge=1, description="the weight version the step produced")
    base_version: int | None = Field(default=None, ge=0, description="the version the step started from; None: "
                                     "version - 1. Set (with no groups) where a resume renumbered the weights")
    group_ids: list[str] = Field(description="the fresh groups of the batch, in batch order")
    replayed_ids: list[str] = Field(default_factory=list, description="groups re-served by the replay policy")
    ts: float = Field(default_factory=time.time)

    def routing(self) -> dict[str, str]:
        return {"policy": self.policy, "model_version_min": str(self.version),
                "model_version_max": str(self.version)}


class PolicyState(Message):
    """A stateful data policy chain's checkpoint on ``state`` (compacted, keyed by ``component``).

    ``states[i]`` is ``policies[i].state_dict()`` (plain msgpack-able data), taken after the chain applied
    every record of ``source`` below ``offsets`` (partition -> next offset to apply), as
    Kafka Streams' changelog topics do for a state store.
    """

    SCHEMA: ClassVar[str] = "PolicyState"
    component: str = Field(min_length=1)
    policies: list[str] = Field(description="the chain's policy names, in config order")
    states: list[dict[str, Any]]
    source: str = Field(min_length=1, description="the topic whose records built the state")
    offsets: dict[str, int] = Field(default_factory=dict, description="partition number (a string: msgpack map keys) "
                                    "-> next offset of source")
    ts: float = Field(default_factory=time.time)

    @model_validator(mode="after")
    def _one_state_per_policy(self) -> "PolicyState":
        if len(self.states) != len(self.policies):
            raise ValueError(f"{len(self.states)} states for {len(self.policies)} policies")
        return self


class Metric(Message):
    """A metrics record from one component: flat name -> number."""

    SCHEMA: ClassVar[str] = "Metric"
    component: str = Field(min_length=1)
    kind: str = Field(default="", description="trainer, raas, policy, ...")
    policy: str | None = None
    step: int | None = None
    values: dict[str, float]
    ts: float = Field(default_factory=time.time)

    def routing(self) -> dict[str, str]:
        return {"policy": self.policy} if self.policy else {}


class DeadLetter(Message):
    """A message a consumer rejected: its raw bytes, the error and where it came from."""

    SCHEMA: ClassVar[str] = "DeadLetter"
    topic: str
    partition: int
    offset: int
    key: bytes | None = None
    value: bytes | None = None
    headers: dict[str, bytes] = Field(default_factory=dict)
    error: str
    consumer_group: str = ""
    ts: float = Field(default_factory=time.time)


SCHEMAS: dict[str, type[Message]] = {
    cls.SCHEMA: cls
    for cls in (Prompt, TrajectoryGroup, RolloutOutcome, WeightAnnouncement, Control, TrainerProgress, TrainedBatch,
                PolicyState, Metric, DeadLetter)
}
