"""Prompt sources: file formats, the dataset adapters, stable ids and profiling."""
import gzip
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from producers.sources import (SOURCES, SourceError, gsm8k_answer, load_source, prompt_id, read_records)


def test_builtin_sources_have_their_documented_sizes_and_task_types():
    sizes = {"gsm8k": 1319, "gsm8k_train": 7473, "math500": 500, "deepscaler": 7474, "humaneval": 164, "mbpp": 427}
    for name, size in sizes.items():
        src = load_source(name)
        assert len(src) == size and src.name == name
        p = src[0]
        assert p.task_type == ("code" if name in ("humaneval", "mbpp") else "math")
        assert p.source == name and p.prompt_id == prompt_id(name, 0)
        assert p.metadata["index"] == 0 and p.metadata["length"] == len(p.text or p.messages[0]["content"])
    assert set(sizes) | {"arith"} == set(SOURCES)


def test_gsm8k_answer_is_the_number_after_the_marker():
    src = load_source("gsm8k")
    assert [src[i].answer for i in range(3)] == ["18", "3", "70000"]  # "70,000" loses its comma
    assert "\\boxed{}" in src[0].messages[0]["content"]
    with pytest.raises(ValueError, match="####"):
        gsm8k_answer("no marker")


def test_math_sources_keep_difficulty_and_subject():
    p = load_source("math500")[0]
    assert p.answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert p.metadata["difficulty"] == 2 and p.metadata["subject"] == "Precalculus"
    d = load_source("deepscaler")[0]
    assert d.answer == "0" and d.metadata["difficulty"] == 5.0


def test_a_record_with_a_null_answer_is_rejected_clearly():
    src = load_source("deepscaler")
    bad = [i for i in range(len(src)) if src.get(i) is None]
    assert bad == [886, 1009]
    with pytest.raises(SourceError, match="'answer' is null"):
        src[886]


def test_code_sources_carry_tests_and_an_entry_point_the_solution_defines():
    he = load_source("humaneval")
    for p in he:
        assert p.tests.rstrip().endswith(f"check({p.entry_point})")
        assert p.text == p.metadata["code_prefix"] and p.metadata["solution"]
    for p in load_source("mbpp"):
        assert p.entry_point and re.search(rf"def\s+{p.entry_point}\s*\(", p.metadata["solution"])
        assert "assert" in p.tests


def test_arith_is_seeded_and_small():
    a, b = load_source("arith", n=200, seed=3), load_source("arith", n=200, seed=3)
    assert [p.text for p in a] == [p.text for p in b]
    assert [p.text for p in a] != [p.text for p in load_source("arith", n=200, seed=4)]
    for p in a:
        x, y = map(int, p.text[:-1].split("+"))
        assert p.text.endswith("=") and 0 <= x <= 19 and 0 <= y <= 19 and p.answer == str(x + y)
        assert p.task_type == "arith"


def test_prompt_ids_are_stable_and_distinct():
    src = load_source("math500")
    ids = [p.prompt_id for p in src]
    assert len(set(ids)) == len(ids)
    assert ids == [p.prompt_id for p in load_source("math500")]
    assert prompt_id("math500", 0) != prompt_id("gsm8k", 0)


def test_jsonl_gz_and_parquet_files_with_guessed_adapters(tmp_path):
    rows = [{"question": "1+1?", "answer": "so\n#### 2"}, {"question": "2+2?", "answer": "#### 4"}]
    gz = tmp_path / "mine.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n\n")
    src = load_source(str(gz))
    assert src.name == "mine" and [p.answer for p in src] == ["2", "4"]

    pq.write_table(pa.Table.from_pylist([{"problem": "x?", "answer": "\\frac12", "difficulty": 3}]),
                   tmp_path / "m.parquet")
    p = load_source(str(tmp_path / "m.parquet"))[0]
    assert p.task_type == "math" and p.answer == "\\frac12" and p.metadata["difficulty"] == 3


def test_answer_field_picks_the_gold_answer(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"prompt": "What is 6*7?", "gold": 42}) + "\n")
    p = load_source(str(path), answer_field="gold")[0]
    assert p.answer == "42" and "6*7" in p.messages[0]["content"]
    with pytest.raises(SourceError, match="no field 'answer'"):
        load_source(str(path))[0]


def test_bad_inputs_give_clear_errors(tmp_path):
    with pytest.raises(SourceError, match="unknown prompt source"):
        load_source("no_such_dataset")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match="unknown format"):
        read_records(tmp_path / "x.csv")
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\nnot json\n')
    with pytest.raises(SourceError, match="bad.jsonl:2: not JSON"):
        read_records(tmp_path / "bad.jsonl")
    with pytest.raises(SourceError, match="unknown adapter"):
        load_source("math500", adapter="nope")


def test_a_saved_hf_dataset_directory(tmp_path):
    try:
        import datasets
    except ImportError:
        (tmp_path / "ds").mkdir()
        with pytest.raises(SourceError, match="pip install datasets"):
            read_records(tmp_path / "ds")
        return
    datasets.Dataset.from_list([{"problem": "p", "answer": "1"}]).save_to_disk(str(tmp_path / "ds"))
    assert load_source(str(tmp_path / "ds"))[0].answer == "1"
