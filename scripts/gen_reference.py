#!/usr/bin/env python3
"""Generate the reference pages from the code, and the benchmark tables from the benchmarks' JSON:

- ``docs/reference/config.md``: every field of a run config, from the pydantic models under
  :class:`astraflow.config.RunConfig` (its type, default and description);
- ``docs/reference/cli.md``: every ``astraflow`` command, its arguments and options, from the typer app;
- ``docs/reference/metrics.md``: every figure a component reports on ``metrics`` and the Prometheus gauge the
  exporter serves it as, read (with ``ast``) from the code that builds the records (:data:`METRIC_SOURCES`) and
  from ``astraflow/exporter.py``;
- the tables of ``docs/benchmarks/index.md``: each block between ``<!-- generated from data/NAME.json ... -->``
  and ``<!-- end of generated table -->`` is rendered from ``docs/benchmarks/data/NAME.json``;
- the README's first run (its summary line and time, between ``<!-- generated first run ... -->`` and
  ``<!-- end of generated first run -->``), from the ``arith-tiny`` runs of ``docs/benchmarks/data/stability.json``.

Usage: ``scripts/gen_reference.py`` writes them; ``scripts/gen_reference.py --check`` writes nothing and exits 1
when a committed page differs from what the code and the JSON generate (``tests/scripts/test_gen_reference.py``
runs it), when a config field or an emitted metric has no description, or when a benchmark JSON lacks its
command, machine or commit, or has no table.
"""
from __future__ import annotations

import argparse
import ast
import enum
import inspect
import json
import re
import shlex
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG_PAGE = ROOT / "docs" / "reference" / "config.md"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
METRICS_PAGE = ROOT / "docs" / "reference" / "metrics.md"
BENCH_PAGE = ROOT / "docs" / "benchmarks" / "index.md"
BENCH_DATA = ROOT / "docs" / "benchmarks" / "data"
README = ROOT / "README.md"


