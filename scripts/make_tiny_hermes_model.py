#!/usr/bin/env python
"""Build the tiny search-agent model that calls its tool in the hermes format (no download).

The model of ``scripts/make_tiny_search_model.py`` (same architecture, same
knowledge base, same accuracy band), with a chat tokenizer: the episodes are
chat conversations rendered by a Jinja chat template in the hermes format of
Qwen2.5, and the search call is an OpenAI-style function call::

    <|im_start|>system\\n<tools>\\n{"name": "search", "parameters": ["query"]}\\n</tools><|im_end|>\\n
    <|im_start|>user\\ncode of kavor?<|im_end|>\\n
    <|im_start|>assistant\\n<tool_call>\\n{"name": "search", "arguments": {"query": "kavor"}}\\n</tool_call>
        <|im_end|>\\n                                  (the call's turn goes on: one line)
    <|im_start|>user\\n<tool_response>\\nthe code of kavor is 381\\n</tool_response><|im_end|>\\n
    <|im_start|>assistant\\n381<|im_end|>\\n

The tools block is a shortened form of Qwen2.5's (each tool's name and parameter names, no preamble); tool
results are ``tool`` messages rendered inside a user turn, consecutive ones in one turn; an assistant message's
``tool_calls`` (``{"type": "function", "function": {"name", "arguments"}}``, arguments a dict or a JSON string)
follow its content. The template is prefix-preserving (a conversation's rendering starts with the rendering
of each of its prefixes), which TRL's multi-turn tool loop needs, and renders every part of a tool-calling
turn (``trl.chat_template_utils.supports_tool_calling``).

Tokenizer: the character tokenizer of ``scripts/make_tiny_model.py`` plus :data:`CHAT_SPECIALS`
(``<|im_start|>``, ``<|im_end|>``: special) and :data:`FORMAT_TOKENS` (the format's tags and the fixed
pieces of its JSON call, and the role names, one token each, as a subword tokenizer would make them: an
episode is 113 tokens, not 190; its two assistant turns are 26, as the tag model's). ``<|im_end|>`` is the
end-of-sequence token: a turn ends there. The saved tokenizer
carries a ``response_template`` (:data:`RESPONSE_TEMPLATE`, transformers' response parsing), so
``tokenizer.parse_response`` turns a sampled turn into ``{"role", "content", "tool_calls"}``.

Pre-training is the tag model's (:func:`make_tiny_search_model.make_tiny_search_model`'s schedule: SFT on
whole episodes of knowledge-base entities, loss on the assistant turns only, ``<|im_end|>`` included; once
the training episodes' mean probability passes the gate, the learning rate drops and each chunk is followed
by :func:`sampled_accuracy` on :data:`EVAL_QUESTIONS` questions at temperature 1; training stops as soon as
it is within ``[ACC_STOP, ACC_RANGE[1]]``). A played episode (:func:`play_episodes`) does what TRL's tool
loop does: sample a turn up to ``<|im_end|>``, parse its tool calls, append the call's result (the exact
knowledge-base lookup, :func:`make_tiny_search_model.lookup`) as a ``tool`` message, and sample again.

Usage: ``scripts/make_tiny_hermes_model.py [--out DIR] [--steps N] [--seed S]``; without ``--out`` it builds
(once) into the shared cache (:func:`weights.models.built_model_dir` of ``tiny-search-hermes``) and prints
the directory. ``--temperature T`` prints the sampled accuracy at ``T`` over all 512 questions.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

CHAT_SPECIALS = ("<|im_start|>", "<|im_end|>")
#: Added (not special: they survive ``skip_special_tokens``) single tokens for the hermes format's fixed text.
FORMAT_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", "</tools>",
                 "system", "user", "assistant", '{"name": "', '", "arguments": ', '", "parameters": ', '{"query": "')
#: The search tool as an OpenAI function schema (what ``transformers.utils.get_json_schema`` makes of a typed
#: ``search(query: str) -> str`` with a docstring).
SEARCH_TOOL = {"type": "function", "function": {
    "name": "search", "description": "Search the knowledge base.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "what to look up"}},
                   "required": ["query"]}}}

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "<tools>"
    "{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}{{ '\\n' }}"
    '{"name": "{{ f.name }}", "parameters": {{ (f.parameters.properties if f.parameters is defined else {})'
    " | list | tojson }}{{ '}' }}"
    "{% endfor %}{{ '\\n' }}</tools><|im_end|>\n"
    "{% elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role in ('user', 'system') %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant"
    "{% if message.content %}{{ '\\n' }}{{ message.content }}{% endif %}"
    "{% for call in message.tool_calls or [] %}"
    "{% set f = call.function if call.function is defined else call %}{{ '\\n' }}"
    '<tool_call>\n{"name": "{{ f.name }}", "arguments": '
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}{{ '}' }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}{{ '\\n' }}"
    "<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}{{ raise_exception('unknown role ' ~ message.role) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The hermes chat template (Qwen2.5's turn layout with a shortened tools block)."""

