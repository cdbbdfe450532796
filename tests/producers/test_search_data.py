"""The search demo's data: the synthetic knowledge base and its questions (scripts/make_search_kb.py), the
built-in ``search`` prompt source and the ``search`` reward."""
import importlib.util
import json
import re
from pathlib import Path

from producers.rewards import check_rewards, gold_completion, score_many, wrong_completion
from producers.sources import load_source, prompt_id
from topics.schemas import Prompt

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "producers" / "data"
NAME = re.compile(r"[bdfgklmnprstvz][aeiou][bdfgklmnprstvz][aeiou][bdfgklmnprstvz]")


def _kb_script():
    spec = importlib.util.spec_from_file_location("make_search_kb", ROOT / "scripts" / "make_search_kb.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_kb_and_its_questions_agree_and_each_answer_is_only_in_its_entitys_document():
    docs, qa = _jsonl(DATA / "search_kb.jsonl"), _jsonl(DATA / "search_qa.jsonl")
    assert len(docs) == len(qa) == 512
    names = [d["doc_id"] for d in docs]
    assert len(set(names)) == 512 and all(NAME.fullmatch(n) for n in names)
    assert not set(names) & _kb_script().ENGLISH_WORDS
    assert docs[0] == {"doc_id": "zovob", "text": "the code of zovob is 846"}
    for doc, q in zip(docs, qa):
        assert set(q) == {"question", "answer", "entity"} and q["entity"] == doc["doc_id"]
        assert q["question"] == f"code of {q['entity']}?\n"
        assert re.fullmatch(r"[1-9]\d\d", q["answer"])
        assert doc["text"] == f"the code of {q['entity']} is {q['answer']}"
    # the entity's name and its answer are each in exactly its own document; the question does not hold the answer
    for q in qa:
        assert [d["doc_id"] for d in docs if q["entity"] in d["text"].split()] == [q["entity"]]
        assert [d["doc_id"] for d in docs if q["answer"] in d["text"]] == [q["entity"]]
        assert q["answer"] not in q["question"]


def test_the_generator_rewrites_the_committed_files_byte_for_byte(tmp_path):
    module = _kb_script()
    docs, qa = module.make_kb()
    module.write_jsonl(tmp_path / "kb.jsonl", docs)
    module.write_jsonl(tmp_path / "qa.jsonl", qa)
    assert (tmp_path / "kb.jsonl").read_bytes() == (DATA / "search_kb.jsonl").read_bytes()
    assert (tmp_path / "qa.jsonl").read_bytes() == (DATA / "search_qa.jsonl").read_bytes()
    assert module.make_kb(seed=1)[0] != docs


def test_the_search_source_gives_search_prompts():
    src = load_source("search")
    assert len(src) == 512 and src.name == "search"
    p = src[0]
    assert p.task_type == "search" and p.source == "search" and p.prompt_id == prompt_id("search", 0)
    assert p.text == "code of zovob?\n" and p.answer == "846" and p.messages is None
    assert p.metadata == {"index": 0, "length": 15, "entity": "zovob"}
    assert {q.task_type for q in src} == {"search"}
    assert len({q.prompt_id for q in src}) == 512


def test_the_search_reward_is_an_exact_match_of_the_last_turn_up_to_eos():
    p = Prompt(prompt_id="s", source="search", task_type="search", text="code of kavor?\n", answer="381")
    completions = ["381", "381<eos>", " 381\n<search>x</search>", "3810", "38", "<search>kavor</search>",
                   "the code of kavor is 381", "", "382"]
    assert score_many(p, completions) == [1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert score_many(p.model_copy(update={"answer": None}), ["381"]) == [0]


def test_gold_and_wrong_completions_of_search_prompts_score_one_and_zero():
    prompts = [load_source("search")[i] for i in range(0, 512, 32)]
    assert gold_completion(prompts[0]) == "846" and wrong_completion(prompts[0]) == "847"
    result = check_rewards(prompts)
    assert (result.gold_accept, result.wrong_reject, result.n, result.disagreements) == (1.0, 1.0, 16, [])