def _models_in(annotation: typing.Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (through list, dict, tuple, Union, Optional and Annotated)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _type_name(annotation: typing.Any) -> str:
    """A readable type: ``int | None``, ``list[SourceConfig]``, ``Literal['a', 'b']``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return "Literal[" + ", ".join(repr(a) for a in args) + "]"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _default(field: typing.Any) -> str:
    """The field's default as YAML would write it; ``required`` when it has none."""
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return f"(`{type(value).__name__}` defaults)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, Path):
        value = str(value.relative_to(ROOT)) if value.is_relative_to(ROOT) else str(value)
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _cell(text: str) -> str:
    """Text fit for one markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def config_models(root: type[BaseModel]) -> list[tuple[type[BaseModel], list[str]]]:
    """Every model reachable from ``root``, depth first in field order, each with the config paths it sits at
    (``policies.<policy>.trainer``; ``[]`` for a list item, ``<key>`` for a mapping's value)."""
    found: dict[type[BaseModel], list[str]] = {root: [""]}
    order = [root]

    def visit(model: type[BaseModel], path: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            suffix = ""
            if typing.get_origin(annotation) is dict:
                suffix = ".<key>"
            elif typing.get_origin(annotation) in (list, tuple):
                suffix = "[]"
            for sub in _models_in(annotation):
                sub_path = f"{path}{name}{suffix}"
                if sub not in found:
                    found[sub] = [sub_path]
                    order.append(sub)
                    visit(sub, sub_path + ".")
                elif sub_path not in found[sub]:
                    found[sub].append(sub_path)

    visit(root, "")
    return [(m, found[m]) for m in order]


def undescribed(root: type[BaseModel]) -> list[str]:
    """``Model.field`` for every field reachable from ``root`` without a description."""
    return [f"{m.__name__}.{name}" for m, _ in config_models(root) for name, f in m.model_fields.items()
            if not f.description]


def config_reference() -> str:
    """The markdown of ``docs/reference/config.md``."""
    from astraflow.config import RunConfig

    lines = ["# Configuration reference", "",
             "Every field of a run config (`astraflow run CONFIG.yaml key=value ...`), generated from the config "
             "models by `scripts/gen_reference.py`: do not edit by hand. A field set to a value it refuses, or a "
             "field that does not exist, stops the run before it starts with the field named.", ""]
    for model, paths in config_models(RunConfig):
        where = ", ".join(f"`{p}`" for p in paths if p) or "the top level of the file"
        lines += [f"## {model.__name__}", "", f"At {where}.", "", "| field | type | default | description |",
                  "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            lines.append(f"| `{name}` | `{_cell(_type_name(field.annotation))}` | {_cell(_default(field))} | "
                         f"{_cell(field.description or '')} |")
        lines.append("")
    return "\n".join(lines)


def cli_reference() -> str:
    """The markdown of ``docs/reference/cli.md``."""
    import typer

    from astraflow.cli import app

    group = typer.main.get_command(app)
    lines = ["# Command-line reference", "",
             "Every `astraflow` command, generated from the CLI by `scripts/gen_reference.py`: do not edit by hand. "
             "`astraflow COMMAND --help` prints the same.", ""]
    for name in sorted(group.commands):
        command = group.commands[name]
        if command.hidden:
            continue
        usage = " ".join([f"astraflow {name}"] + [
            (p.name.upper() if p.required else f"[{p.name.upper()}]") + ("..." if p.nargs == -1 else "")
            for p in command.params if not p.opts[0].startswith("-")] + (["[OPTIONS]"] if any(
                p.opts[0].startswith("-") for p in command.params) else []))
        lines += [f"## `astraflow {name}`", "", "```", usage, "```", "", inspect.cleandoc(command.help or ""), ""]
        if command.params:
            lines += ["| argument or option | default | description |", "|---|---|---|"]
            for p in command.params:
                label = ", ".join(p.opts + list(getattr(p, "secondary_opts", []) or [])) \
                    if p.opts[0].startswith("-") else p.name.upper()
                default = "required" if p.required else ("" if p.default is None else f"`{p.default}`")
                lines.append(f"| `{label}` | {default} | {_cell(p.help or '')} |")
            lines.append("")
    return "\n".join(lines)



# --- metrics reference -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MetricSource:
    """Where a component builds the values of its ``Metric`` records: ``path`` (from the repository root), the
    function (``Class.method``, or None for the whole module), the variables that hold the values, the record's
    ``kind``, its component and when it is sent."""

    path: str
    function: str | None
    holders: tuple[str, ...]
    kind: str
    component: str
    when: str


METRIC_SOURCES = (
    MetricSource("trainer/loop.py", "Trainer.train_step", ("metrics",), "trainer", "trainer.<policy>", "each step"),
    MetricSource("trainer/service.py", "TrainerService.run", ("metrics",), "trainer", "trainer.<policy>",
                 "each step"),
    MetricSource("trainer/service.py", "TrainerService._publish", ("figures",), "trainer", "trainer.<policy>",
                 "each step"),
    MetricSource("weights/publisher.py", None, ("last_publish",), "trainer", "trainer.<policy>", "each step"),
    MetricSource("trainer/service.py", None, ("alert",), "trainer", "trainer.<policy>",
                 "an alert (publish failures, collapse, final version)"),
    MetricSource("trainer/collapse.py", "Collapse.values", ("return",), "trainer", "trainer.<policy>",
                 "an alert (collapse)"),
    MetricSource("producers/raas.py", "RaasWorker._maybe_metrics", ("values",), "raas", "raas-<worker id>",
                 "every 2 s"),
    MetricSource("policies/processor.py", "FilterProcessor.step", ("counts",), "policy", "policy.<policy>",
                 "every `metrics_interval_s`, counts since the last record"),
    MetricSource("policies/processor.py", "CuratorGate.submit", ("pending",), "policy", "curator.<policy>",
                 "every `metrics_interval_s`, counts since the last record"),
    MetricSource("astraflow/actuators.py", "Actuation.values", ("return",), "controller", "controller",
                 "each controller decision or actuation try"),
    MetricSource("consumers/evaluation.py", "EvalResult.metric_values", ("out",), "eval", "eval.<policy>",
                 "each evaluated version"),
)

#: What each figure means. A name here that no source emits fails the check, as does an emitted name without one.
METRIC_DESCRIPTIONS = {
    # the trainer, each step (trainer/loop.py)
    "loss": "the total loss of the step (mean over PPO epochs)",
    "pg_loss": "the policy-gradient part of the loss",
    "kl": "k3 KL to the initial model, per token (0 unless `kl_coef > 0`, which loads the initial model)",
    "entropy": "mean token entropy of the policy on the batch, nats per token",
    "clipfrac": "share of valid tokens clipped (PPO, TIS) or masked (M2PO)",
    "grad_norm": "gradient norm before clipping (mean over the step's updates)",
    "grad_norm_clipped": "gradient norm after clipping to `max_grad_norm`",
    "zero_adv_frac": "share of groups whose rewards were all equal (no gradient)",
    "adv_abs_mean": "mean |advantage| over the batch",
    "response_tokens": "mean generated tokens per sample",
    "turns_mean": "mean model turns per episode",
    "masked_frac": "share of tokens not trained (prompt, tool output, other policies' turns)",
    "reward_mean": "mean reward of the batch",
    "reward_std": "standard deviation of the batch's rewards",
    "staleness_mean": "mean staleness of the batch's groups, versions",
    "staleness_max": "largest staleness in the batch, versions",
    "staleness_hist/<k>": "groups of the batch at staleness k (the exporter: label `staleness`)",
    "is_ratio_mean": "mean importance ratio against the behaviour policy",
    "is_ratio_std": "standard deviation of the importance ratio",
    "is_ratio_min": "smallest importance ratio",
    "is_ratio_max": "largest importance ratio",
    "behaviour_kl": "KL between the behaviour policy and the trainer's, per token",
    "tokens": "generated tokens in the batch",
    "tokens_per_s": "tokens trained per second of step time",
    "step_s": "seconds of the step's computation",
    "wait_s": "seconds the trainer waited for this batch",
    "wait_frac": "`wait_s / (wait_s + step_s)`: how starved the trainer is (the scaling controller reads it)",
    "groups": "groups in the batch",
    "samples": "samples in the batch",
    "version": "the trainer's weight version after the step",
    # the trainer service, each step (trainer/service.py)
    "barrier_wait_s": "seconds waited at the multi-policy barrier before the step",
    "replayed": "groups of the batch served again from the replay pool",
    "dropped_stale": "groups dropped as stale while assembling the batch",
    "duplicates": "groups dropped as copies of an already served `group_id`",
    "rejected": "records of `samples.<policy>` refused as invalid (dead-lettered)",
    "dropped_stale_total": "groups dropped as stale since the trainer started",
    "steps_done": "steps of the lineage done",
    "publish_wait_s": "seconds the step waited for the publisher to take the weights",
    "durable_version": "the newest version stored and announced",
    "publish_bytes": "bytes of the newest published object (delta or full)",
    "publish_s": "seconds to encode, store and announce the newest published version (in the background)",
    "published_version": "the newest version published",
    "store_lost_total": "times the store no longer held the full snapshot the delta chain starts from (the version "
                        "was then published in full)",
    "publish_errors": "publishes that failed since the trainer started",
    "publish_failing": "1 while publishes are failing, 0 once a version is durable again",
    # collapse alerts (trainer/collapse.py)
    "collapse": "1: the collapse watch fired (the reward fell under half its best window while the entropy moved)",
    "collapse_step": "the step at which it fired",
    "reward_window": "mean reward of the last window when it fired",
    "reward_best_window": "the best window's mean reward",
    "best_step": "the last step of the best window",
    "entropy_window": "mean entropy of the last window",
    "entropy_best_window": "mean entropy of the best window",
    # RaaS (producers/raas.py)
    "prompts_total": "prompts rolled out by the worker",
    "groups_total": "groups written by the worker",
    "tokens_total": "tokens generated by the worker",
    "too_long_total": "prompts dead-lettered as longer than the model's context",
    "rollout_errors_total": "prompts dead-lettered because their rollout failed",
    "stopped": "1 in the last record of a worker that stopped on its own",
    "paused": "1 while backpressure holds the worker",
    "paused_frac": "share of the time since the last record the worker was held by backpressure",
    "paused_by_control": "1 while an operator's `pause` holds the worker",
    "throttled": "1 while an operator's `throttle` spaces the worker's batches",
    "version.<p>": "the weight version the worker's engine for policy p holds",
    "episodes_inflight": "episodes running now",
    "prompts_inflight": "prompts with episodes running now",
    "engine_batch.<p>": "mean requests per engine call for policy p",
    "tool.<name>.<q>_s": "a tool's latency percentile q (p50, p90, p99), seconds",
    "tool.<name>.calls_total": "calls to a tool",
    "tool.<name>.errors_total": "failed calls to a tool (timeouts, errors, bad answers)",
    "reward_errors_total": "reward computations that raised or timed out (scored 0)",
    "tool_parse_errors_total": "malformed tool calls in model turns, each answered to the model as an error",
    "tool_call_errors_total": "calls of an environment's tools that failed (unknown tool, bad arguments, raised, "
                              "timed out), each answered to the model as an error",
    # filters and curators (policies/processor.py)
    "consumed": "groups read from `trajectories.<policy>`",
    "kept": "groups the filters kept",
    "dropped": "groups a filter dropped",
    "dropped.<reason>": "groups dropped for one reason (the filter's `Decision.reason`)",
    "dead_letter": "records refused as invalid and dead-lettered",
    "submitted": "prompts the curators let through to `prompts`",
    "skipped": "prompts a curator held back",
    "skipped.<name>": "prompts held back by one curator",
    # the scaling controller (astraflow/actuators.py)
    "target_workers": "the controller's target number of RaaS workers (-1 before any)",
    "applied_workers": "the number the actuator last applied (-1 before any)",
    "actuator_errors": "failed actuation tries in all",
    "actuator_failing": "failed tries in a row of the current target",
    # evaluation (consumers/evaluation.py)
    "pass@1.<name>": "pass@1 (as avg@k) on the benchmark `name`",
    "stderr.<name>": "the standard error of that pass@1",
}


def _function(tree: ast.Module, qualname: str | None) -> ast.AST:
    """The function ``Class.method`` (or ``function``) of ``tree``; the module itself for None."""
    if qualname is None:
        return tree
    node: ast.AST = tree
    for part in qualname.split("."):
        node = next(n for n in ast.iter_child_nodes(node)
                    if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part)
    return node


def _key(node: ast.AST | None) -> str | None:
    """A metric name from a string constant or an f-string (``f"tool.{name}.{q}_s"`` -> ``tool.<name>.<q>_s``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            else:
                inner = v.value.values[0] if isinstance(v.value, ast.BoolOp) else v.value
                name = inner.attr if isinstance(inner, ast.Attribute) else getattr(inner, "id", "x")
                parts.append(f"<{name}>")
        return "".join(parts)
    return None


def _holder(node: ast.AST) -> str | None:
    """The variable name of ``x`` or ``self.x``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _dict_keys(node: ast.AST, module: ast.Module) -> list[str]:
    """The names a dict display, a comprehension over ``self.<attr>.items()`` (expanded with the keys of the dict
    display assigned to ``self.<attr>`` in the module), or a ``Counter(name=...)`` call puts in a mapping."""
    if isinstance(node, ast.Dict):
        return [k for k in map(_key, node.keys) if k is not None]
    if isinstance(node, ast.DictComp) and isinstance(node.key, ast.JoinedStr):
        it = node.generators[0].iter
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr == "items":
            attr = _holder(it.func.value)
            for n in ast.walk(module):
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict) and \
                        any(_holder(t) == attr for t in n.targets):
                    pattern = _key(node.key)
                    return [re.sub(r"<[^>]+>", k, pattern, count=1) for k in _dict_keys(n.value, module)]
    if isinstance(node, ast.DictComp) and _key(node.key) is not None:
        return [_key(node.key)]
    if isinstance(node, ast.Call) and _holder(node.func) == "Counter":
        return [kw.arg for kw in node.keywords if kw.arg]
    return []


def emitted_names(source: MetricSource) -> list[str]:
    """Every value name ``source`` puts in its records, in source order: dict displays assigned to a holder (or
    returned, with the holder ``return``; or passed to ``.alert``, with the holder ``alert``), item assignments
    ``holder[name] = ...`` / ``+=``, and ``holder.update(name=..., ...)``."""
    module = ast.parse((ROOT / source.path).read_text())
    scope = _function(module, source.function)
    names: list[str] = []
    for node in ast.walk(scope):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if _holder(target) in source.holders and node.value is not None:
                    names += _dict_keys(node.value, module)
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript) and _holder(target.value) in source.holders:
                    key = _key(target.slice)
                    if key is not None:
                        names.append(key)
        if isinstance(node, ast.Return) and "return" in source.holders and node.value is not None:
            names += _dict_keys(node.value, module)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "update" and _holder(node.func.value) in source.holders:
                names += [kw.arg for kw in node.keywords if kw.arg]
                names += [k for arg in node.args for k in _dict_keys(arg, module)]
            if node.func.attr == "alert" and "alert" in source.holders:
                names += [k for arg in node.args for k in _dict_keys(arg, module)]
    return list(dict.fromkeys(names))


def _prometheus_name(value_name: str) -> str:
    """The exporter's gauge for a value name, placeholders kept (``tool.<name>.<q>_s`` ->
    ``astraflow_tool_<name>_<q>_s``; ``staleness_hist/<k>`` -> ``astraflow_staleness_hist{staleness="<k>"}``)."""
    from astraflow.exporter import metric_name

    holes = re.findall(r"<[^>]+>", value_name)
    masked = value_name
    for i, hole in enumerate(holes):
        masked = masked.replace(hole, f"HOLE{i}X", 1)
    name, labels = metric_name(masked)
    for i, hole in enumerate(holes):
        name = name.replace(f"HOLE{i}X", hole)
        labels = {k: v.replace(f"HOLE{i}X", hole) for k, v in labels.items()}
    return name + ("{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")


def exporter_families() -> list[tuple[str, str, list[str]]]:
    """The gauge families the exporter serves beside the components' figures: ``family(name, doc, labels)``
    calls in :meth:`astraflow.exporter.MetricsExporter.collect`, as (name, doc, labels)."""
    module = ast.parse((ROOT / "astraflow" / "exporter.py").read_text())
    found = []
    for node in ast.walk(_function(module, "MetricsExporter.collect")):
        if isinstance(node, ast.Call) and _holder(node.func) == "family" and isinstance(node.args[0], ast.Constant):
            labels = [e.value for e in node.args[2].elts] if isinstance(node.args[2], ast.List) else []
            found.append((node.args[0].value, node.args[1].value, labels))
    return found


def metrics_problems() -> list[str]:
    """Emitted names without a description, and described names no source emits."""
    emitted = {n for s in METRIC_SOURCES for n in emitted_names(s)}
    poll = _function(ast.parse((ROOT / "astraflow" / "exporter.py").read_text()), "MetricsExporter.poll")
    step_kept = any(isinstance(n, ast.Subscript) and _key(n.slice) == "step" and isinstance(n.ctx, ast.Store)
                    for n in ast.walk(poll))
    return (([] if step_kept else ["astraflow/exporter.py no longer serves `step`: update metrics_reference()"]) +
            [f"metric without a description in scripts/gen_reference.py: {n}" for n in sorted(emitted)
             if n not in METRIC_DESCRIPTIONS] +
            [f"described metric that no component emits: {n}" for n in sorted(METRIC_DESCRIPTIONS)
             if n not in emitted])


def metrics_reference() -> str:
    """The markdown of ``docs/reference/metrics.md``."""
    lines = ["# Metrics reference", "",
             "Every figure a component reports on the run's `metrics` topic, and the Prometheus gauge "
             "`astraflow exporter` serves it as, generated by `scripts/gen_reference.py` from the code that builds "
             "the records and from `astraflow/exporter.py`: do not edit by hand.", "",
             "Each value `name` of a record is served as the gauge `astraflow_<name>{component, kind, policy}` "
             "(characters outside `[a-zA-Z0-9_]` become `_`; the newest value per component). The same figures "
             "are in the run's `metrics.jsonl` (trainer steps), TensorBoard and W&B (the tracker), the live view "
             "and `astraflow status`. `<...>` stands for a part of the name that varies.", "",
             "## Served by the exporter itself", "", "| gauge | labels | what |", "|---|---|---|",
             "| `astraflow_step` | `component`, `kind`, `policy` | the step (or evaluated version) of the "
             "component's newest record that has one |"]
    for name, doc, labels in exporter_families():
        lines.append(f"| `{name}` | {', '.join(f'`{x}`' for x in labels)} | {_cell(doc)} |")
    lines.append("")
    by_kind: dict[str, list[tuple[MetricSource, str]]] = {}
    for source in METRIC_SOURCES:
        for name in emitted_names(source):
            rows = by_kind.setdefault(source.kind, [])
            if name not in {n for _, n in rows}:
                rows.append((source, name))
    for kind, rows in by_kind.items():
        components = sorted({s.component for s, _ in rows})
        lines += [f"## kind `{kind}`", "", f"Component {', '.join(f'`{c}`' for c in components)}.", "",
                  "| value | gauge | sent | what | where |", "|---|---|---|---|---|"]
        for source, name in rows:
            where = f"`{source.path}`" + (f" (`{source.function}`)" if source.function else "")
            lines.append(f"| `{name}` | `{_cell(_prometheus_name(name))}` | {_cell(source.when)} | "
                         f"{_cell(METRIC_DESCRIPTIONS.get(name, ''))} | {where} |")
        lines.append("")
    return "\n".join(lines)


# --- benchmark tables --------------------------------------------------------------------------------------------

_BLOCK = re.compile(r"(<!-- generated from data/(?P<name>[\w-]+)\.json by scripts/gen_reference\.py: do not edit -->\n)"
                    r"(?P<body>.*?)(<!-- end of generated table -->)", re.S)


def _range(spread: dict, fmt: str = "{:.3f}") -> str:
    """``median [min, max]`` of a ``scripts/spread.py`` spread."""
    return f"{fmt.format(spread['median'])} [{fmt.format(spread['min'])}, {fmt.format(spread['max'])}]"


def _provenance(data: dict) -> str:
    """The line under a table: the command, the commit and the machine it ran on."""
    note = f" {data['conditions']}." if data.get("conditions") else ""
    dirty = " (with uncommitted changes)" if data.get("dirty") else ""
    return f"`{shlex.join(data['command'])}`, commit `{data['commit']}`{dirty}, on {data['machine']}.{note}"


def stability_table(data: dict) -> str:
    """``data/stability.json`` (``scripts/bench_stability.py``): per example, then per run."""
    lines = ["| example | runs | collapsed | final / best, median [min, max] | gain, median [min, max] |",
             "|---|---|---|---|---|"]
    for name, ex in data["examples"].items():
        lines.append(f"| `{name}` | {ex['gain']['n']} | {ex['collapsed']} | {_range(ex['final_over_best'])} | "
                     f"{_range(ex['gain'], '{:+.3f}')} |")
    lines += ["", "| example | seed | steps | reward first -> last | best | final / best | wall s | collapse alerts |",
              "|---|---|---|---|---|---|---|---|"]
    for r in data["per_run"]:
        lines.append(f"| `{r['example']}` | {r['seed']} | {r['steps']} | {r['reward_first']:.3f} -> "
                     f"{r['reward_last']:.3f} | {r['reward_best']:.3f} | {r['final_over_best']:.3f} | "
                     f"{r['wall_s']:.0f} | {r['collapse_alerts']} |")
    return "\n".join(lines + ["", _provenance(data), ""])


def weights_table(data: dict) -> str:
    """``data/weights.json`` (``scripts/bench_weights.py``): per learning rate, median [min, max] over steps."""
    index = "uint32" if data["paper_index_bytes"] == 4 else "uint64"
    lines = ["| lr | unchanged (sparsity) | bytes per change (previous coding) | entropy estimate, bytes per change | "
             f"delta / full bf16 | delta / paper layout ({index} index) | encode / memcpy | decode / memcpy |",
             "|---|---|---|---|---|---|---|---|"]
    for lr, row in data["by_lr"].items():
        lines.append(f"| {lr} | {_range(row['sparsity'], '{:.4f}')} | {_range(row['bytes_per_change'], '{:.2f}')} "
                     f"({row['previous_format_bytes_per_change']['median']:.2f}) | "
                     f"{_range(row['entropy_bytes_per_change'], '{:.2f}')} | "
                     f"{_range(row['delta_over_full'], '{:.4f}')} | {_range(row['delta_over_paper'], '{:.2f}')} | "
                     f"{_range(row['encode_over_memcpy'], '{:.2f}')} | {_range(row['decode_over_memcpy'], '{:.2f}')} |")
    return "\n".join(lines + ["", f"{data['repetitions']}; {data['model']}. " + _provenance(data), ""])


def bus_table(data: dict) -> str:
    """``data/bus.json`` (``scripts/bench_bus.py``): groups/s per variant and ours / raw, round by round."""
    names = {"ours": "AstraFlow codec + Kafka", "raw": "raw confluent-kafka, same bytes",
             "local": "AstraFlow codec + embedded `local://` bus"}
    lines = ["| variant | groups/s, median [min, max] | rounds |", "|---|---|---|"]
    for key, spread in data["groups_s"].items():
        lines.append(f"| {names.get(key, key)} | {_range(spread, '{:.1f}')} | "
                     f"{', '.join(f'{r:.1f}' for r in spread['runs'])} |")
    ratio = data["ratio_spread"]
    lines += ["", f"AstraFlow / raw, round by round: {_range(ratio, '{:.2f}')} "
              f"({', '.join(f'{r:.2f}' for r in ratio['runs'])}); {data['mb_per_group']} MB per group."]
    return "\n".join(lines + ["", _provenance(data), ""])


def agentic_table(data: dict) -> str:
    """``data/agentic.json`` (``scripts/bench_agentic.py``): steps/s per arm and tool latency, and the ratios."""
    lines = ["| arm | " + " | ".join(f"steps/s at {lat} s, runs" for lat in data["latencies_s"]) + " |",
             "|---|" + "---|" * len(data["latencies_s"])]
    for arm in data["arms"]:
        runs = data["runs"][arm]
        lines.append(f"| `{arm}` | " + " | ".join(", ".join(f"{r:.4f}" for r in runs[f"{lat:g}"])
                                                 for lat in data["latencies_s"]) + " |")
    ratios = ", ".join(f"{k} {data[k]}" for k in ("vs_sync", "vs_pipeline_1", "vs_trl", "latency_hidden")
                       if data.get(k) is not None)
    lines += ["", f"At {data['ref_latency_s']} s: {ratios}; {data['rounds']} round(s) of {data['steps']} steps, "
              f"model `{data['model']}`" + (f", TRL on `{data['trl_model']}`" if data.get("trl_model") else "") + "."]
    return "\n".join(lines + ["", _provenance(data), ""])


#: keys of a result that are where it ran, not what it measured (shown under the table)
_PROVENANCE_KEYS = ("command", "commit", "machine", "conditions", "dirty")


def _is_spread(value: object) -> bool:
    return isinstance(value, dict) and {"median", "min", "max"} <= value.keys()


def _number(value: float) -> str:
    """A measured number: 4 significant digits, or whole units from 1,000 on (no exponent)."""
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _figure(value: object) -> str:
    """One figure of a result as a table cell: a spread as ``median [min, max]`` and its runs, a list joined."""
    if _is_spread(value):
        runs = value.get("runs")
        spread = f"{_number(value['median'])} [{_number(value['min'])}, {_number(value['max'])}]"
        return spread + (f" (runs {', '.join(_number(r) for r in runs if r is not None)})" if runs else "")
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, list):
        return ", ".join(_figure(v) for v in value) or "none"
    return _cell(json.dumps(value) if isinstance(value, dict) else str(value))