#: transformers' response template of an assistant turn in this format (``tokenizer.parse_response``): text
#: up to the first ``<tool_call>`` is the content, each ``<tool_call>`` JSON object a function call.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                       "content": "json", "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
MAX_NEW_TOKENS = 24  # per assistant turn, as the tag model's: a call is 22 tokens, "<tool_call>" to "<|im_end|>"


def _search_module():
    """``scripts/make_tiny_search_model.py`` as a module (its knowledge base, schedule constants and sampler)."""
    name = "make_tiny_search_model"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def build_tokenizer():
    """The character tokenizer of the tiny model with the chat specials, the format tokens, :data:`CHAT_TEMPLATE`,
    :data:`RESPONSE_TEMPLATE`, ``<|im_end|>`` as its eos token and no ``<bos>`` added on encode."""
    from tokenizers import AddedToken, processors

    tok = _search_module()._tiny_module().build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(CHAT_SPECIALS)})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in FORMAT_TOKENS])
    tok.eos_token = "<|im_end|>"
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    tok.chat_template = CHAT_TEMPLATE
    tok.response_template = RESPONSE_TEMPLATE
    return tok


def question_text(question: str) -> str:
    """The user message of a knowledge-base question (``search_qa.jsonl``'s ``"code of kavor?\\n"``, stripped)."""
    return question.strip()


def episode_messages(name: str, document: str, code: str) -> list[dict[str, Any]]:
    """A complete episode as chat messages: the question, the search call, its result, the answer."""
    call = {"type": "function", "function": {"name": "search", "arguments": {"query": name}}}
    return [{"role": "user", "content": f"code of {name}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "search", "content": document},
            {"role": "assistant", "content": code}]


def render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered with the search tool listed (:data:`SEARCH_TOOL`)."""
    return tokenizer.apply_chat_template(messages, tools=[SEARCH_TOOL], tokenize=True, return_dict=False,
                                         add_generation_prompt=add_generation_prompt)


def episode_ids(tokenizer, name: str, document: str, code: str) -> tuple[list[int], list[int]]:
    """``(ids, labels)`` of a rendered episode: labels are the ids on the assistant turns' generated part (from
    after ``<|im_start|>assistant\\n`` through ``<|im_end|>``), -100 elsewhere."""
    messages = episode_messages(name, document, code)
    ids = render_ids(tokenizer, messages)
    labels = [-100] * len(ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(render_ids(tokenizer, messages[:k], add_generation_prompt=True))
        end = len(render_ids(tokenizer, messages[:k + 1]))
        assert ids[start:end] == render_ids(tokenizer, messages[:k + 1])[start:end]  # prefix-preserving
        stop = ids.index(tokenizer.eos_token_id, start) + 1  # the turn ends at <|im_end|>; its "\n" is context
        labels[start:stop] = ids[start:stop]
    return ids, labels


def tool_calls(text: str) -> list[dict[str, Any]]:
    """The function calls ``{"name", "arguments"}`` in a turn's text: each ``<tool_call>`` block whose body is a
    JSON object with a string ``name`` and an object ``arguments`` (others are skipped)."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict):
            calls.append({"name": call["name"], "arguments": call["arguments"]})
    return calls


