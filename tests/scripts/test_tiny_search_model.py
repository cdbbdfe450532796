"""The tiny search model's build (scripts/make_tiny_search_model.py): its SFT episodes, the episode simulation it
calibrates with, and (slow) a build that lands in the accuracy band and loads as an HF model."""
import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("make_tiny_search_model",
                                                  ROOT / "scripts" / "make_tiny_search_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer(script):
    return script._tiny_module().build_tokenizer()


def test_sft_episodes_train_only_the_two_model_turns(script, tokenizer):
    kb = script.load_kb()
    assert len(kb) == 512 and kb["zovob"] == "the code of zovob is 846"
    ids, labels = script._batch(tokenizer, [("kavor", "the code of kavor is 381", "381")], random.Random(0), 2)
    assert ids.shape == labels.shape == (2, 85) and torch.equal(ids[0], ids[1])
    text = tokenizer.decode(ids[0].tolist())
    assert text == ("<bos>code of kavor?\n<search>kavor</search>\n<result>the code of kavor is 381</result>\n"
                    "381<eos>")
    trained = [t for t, lab in zip(ids[0].tolist(), labels[0].tolist()) if lab != -100]
    assert tokenizer.decode(trained) == "<search>kavor</search>381<eos>"
    assert labels[0][labels[0] != -100].tolist() == trained


def test_the_simulated_tool_and_the_cut_after_a_search_call(script, tokenizer):
    kb = script.load_kb()
    assert script.lookup(kb, " zovob ") == "the code of zovob is 846"
    assert script.lookup(kb, "kavor") == "no results"
    assert script.search_call("<search>zovob</search>846") == "zovob"
    assert script.search_call("<search>zovob</sea") is None and script.search_call("846") is None
    ids = tokenizer.encode("<search>zovob</search>846", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert tokenizer.decode(script._cut_after_call(tokenizer, ids)) == "<search>zovob</search>"
    assert script._cut_after_call(tokenizer, ids[-4:]) == ids[-4:]


@pytest.mark.slow
def test_a_build_lands_in_the_accuracy_band_and_loads_as_an_hf_model(script):
    """The build of this script (cached under the sha256 of the script and its inputs, as every run resolves
    ``tiny-search``: built here when no run built it yet, ~40 s on 2 idle cores, 90-240 s in a loaded CI run, and
    shared with the search example's runs): SFT until the temperature-1 accuracy of whole episodes is in
    [0.25, 0.5]."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from producers.sources import load_source
    from producers.workflows import prompt_ids

    from weights.models import BUILT_MODELS, tiny_search_model_dir

    torch.set_num_threads(2)
    out = tiny_search_model_dir()
    assert out.name.endswith(BUILT_MODELS["tiny-search"].digest())  # built by this script, from these inputs
    calibration = json.loads((out / "calibration.json").read_text())
    assert script.ACC_STOP <= calibration["sampled_accuracy"] <= script.ACC_RANGE[1]
    assert calibration["steps"] < 600 and calibration["searched_right"] > 0.5
    assert calibration["eval_questions"] == 256 and calibration["params"] == 341888
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    prompt = load_source("search")[0]
    assert prompt_ids(tok, prompt) == [tok.bos_token_id] + tok.encode("code of zovob?\n", add_special_tokens=False)
    # the other 256 questions, from the saved files: the accuracy is that of the calibration questions
    held = script.read_jsonl(script.QA_PATH)[256:]
    acc, hits = script.sampled_accuracy(model, tok, held, script.load_kb(), temperature=1.0, seed=1)
    assert 0.15 <= acc <= 0.55 and hits > 0.5