def _flat(data: dict, prefix: str = "") -> list[tuple[str, object]]:
    """``(dotted key, figure)`` of every figure of a result, mappings other than spreads opened key by key."""
    rows: list[tuple[str, object]] = []
    for key, value in data.items():
        if not prefix and key in _PROVENANCE_KEYS:
            continue
        if isinstance(value, dict) and value and not _is_spread(value):
            rows += _flat(value, f"{prefix}{key}.")
        else:
            rows.append((f"{prefix}{key}", value))
    return rows


def result_table(data: dict) -> str:
    """A bench's whole last line, one figure per row (the benches without a table of their own): the keys are the
    bench's (its module docstring says what each is)."""
    lines = ["| figure | value |", "|---|---|"]
    lines += [f"| `{key}` | {_figure(value)} |" for key, value in _flat(data)]
    return "\n".join(lines + ["", _provenance(data), ""])


def staleness_table(data: dict) -> str:
    """``data/staleness.json`` (``scripts/bench_staleness.py``): one row per staleness and correction."""
    lines = ["| staleness / correction | gain, runs | clipped or masked | importance ratio [min, max] | behaviour KL | "
             "entropy | staleness, mean |", "|---|---|---|---|---|---|---|"]
    for cell, c in data["cells"].items():
        lines.append(f"| `{cell}` | {', '.join(f'{g:+.3f}' for g in c['gains'])} | {c['clipfrac']:.3f} | "
                     f"[{c['is_ratio_min']:.3f}, {c['is_ratio_max']:.2f}] | {c['behaviour_kl']:.4f} | "
                     f"{c['entropy']:.3f} | {c['staleness_mean']:.2f} |")
    lines += ["", f"Gain of `{data['default_correction']}` at staleness {data['staleness']} over its gain at 0: "
              f"{_figure(data['ratio_spread'])}; `none` at {data['staleness']}: {data['none_at_max']:+.3f}; "
              f"{data['repeats']} repetition(s) of {data['steps']} steps."]
    return "\n".join(lines + ["", _provenance(data), ""])