def play_episodes(model, tokenizer, qa: list[dict[str, str]], kb: dict[str, str], temperature: float = 1.0,
                  seed: int = 0, max_turns: int = 2, max_new_tokens: int = MAX_NEW_TOKENS) -> list[dict[str, Any]]:
    """Play each question of ``qa`` once as a chat episode, as TRL's tool loop does.

    Each turn samples up to ``max_new_tokens`` tokens (to ``<|im_end|>``); a turn with a ``search`` call whose
    ``arguments.query`` is a string, before the last of ``max_turns``, gets the rendered ``tool`` message of
    the lookup appended (the tokens the template puts between the turn's ``<|im_end|>`` and the next
    assistant turn) and the episode takes another turn.

    Returns:
        Per question, ``{"question", "answer", "turns": [turn texts], "searches": [queries], "correct": bool}``;
        ``correct`` when the last turn's text before ``<|im_end|>``, stripped, is the answer.
    """
    search = _search_module()
    gen = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    contexts = [render_ids(tokenizer, [{"role": "user", "content": question_text(q["question"])}], True) for q in qa]
    episodes = [{"question": q["question"], "answer": q["answer"], "turns": [], "searches": []} for q in qa]
    active = list(range(len(qa)))
    for turn in range(1, max_turns + 1):
        if not active:
            break
        outs = search.sample(model, tokenizer, [contexts[i] for i in active], max_new_tokens, temperature, gen)
        still = []
        for i, ids in zip(active, outs):
            text = tokenizer.decode([t for t in ids if t != eos])
            episodes[i]["turns"].append(text)
            queries = [c["arguments"].get("query") for c in tool_calls(text) if c["name"] == "search"]
            if queries and isinstance(queries[0], str) and turn < max_turns and eos in ids:
                episodes[i]["searches"].append(queries[0])
                contexts[i] = contexts[i] + ids + tool_suffix_ids(tokenizer, search.lookup(kb, queries[0]))
                still.append(i)
        active = still
    for ep in episodes:
        ep["correct"] = ep["turns"][-1].strip() == ep["answer"]
    return episodes


def tool_suffix_ids(tokenizer, result: str) -> list[int]:
    """The tokens between an assistant turn's ``<|im_end|>`` and the next assistant turn's text, with a ``search``
    tool message ``result`` between them (TRL's ``_get_tool_suffix_ids``: the template's rendering of the
    conversation with and without it, the one with it ending in the generation prompt)."""
    messages = episode_messages("x", "", "")[:2]
    head = render_ids(tokenizer, messages)
    head = head[:len(head) - head[::-1].index(tokenizer.eos_token_id)]  # through the last <|im_end|>
    full = render_ids(tokenizer, messages + [{"role": "tool", "name": "search", "content": result}], True)
    return full[len(head):]


def sampled_accuracy(model, tokenizer, qa: list[dict[str, str]], kb: dict[str, str], temperature: float = 1.0,
                     seed: int = 0) -> tuple[float, float]:
    """``(accuracy, search_rate)`` of :func:`play_episodes` over ``qa``: the fraction answered correctly, and the
    fraction whose first search call names the question's entity exactly."""
    model.eval()
    episodes = play_episodes(model, tokenizer, qa, kb, temperature, seed)
    acc = sum(ep["correct"] for ep in episodes) / len(episodes)
    hits = sum(bool(ep["searches"]) and ep["searches"][0] == q["entity"] for ep, q in zip(episodes, qa))
    return acc, hits / len(episodes)


