"""The tiny hermes search model's build (scripts/make_tiny_hermes_model.py): its chat template renders a
tool-calling conversation in the hermes format that parses back and that TRL's template checks accept, its SFT
episodes train the assistant turns only, and (slow) a build lands in the accuracy band."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("make_tiny_hermes_model",
                                                  ROOT / "scripts" / "make_tiny_hermes_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer(script, tmp_path_factory):
    """The tokenizer as a built model's directory holds it: saved and loaded back through AutoTokenizer."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("hermes-tokenizer")
    script.build_tokenizer().save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


EPISODE = ('<|im_start|>system\n<tools>\n{"name": "search", "parameters": ["query"]}\n</tools><|im_end|>\n'
           "<|im_start|>user\ncode of kavor?<|im_end|>\n"
           '<|im_start|>assistant\n<tool_call>\n{"name": "search", "arguments": {"query": "kavor"}}\n'
           "</tool_call><|im_end|>\n"
           "<|im_start|>user\n<tool_response>\nthe code of kavor is 381\n</tool_response><|im_end|>\n"
           "<|im_start|>assistant\n381<|im_end|>\n")


def test_a_tool_calling_episode_renders_in_the_hermes_format_and_parses_back(script, tokenizer):
    messages = script.episode_messages("kavor", "the code of kavor is 381", "381")
    text = tokenizer.apply_chat_template(messages, tools=[script.SEARCH_TOOL], tokenize=False)
    assert text == EPISODE
    ids = script.render_ids(tokenizer, messages)
    assert tokenizer.decode(ids) == EPISODE and len(ids) == 113
    assert [tokenizer.decode(i) for i in ids[:3]] == ["<|im_start|>", "system", "\n"]  # one token each, no <bos>
    # the assistant's first turn, as sampled after the generation prompt, parses back to the call it renders
    prompt = script.render_ids(tokenizer, messages[:1], add_generation_prompt=True)
    assert tokenizer.decode(prompt).endswith("<|im_start|>user\ncode of kavor?<|im_end|>\n<|im_start|>assistant\n")
    turn = ids[len(prompt):ids.index(tokenizer.eos_token_id, len(prompt)) + 1]
    assert tokenizer.decode(turn) == ('<tool_call>\n{"name": "search", "arguments": {"query": "kavor"}}\n'
                                      "</tool_call><|im_end|>")
    parsed = tokenizer.parse_response(turn, prefix=prompt)
    assert parsed["tool_calls"] == messages[1]["tool_calls"] and not parsed.get("content")
    assert script.tool_calls(tokenizer.decode(turn)) == [{"name": "search", "arguments": {"query": "kavor"}}]
    answer = tokenizer.encode("381<|im_end|>")
    assert tokenizer.parse_response(answer, prefix=ids[:len(ids) - 5]) == {"role": "assistant", "content": "381"}
    # between the call's <|im_end|> and the answer: the tool turn and the generation prompt, as TRL appends them
    assert tokenizer.decode(script.tool_suffix_ids(tokenizer, "the code of kavor is 381")) == (
        "\n<|im_start|>user\n<tool_response>\nthe code of kavor is 381\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    # consecutive tool results share one user turn; arguments given as a JSON string render as they are
    two = [{"role": "user", "content": "q"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"type": "function", "function": {"name": "search", "arguments": '{"query": "a"}'}}]},
           {"role": "tool", "content": "A"}, {"role": "tool", "content": "B"}]
    assert tokenizer.apply_chat_template(two, tokenize=False) == (
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name": "search", "arguments": {"query": "a"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nA\n</tool_response>\n<tool_response>\nB\n</tool_response><|im_end|>\n")


def test_trl_accepts_the_template_for_its_tool_loop(tokenizer):
    chat_template_utils = pytest.importorskip("trl.chat_template_utils", reason="trl is only in the bench profile")
    assert chat_template_utils.supports_tool_calling(tokenizer)
    assert chat_template_utils.is_chat_template_prefix_preserving(tokenizer)


def test_sft_episodes_train_only_the_assistant_turns(script, tokenizer):
    ids, labels = script.episode_ids(tokenizer, "kavor", "the code of kavor is 381", "381")
    assert tokenizer.decode(ids) == EPISODE and len(labels) == len(ids)
    trained = [t for t, lab in zip(ids, labels) if lab != -100]
    assert tokenizer.decode(trained) == ('<tool_call>\n{"name": "search", "arguments": {"query": "kavor"}}\n'
                                         "</tool_call><|im_end|>381<|im_end|>")
    assert [lab for lab in labels if lab != -100] == trained


def test_calls_are_read_from_well_formed_blocks_only(script):
    assert script.tool_calls('<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'
                             '<tool_call>{"name": "search"}</tool_call><tool_call>{bad</tool_call>') == [
        {"name": "search", "arguments": {"query": "x"}}]
    assert script.tool_calls("381") == []


@pytest.mark.slow
def test_a_build_lands_in_the_accuracy_band(script):
    """The cached build (as every run resolves ``tiny-search-hermes``: built once per version of its script and
    inputs): SFT until the temperature-1 accuracy of whole chat episodes is in [0.25, 0.5]; the other 256
    questions give about the same accuracy."""
    pytest.importorskip("trl", reason="tiny-search-hermes serves the TRL arm of scripts/bench_agentic.py, in the "
                                      "bench install (scripts/install.sh bench), which builds it")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from weights.models import BUILT_MODELS, built_model_dir

    torch.set_num_threads(2)
    out = built_model_dir("tiny-search-hermes")
    assert out.name.endswith(BUILT_MODELS["tiny-search-hermes"].digest())
    search = script._search_module()
    calibration = json.loads((out / "calibration.json").read_text())
    assert search.ACC_STOP <= calibration["sampled_accuracy"] <= search.ACC_RANGE[1]
    assert calibration["format"] == "hermes" and calibration["searched_right"] > 0.5
    assert calibration["episode_tokens"] == 113
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    held = search.read_jsonl(search.QA_PATH)[256:]
    acc, hits = script.sampled_accuracy(model, tok, held, search.load_kb(), temperature=1.0, seed=1)
    assert 0.15 <= acc <= 0.55 and hits > 0.5