#: each committed benchmark JSON's table (by file name, without ``.json``); any other is rendered by result_table
BENCH_TABLES = {"stability": stability_table, "weights": weights_table, "bus": bus_table, "agentic": agentic_table,
                "agentic-hermes": agentic_table, "staleness": staleness_table}


def bench_problems() -> list[str]:
    """Benchmark JSON files without command, machine or commit, or without a generated block on the page."""
    problems = []
    page = BENCH_PAGE.read_text() if BENCH_PAGE.exists() else ""
    blocks = {m.group("name") for m in _BLOCK.finditer(page)}
    for path in sorted(BENCH_DATA.glob("*.json")):
        data, shown = json.loads(path.read_text()), path.relative_to(BENCH_PAGE.parent)
        missing = [k for k in ("command", "machine", "commit") if not data.get(k)]
        if missing:
            problems.append(f"{shown} lacks {', '.join(missing)}")
        if path.stem not in blocks:
            problems.append(f"{shown} has no generated block in {BENCH_PAGE.name}")
    problems += [f"{BENCH_PAGE.name}: a block names data/{name}.json, which does not exist"
                 for name in sorted(blocks) if not (BENCH_DATA / f"{name}.json").exists()]
    return problems


def bench_page() -> str:
    """``docs/benchmarks/index.md`` with every generated block rendered from its JSON."""
    def render(m: re.Match) -> str:
        path = BENCH_DATA / f"{m.group('name')}.json"
        if not path.exists():
            return m.group(0)
        render_table = BENCH_TABLES.get(m.group("name"), result_table)
        return m.group(1) + "\n" + render_table(json.loads(path.read_text())) + "\n" + m.group(4)
    return _BLOCK.sub(render, BENCH_PAGE.read_text())

