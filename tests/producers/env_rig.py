"""A tiny policy that speaks the hermes tool format, for the environment tests (no download).

:func:`hermes_policy` copies the tiny arithmetic model (``weights.models.tiny_model_dir``), gives its tokenizer a
Qwen2.5-style chat template (tools in a ``<tools>`` system block, calls as ``<tool_call>`` JSON, tool results as
``<tool_response>`` in a user turn) and fine-tunes it on whole episodes of the search task, token for token as
the ``environment`` workflow builds them, until it replays each greedily.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

from producers.environments import render, render_delta
from topics.schemas import TrajectoryGroup

HERMES_TEMPLATE = (  # every newline is an expression's: HF renders with trim_blocks, which drops one after a tag
    "{% if tools or messages[0].role == 'system' %}<|im_start|>system"
    "{% if messages[0].role == 'system' %}{{ '\\n' + messages[0].content }}{% endif %}"
    "{% if tools %}{{ '\\n<tools>' }}{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>' }}{% endif %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user{{ '\\n' + m.content }}<|im_end|>{{ '\\n' }}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant{{ '\\n' + (m.content or '') }}"
    "{% for tc in m.tool_calls or [] %}{% set f = tc.function if tc.function is defined else tc %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (f.arguments | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}")

SEARCH_SCHEMA = {"type": "function", "function": {
    "name": "search", "description": "Search the knowledge base.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}

#: A search episode whose first turn is two parallel calls (:func:`episode_ids`): question, entities, documents,
#: answer.
PARALLEL = ("codes of zovob and kunov?", ("zovob", "kunov"), ("the code of zovob is 846", "the code of kunov is 993"),
            "846")


def call_text(name: str, arguments: dict) -> str:
    """A hermes tool call as the model writes it."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def episode_ids(tokenizer, question: str, entity: str | tuple[str, ...], document: str | tuple[str, ...],
                answer: str, tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """The token ids of a whole search episode (prompt, call, tool turn, answer, EOS) and its loss mask. With
    tuples of entities and documents, the first turn is parallel calls, one per entity, that the model ends with
    EOS (a turn sampled without stop strings), answered by one tool turn per call. ``tools``: the tool schemas
    rendered (None: :data:`SEARCH_SCHEMA` alone)."""
    tools = tools or [SEARCH_SCHEMA]
    entities = (entity,) if isinstance(entity, str) else tuple(entity)
    documents = (document,) if isinstance(document, str) else tuple(document)
    prompt = tokenizer.encode(render(tokenizer, [{"role": "user", "content": question}], tools),
                              add_special_tokens=False)
    call = tokenizer.encode("\n".join(call_text("search", {"query": e}) for e in entities), add_special_tokens=False)
    if not isinstance(entity, str):
        call.append(tokenizer.eos_token_id)
    delta = tokenizer.encode(render_delta(tokenizer, [{"role": "tool", "tool_call_id": f"call_{i}", "name": "search",
                                                       "content": d} for i, d in enumerate(documents)],
                                          tools), add_special_tokens=False)
    final = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    ids = prompt + call + delta + final
    mask = [0] * len(prompt) + [1] * len(call) + [0] * len(delta) + [1] * len(final)
    return ids, mask


def hermes_policy(base: Path, out: Path, episodes: list[tuple], steps: int = 300,
                  tools: list[dict] | None = None) -> Path:
    """``base`` copied to ``out`` with :data:`HERMES_TEMPLATE`, fine-tuned on ``episodes`` (question, entity,
    document, answer; with ``tools``: :func:`episode_ids`) until greedy decoding replays each; returns ``out``.

    Raises:
        RuntimeError: it does not replay them after ``steps`` steps.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(base, out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = HERMES_TEMPLATE
    tok.save_pretrained(out)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    rows = [episode_ids(tok, *e, tools=tools) for e in episodes]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (row, mask) in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        labels[i, :len(row)] = torch.tensor([t if m else -100 for t, m in zip(row, mask)])
    attention = (labels != -100) | (ids != tok.pad_token_id)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 330k-parameter model: more threads only contend
    try:
        return _fit(model, opt, ids, attention, labels, out, steps, len(episodes))
    finally:
        torch.set_num_threads(threads)


def _fit(model, opt, ids, attention, labels, out: Path, steps: int, n: int) -> Path:
    """Train until greedy decoding replays every labelled token; save into ``out``."""
    for step in range(steps):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 19:
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=attention).logits
            hit = logits[:, :-1].argmax(-1) == ids[:, 1:]
            if bool(hit[labels[:, 1:] != -100].all()):
                model.save_pretrained(out)
                return out
    raise RuntimeError(f"the tiny model did not learn to replay {n} episodes in {steps} steps "
                       f"(loss {loss.item():.3f})")


def cached_hermes_policy(episodes: list[tuple], tools: list[dict] | None = None) -> Path:
    """:func:`hermes_policy` of the tiny model on ``episodes`` (and ``tools``), built once into the AstraFlow cache
    (keyed by this file, the episodes and the tools) and reused."""
    from weights.models import cache_dir, tiny_model_dir

    base = tiny_model_dir()
    key = hashlib.sha256((Path(__file__).read_text() + base.name + json.dumps(episodes)
                          + ("" if tools is None else json.dumps(tools))).encode()).hexdigest()[:12]
    target = cache_dir() / f"tiny-hermes-test-{key}"
    if not (target / "config.json").exists():
        tmp = cache_dir() / f"tiny-hermes-test-{key}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        hermes_policy(base, tmp, episodes, tools=tools)
        os.replace(tmp, target) if not target.exists() else shutil.rmtree(tmp)
    return target


def roll_out_one_group(config: Path, server) -> tuple[TrajectoryGroup, int, object]:
    """Acquire the run's prompts (``config`` holds one), roll them out with one RaaS worker until a group is on
    the trajectories topic (180 s at most), then stop the worker and kill ``server`` (a ``subprocess.Popen``).
    Returns the group, the calls made to the run's ``search`` tool (None when the run configures none) and the
    policy's tokenizer."""
    from astraflow.config import load_config
    from producers.acquisition import acquire_run
    from producers.raas import RaasWorker
    from topics.bus import connect, read_topic
    from topics.codec import decode
    from topics.layout import ensure_run_topics
    from topics.names import TopicNames

    cfg = load_config(config)
    names, bus = TopicNames(cfg.run), connect(cfg.bus, cfg.kafka)
    ensure_run_topics(bus.admin(), names, ["actor"], partitions=1)
    assert acquire_run(cfg.acquisition_section()) == 1
    worker = RaasWorker(cfg.raas_section(), 0, bus)
    topic = names.trajectories("actor")
    try:
        deadline = time.monotonic() + 180
        while sum(bus.admin().end_offsets(topic).values()) < 1:
            assert time.monotonic() < deadline, "the prompt was not rolled out"
            worker.step()
        calls = worker.tools["search"].calls if "search" in worker.tools else None
    finally:
        worker.close()
        server.kill()
        server.wait()
    [group] = [decode(r.value, TrajectoryGroup) for r in read_topic(bus, topic)]
    return group, calls, worker.engines["actor"].tokenizer