def make_tiny_hermes_model(out_dir: str | Path, steps: int = 800, seed: int = 0, batch_size: int = 64,
                           lr: float = 3e-3, verbose: bool = True) -> Path:
    """Build, pre-train and save the tiny hermes search model and its tokenizer to ``out_dir``.

    Args:
        out_dir: directory to write (``save_pretrained`` layout, float32 safetensors).
        steps: the most SFT steps of ``batch_size`` episodes; training stops earlier, at a multiple of
            ``EVAL_EVERY`` steps, once the sampled accuracy is within ``[ACC_STOP, ACC_RANGE[1]]`` (the constants
            of ``make_tiny_search_model.py``).
        seed: seed for initialisation, data and evaluation sampling.
        batch_size: episodes per step.
        lr: AdamW learning rate (the tag model's schedule: linear warm-up, betas (0.9, 0.95), weight decay 0.1,
            the late factor once the training episodes' probability passes the gate).
        verbose: print progress and the final sampled accuracy.

    Returns:
        ``out_dir`` as a Path; ``out_dir/calibration.json`` as the tag model's, with ``"format": "hermes"`` and
        ``episode_tokens`` (the tokens of one rendered episode).
    """
    search = _search_module()
    tiny = search._tiny_module()
    out = Path(out_dir)
    start = time.perf_counter()
    kb = search.load_kb()
    qa = search.read_jsonl(search.QA_PATH)[:search.EVAL_QUESTIONS]
    tokenizer = build_tokenizer()
    rendered = [episode_ids(tokenizer, name, text, text.rsplit(" ", 1)[1]) for name, text in kb.items()]
    model = tiny.build_model(len(tokenizer), seed, tokenizer.pad_token_id, tokenizer.bos_token_id,
                             tokenizer.eos_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = random.Random(seed)
    pad = tokenizer.pad_token_id
    model.set_attn_implementation("eager")
    acc, hits, estimate, done, late, measured = 0.0, 0.0, 0.0, 0, False, False
    while done < steps:
        model.train()
        probs = []
        for _ in range(min(search.EVAL_EVERY, steps - done)):
            rows = [rng.choice(rendered) for _ in range(batch_size)]
            width = max(len(r) for r, _ in rows)
            ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
            target = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])[:, 1:]
            logits = model(input_ids=ids).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100,
                                                    reduction="none")
            loss = nll.sum() / (target != -100).sum()
            probs.append(torch.exp(-nll.detach().sum(1)).mean().item())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, (done + 1) / search.WARMUP_STEPS) * (
                    search.LATE_LR_FACTOR if late else 1.0)
            opt.step()
            done += 1
        estimate = sum(probs) / len(probs)
        measured = estimate >= search.ESTIMATE_GATE
        if measured:
            acc, hits = sampled_accuracy(model, tokenizer, qa, kb, 1.0, seed)
            late = True
        if verbose and (measured or done % 25 == 0):
            shown = f"  searched right {hits:.3f}  sampled accuracy {acc:.3f}" if measured else ""
            print(f"step {done:4d}  loss {loss.item():.3f}  episode probability {estimate:.3f}{shown}  "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
        if measured and search.ACC_STOP <= acc <= search.ACC_RANGE[1]:
            break
    if not measured:
        acc, hits = sampled_accuracy(model, tokenizer, qa, kb, 1.0, seed)
    if verbose and not search.ACC_RANGE[0] <= acc <= search.ACC_RANGE[1]:
        print(f"warning: sampled accuracy {acc:.3f} is outside {search.ACC_RANGE} after {done} steps", flush=True)
    model.set_attn_implementation("sdpa")
    seconds = time.perf_counter() - start
    tiny.save_built(model, tokenizer, out, {
        "task": "search", "format": "hermes", "steps": done, "sampled_accuracy": acc, "searched_right": hits,
        "episode_probability": round(estimate, 4), "episode_tokens": len(rendered[0][0]),
        "eval_questions": len(qa), "temperature": 1.0, "seconds": round(seconds, 2), "seed": seed})
    if verbose:
        print(f"saved to {out} after {done} steps, {seconds:.1f} s; sampled accuracy {acc:.3f}")
    return out


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None,
                        help="output directory (default: the shared cache, weights.models.built_model_dir)")
    parser.add_argument("--steps", type=int, default=800, help="most SFT steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=None,
                        help="only measure the sampled accuracy of the built model at this temperature")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.out is None or args.temperature is not None:
        if args.out is None:
            sys.path.insert(0, str(ROOT))
            from weights.models import built_model_dir

            out = built_model_dir("tiny-search-hermes")
        else:
            out = Path(args.out)
            if not (out / "config.json").exists():
                make_tiny_hermes_model(out, steps=args.steps, seed=args.seed)
        if args.temperature is None:
            print(out)
            return
        from transformers import AutoModelForCausalLM, AutoTokenizer

        search = _search_module()
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(out)
        acc, hits = sampled_accuracy(model, tokenizer, search.read_jsonl(search.QA_PATH), search.load_kb(),
                                     args.temperature, args.seed)
        print(json.dumps({"model": str(out), "temperature": args.temperature, "questions": 512,
                          "sampled_accuracy": round(acc, 4), "searched_right": round(hits, 4)}))
    else:
        make_tiny_hermes_model(args.out, steps=args.steps, seed=args.seed)


if __name__ == "__main__":
    main()