_FIRST_RUN = re.compile(r"(<!-- generated first run from docs/benchmarks/data/stability\.json by scripts/gen_reference\.py: "
                        r"do not edit -->\n)(?P<body>.*?)(<!-- end of generated first run -->)", re.S)


def first_run(data: dict) -> str:
    """The README's first run: the summary line of the first ``arith-tiny`` run of ``data/stability.json``, and
    the wall time and rewards of all its ``arith-tiny`` runs."""
    runs = [r for r in data["per_run"] if r["example"] == "arith-tiny"]
    r = runs[0]
    walls = sorted(x["wall_s"] for x in runs)
    cores = re.search(r"nproc (\d+)", data["machine"]).group(1)
    return "\n".join([
        "```",
        f'{{"run": "arith-tiny", "complete": {str(r["complete"]).lower()}, "restarts": 0, "steps": {r["steps"]}, '
        f'"versions": {{"actor": {r["steps"]}}},',
        f' "reward_first": {r["reward_first"]}, "reward_last": {r["reward_last"]}, "reward_best": {r["reward_best"]}, '
        f'"final_over_best": {r["final_over_best"]}, "collapses": {{}}, ...}}',
        "```",
        "",
        f"On a {cores}-core machine it took {walls[0]:.0f}-{walls[-1]:.0f} s in {len(runs)} runs (seeds "
        f"{', '.join(str(x['seed']) for x in runs)}), the reward rising "
        + ", ".join(f"{x['reward_first']:.2f} -> {x['reward_last']:.2f}" for x in runs) + "",
        f"(`{' '.join(data['command'])}`, commit `{data['commit']}`, {data['machine']}).",
        ""])


