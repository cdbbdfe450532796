"""Prompt sources: file formats, the dataset adapters, stable ids and profiling; a bad record costs one record."""
import gzip
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bad_prompts import BAD_LINES, GOOD_LINES, write_bad_prompt_file
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
    assert set(sizes) | {"arith", "search"} == set(SOURCES)  # search: tests/producers/test_search_data.py


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
        load_source(str(tmp_path / "bad.jsonl"))[1]  # the bad line costs its record only
    with pytest.raises(SourceError, match="unknown adapter"):
        load_source("math500", adapter="nope")


def test_lines_json_cannot_hold_in_python_cost_their_record_only(tmp_path):
    """Python's json refuses an integer of over 4,300 digits (a ValueError, not a JSONDecodeError) and nesting
    deeper than its stack (a RecursionError): each such line is one bad record, not the whole file's loss."""
    path = tmp_path / "deep.jsonl"
    path.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "x", "answer": ' + "9" * 5000 + "}\n"
                    + "[" * 100_000 + "\n" + '{"problem": "2+2?", "answer": "4"}\n')
    src = load_source(str(path))
    assert src[0].answer == "2" and src[3].answer == "4"
    with pytest.raises(SourceError, match=r"deep.jsonl:2: not readable JSON \(ValueError: Exceeds the limit \(4300 "):
        src[1]
    with pytest.raises(SourceError, match=r"deep.jsonl:3: not readable JSON \(RecursionError: maximum recursion"):
        src[2]


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


def test_each_bad_line_costs_its_record_only(tmp_path):
    path = write_bad_prompt_file(tmp_path / "p.jsonl")
    src = load_source(str(path), max_prompt_chars=32768)
    assert len(src) == 7 and src.name == "p"  # the blank line is no record
    good, bad = {}, {}
    for i in range(len(src)):
        try:
            good[src.line(i)] = src[i]
        except SourceError as e:
            bad[src.line(i)] = str(e)
    assert {line: p.answer for line, p in good.items()} == GOOD_LINES
    # records after a bad line keep their index, so their ids do not depend on whether it is fixed
    assert good[8].prompt_id == prompt_id("p", 6) and good[8].metadata["index"] == 6
    assert set(bad) == set(BAD_LINES)
    for line, reason in BAD_LINES.items():
        assert re.fullmatch(rf"{re.escape(str(path))}:{line}: {reason}.*", bad[line]), bad[line]
        assert "\n" not in bad[line]
    assert src.raw(3) == b'{"problem": "caf\xe9 au lait?", "answer": "1"}'  # the line as read
    assert json.loads(src.raw(4)) == {"problem": "What is the answer?"}
    assert load_source(str(path))[5].metadata["length"] == 1000071  # no limit by default


def test_a_utf8_bom_is_not_a_bad_record_and_an_all_bad_file_is_refused(tmp_path):
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"problem": "p", "answer": "1"}\n')
    assert load_source(str(tmp_path / "bom.jsonl"))[0].answer == "1"
    (tmp_path / "junk.jsonl").write_text("[1, 2]\nnope\n")
    with pytest.raises(SourceError, match=r"none of its 2 records is readable; the first, .*junk.jsonl:1: "
                                          r"expected a JSON object, got list"):
        load_source(str(tmp_path / "junk.jsonl"))


def test_field_errors_name_the_field_and_the_fields_the_record_has(tmp_path):
    rows = [{"question": "q0", "golds": ["7", "seven"]}, {"question": "q1", "golds": []},
            {"question": "q2", "golds": {"a": 1}}, {"question": ["not", "text"], "golds": "1"},
            {"question": "q4", "solution": "1"}]
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "lists.parquet")
    assert load_source(str(tmp_path / "lists.parquet"), answer_field="golds")[0].answer == "7"  # the first element
    path = tmp_path / "f.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = load_source(str(path), answer_field="golds")
    assert src[0].answer == "7"
    for i, message in [(1, "field 'golds' is an empty list"), (2, "field 'golds' holds dict"),
                       (3, "field 'question' holds list, not the question's text"),
                       (4, "no field 'golds' (fields: ['question', 'solution'])")]:
        with pytest.raises(SourceError, match=re.escape(f"{path}:{i + 1}: {message}")):
            src[i]
    with pytest.raises(SourceError, match=re.escape(f"{path}:1: no field 'answer' (fields: ['golds', 'question'])")):
        load_source(str(path))[0]
    math = tmp_path / "m.jsonl"
    math.write_text(json.dumps({"problem": "p", "answer": ["\\frac12", "0.5"]}) + "\n")
    assert load_source(str(math))[0].answer == "\\frac12"  # MATH-style records too