_RESULTS = re.compile(r"(<!-- generated results from docs/benchmarks/data by scripts/gen_reference\.py: do not edit -->\n)"
                      r"(?P<body>.*?)(<!-- end of generated results -->)", re.S)


def headline_results(stability: dict, agentic: dict, weights: dict) -> str:
    """The README's three results, each a sentence from its committed JSON and a link to its benchmark page."""
    page = "docs/benchmarks/index.md"
    seeds = len({r["seed"] for r in stability["per_run"]})
    worst = min(x for r in stability["examples"].values() for x in r["final_over_best"]["runs"])
    lrs = list(weights["by_lr"].items())
    per_change = [row["bytes_per_change"]["median"] for _, row in lrs]
    of_full = [row["delta_over_full"]["median"] for _, row in lrs]
    trl = f" and {agentic['vs_trl']:.0f}x TRL's `GRPOTrainer`" if agentic.get("vs_trl") is not None else ""
    return "\n".join([
        f"- **Runs stay learned.** {stability['collapsed']} of {stability['runs']} runs of the CPU learning examples "
        f"({', '.join(stability['examples'])}; {seeds} seeds) collapsed; the worst ended at {worst:.3f} of its best "
        f"window's reward ([Learning that holds]({page}#learning-that-holds)).",
        f"- **Tool latency is hidden.** With a search tool of {agentic['ref_latency_s']} s median latency, the "
        f"pipeline trains {agentic['vs_sync']:.1f}x the steps per second of a synchronous loop{trl}, at "
        f"{agentic['latency_hidden']:.2f} of its own rate with an instant tool ([Agentic episodes with a slow "
        f"tool]({page}#agentic-episodes-with-a-slow-tool): {agentic['rounds']} round(s), with its conditions).",
        f"- **Small weight updates travel small.** A version's sparse bf16 delta costs {per_change[0]:.2f} to "
        f"{per_change[-1]:.2f} bytes per changed weight at learning rates {lrs[0][0]} to {lrs[-1][0]}, "
        f"{of_full[0]:.1%} to {of_full[-1]:.1%} of a full bf16 snapshot ([Weight deltas by learning "
        f"rate]({page}#weight-deltas-by-learning-rate)).",
        ""])


def readme() -> str:
    """``README.md`` with its first run and its results rendered from ``docs/benchmarks/data``."""
    data = {name: json.loads((BENCH_DATA / f"{name}.json").read_text()) for name in ("stability", "agentic", "weights")}
    text = _FIRST_RUN.sub(lambda m: m.group(1) + first_run(data["stability"]) + m.group(3), README.read_text())
    return _RESULTS.sub(lambda m: m.group(1) + headline_results(**data) + m.group(3), text)


def main(argv: list[str] | None = None) -> int:
    """Write the pages, or with ``--check`` compare them; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is out of date")
    args = parser.parse_args(argv)
    from astraflow.config import RunConfig

    missing = undescribed(RunConfig)
    if missing:
        print(f"config fields without a description: {', '.join(missing)}", file=sys.stderr)
        return 1
    problems = metrics_problems() + bench_problems()
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    stale = []
    for page, text in ((CONFIG_PAGE, config_reference()), (CLI_PAGE, cli_reference()),
                       (METRICS_PAGE, metrics_reference()), (BENCH_PAGE, bench_page()), (README, readme())):
        if args.check:
            if not page.exists() or page.read_text() != text:
                stale.append(str(page.relative_to(ROOT)))
        else:
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(text)
            print(f"wrote {page.relative_to(ROOT)}")
    if stale:
        print(f"out of date (run scripts/gen_reference.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
