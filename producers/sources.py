"""Prompt sources: read a dataset and map each record to a :class:`topics.schemas.Prompt`.

A source is a list of raw records (dicts) plus an *adapter* that turns record
``i`` into a Prompt. Records come from

- a JSONL file, optionally gzipped (``.jsonl``, ``.jsonl.gz``, ``.json``);
- a parquet file (``.parquet``, read with pyarrow);
- a directory holding an HF dataset saved with ``save_to_disk`` (read with the
  optional ``datasets`` package);
- the synthetic ``arith`` task (``a+b=``), the CPU demo's task.

Built-in datasets ship in ``producers/data`` (see ``producers/data/SOURCES.md``
for provenance and licences) and are named in :data:`SOURCES`.

Profiling (DESIGN.md, step 1): every Prompt gets a stable ``prompt_id`` (a hash
of the source name and the record index), its ``source``, ``task_type`` and a
``metadata`` dict with ``index``, ``length`` (characters of the prompt text) and
``difficulty`` when the dataset has one.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from topics.schemas import Prompt

DATA_DIR = Path(__file__).resolve().parent / "data"

MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
CODE_INSTRUCTION = "Write a Python function that solves the task. Put the code in a ```python block."

#: An adapter maps (record, index, source name) to a Prompt.
Adapter = Callable[[dict[str, Any], int, str], Prompt]


class SourceError(ValueError):
    """A prompt source cannot be read, or one of its records lacks a needed field."""


def prompt_id(source: str, index: int) -> str:
    """The stable id of record ``index`` of ``source``: the first 16 hex digits of sha256("source:index")."""
    return hashlib.sha256(f"{source}:{index}".encode()).hexdigest()[:16]


def _field(record: dict[str, Any], name: str, source: str, index: int) -> Any:
    if name not in record:
        raise SourceError(f"{source} record {index} has no field {name!r} (fields: {sorted(record)})")
    if record[name] is None:
        raise SourceError(f"{source} record {index}: field {name!r} is null")
    return record[name]


def _metadata(index: int, text: str, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"index": index, "length": len(text)}
    meta.update({k: v for k, v in extra.items() if v is not None})
    return meta


def _math_prompt(source: str, index: int, problem: str, answer: str, **extra: Any) -> Prompt:
    content = f"{problem}\n\n{MATH_INSTRUCTION}"
    return Prompt(prompt_id=prompt_id(source, index), source=source, task_type="math",
                  messages=[{"role": "user", "content": content}], answer=str(answer).strip(),
                  metadata=_metadata(index, content, **extra))


def gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K solution: the text after ``####``, without thousands commas.

    Raises:
        ValueError: ``solution`` has no ``####`` marker.
    """
    head, sep, tail = solution.rpartition("####")
    if not sep:
        raise ValueError("GSM8K solution has no '####' answer marker")
    return tail.strip().replace(",", "")


def adapt_gsm8k(record: dict[str, Any], index: int, source: str) -> Prompt:
    """GSM8K: ``question``; the answer is what follows ``####`` in ``answer``."""
    question = _field(record, "question", source, index)
    try:
        answer = gsm8k_answer(_field(record, "answer", source, index))
    except ValueError as e:
        raise SourceError(f"{source} record {index}: {e}") from None
    return _math_prompt(source, index, question, answer)


def adapt_math(record: dict[str, Any], index: int, source: str) -> Prompt:
    """MATH-style records (MATH-500, DeepScaleR): ``problem`` and ``answer``; ``level``/``difficulty`` kept."""
    difficulty = record.get("level", record.get("difficulty"))
    return _math_prompt(source, index, _field(record, "problem", source, index),
                        _field(record, "answer", source, index), difficulty=difficulty,
                        subject=record.get("subject", record.get("type")))


def adapt_humaneval(record: dict[str, Any], index: int, source: str) -> Prompt:
    """HumanEval: a code-completion prompt; tests are ``test`` plus ``check(entry_point)``.

    ``metadata["code_prefix"]`` holds the prompt code (signature and docstring),
    which the code reward places before the completion, and
    ``metadata["solution"]`` the canonical solution body.
    """
    code = _field(record, "prompt", source, index)
    entry = _field(record, "entry_point", source, index)
    tests = f"{_field(record, 'test', source, index)}\n\ncheck({entry})\n"
    return Prompt(prompt_id=prompt_id(source, index), source=source, task_type="code", text=code,
                  tests=tests, entry_point=entry,
                  metadata=_metadata(index, code, task_id=record.get("task_id"), code_prefix=code,
                                     solution=record.get("canonical_solution")))


_CALL = re.compile(r"([A-Za-z_]\w*)\s*\(")
_DEF = re.compile(r"^def\s+([A-Za-z_]\w*)\s*\(", re.M)


def _mbpp_entry_point(test: str, solution: str | None) -> str | None:
    """The function a test calls: the first called name the solution defines, else the first call."""
    called = _CALL.findall(test)
    defined = set(_DEF.findall(solution or ""))
    return next((c for c in called if c in defined), called[0] if called else None)


def adapt_mbpp(record: dict[str, Any], index: int, source: str) -> Prompt:
    """MBPP (original ``text`` or sanitized ``prompt``): the task plus its first test as an example.

    The entry point is the function the first test calls (that the reference
    solution defines); the tests are
    ``test_imports``/``test_setup_code`` followed by every assert of ``test_list``.
    """
    task = record.get("prompt", record.get("text"))
    if task is None:
        raise SourceError(f"{source} record {index} has neither 'prompt' nor 'text'")
    test_list = list(_field(record, "test_list", source, index))
    if not test_list:
        raise SourceError(f"{source} record {index} has an empty test_list")
    entry = _mbpp_entry_point(test_list[0], record.get("code"))
    setup = "\n".join(list(record.get("test_imports") or []) + [record.get("test_setup_code") or ""])
    content = f"{task}\nYour code should pass this test:\n{test_list[0]}\n\n{CODE_INSTRUCTION}"
    return Prompt(prompt_id=prompt_id(source, index), source=source, task_type="code",
                  messages=[{"role": "user", "content": content}],
                  tests=setup.strip() + "\n" + "\n".join(test_list) + "\n", entry_point=entry,
                  metadata=_metadata(index, content, task_id=record.get("task_id"), solution=record.get("code")))


def adapt_arith(record: dict[str, Any], index: int, source: str) -> Prompt:
    """Synthetic addition: text ``"a+b="``, answer ``str(a+b)``."""
    a, b = int(_field(record, "a", source, index)), int(_field(record, "b", source, index))
    text = f"{a}+{b}="
    return Prompt(prompt_id=prompt_id(source, index), source=source, task_type="arith", text=text,
                  answer=str(a + b), metadata=_metadata(index, text))


def make_generic_adapter(text_field: str | None = None, answer_field: str | None = None,
                         task_type: str = "math") -> Adapter:
    """An adapter for any record with a question field and an answer field.

    Args:
        text_field: the question's field; by default the first of ``problem``,
            ``question``, ``prompt``, ``text`` that the record has.
        answer_field: the gold answer's field; by default ``answer``.
        task_type: the Prompt's task type (``math`` wraps the question with the boxed-answer instruction).
    """
    def adapt(record: dict[str, Any], index: int, source: str) -> Prompt:
        name = text_field or next((f for f in ("problem", "question", "prompt", "text") if f in record), None)
        if name is None:
            raise SourceError(f"{source} record {index}: no question field (tried problem, question, "
                              f"prompt, text; fields: {sorted(record)})")
        answer = str(_field(record, answer_field or "answer", source, index))
        if task_type == "math":
            return _math_prompt(source, index, record[name], answer, difficulty=record.get("difficulty"))
        text = str(record[name])
        return Prompt(prompt_id=prompt_id(source, index), source=source, task_type=task_type, text=text,
                      answer=answer, metadata=_metadata(index, text))
    return adapt


ADAPTERS: dict[str, Adapter] = {
    "gsm8k": adapt_gsm8k,
    "math": adapt_math,
    "humaneval": adapt_humaneval,
    "mbpp": adapt_mbpp,
    "arith": adapt_arith,
}


def guess_adapter(record: dict[str, Any]) -> Adapter:
    """Pick an adapter from a record's fields (HumanEval, MBPP, GSM8K, MATH-style, else generic)."""
    if "entry_point" in record and "test" in record:
        return adapt_humaneval
    if "test_list" in record:
        return adapt_mbpp
    if "question" in record and "####" in str(record.get("answer", "")):
        return adapt_gsm8k
    if "problem" in record and "answer" in record:
        return adapt_math
    return make_generic_adapter()


def read_records(path: str | Path, split: str | None = None) -> list[dict[str, Any]]:
    """Read every record of a JSONL(.gz), parquet or saved-HF-dataset path.

    Args:
        path: the file or dataset directory.
        split: for a saved ``DatasetDict``, the split to read (default: ``train``, or the only one).

    Raises:
        SourceError: the path is missing, its format is unknown, a line is not a
            JSON object, or a dataset directory needs ``datasets`` (``pip install datasets``).
    """
    path = Path(path)
    if not path.exists():
        raise SourceError(f"prompt source {str(path)!r} does not exist")
    if path.is_dir():
        return _read_hf_dataset(path, split)
    name = path.name.lower()
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
        opener = gzip.open if name.endswith(".gz") else open
        records = []
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SourceError(f"{path}:{lineno}: not JSON ({e})") from None
                if not isinstance(rec, dict):
                    raise SourceError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
                records.append(rec)
        return records
    raise SourceError(f"prompt source {str(path)!r}: unknown format (use .jsonl[.gz], .parquet "
                      "or a directory saved with datasets' save_to_disk)")


def _read_hf_dataset(path: Path, split: str | None) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise SourceError(f"{path} is a directory: reading a saved HF dataset needs the `datasets` "
                          "package (pip install datasets)") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds.keys())
        chosen = split or ("train" if "train" in ds else splits[0] if len(splits) == 1 else None)
        if chosen not in ds:
            raise SourceError(f"{path}: choose a split with split= (has {splits})")
        ds = ds[chosen]
    return [dict(row) for row in ds]


@dataclass
class PromptSource:
    """An indexed prompt source: ``len(src)`` records, ``src[i]`` is record i as a Prompt.

    Attributes:
        name: the source name stamped on prompts (part of every ``prompt_id``).
        records: the raw records.
        adapter: maps (record, index, name) to a Prompt.
    """

    name: str
    records: list[dict[str, Any]]
    adapter: Adapter

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Prompt:
        """Record ``index`` as a Prompt.

        Raises:
            IndexError: ``index`` is out of range.
            SourceError: the record lacks a field its adapter needs.
        """
        return self.adapter(self.records[index], index, self.name)

    def __iter__(self) -> Iterator[Prompt]:
        return (self[i] for i in range(len(self)))

    def get(self, index: int) -> Prompt | None:
        """Record ``index`` as a Prompt, or None when the record lacks a field its adapter needs
        (some datasets have a few, e.g. DeepScaleR-math has a null answer).

        Raises:
            IndexError: ``index`` is out of range.
        """
        try:
            return self[index]
        except SourceError:
            return None


def arith_records(n: int = 10000, seed: int = 0, max_operand: int = 19) -> list[dict[str, int]]:
    """``n`` seeded addition problems ``{"a", "b"}`` with 0 <= a, b <= ``max_operand``."""
    rng = random.Random(seed)
    return [{"a": rng.randint(0, max_operand), "b": rng.randint(0, max_operand)} for _ in range(n)]


@dataclass(frozen=True)
class SourceSpec:
    """A built-in source: a file in ``producers/data`` (or None for a synthetic one) and its adapter."""

    file: str | None
    adapter: str


SOURCES: dict[str, SourceSpec] = {
    "gsm8k": SourceSpec("gsm8k_test.jsonl", "gsm8k"),
    "gsm8k_train": SourceSpec("gsm8k_train.jsonl", "gsm8k"),
    "math500": SourceSpec("math500_test.jsonl", "math"),
    "deepscaler": SourceSpec("deepscaler_train_math.jsonl", "math"),
    "humaneval": SourceSpec("HumanEval.jsonl.gz", "humaneval"),
    "mbpp": SourceSpec("mbpp_sanitized.jsonl", "mbpp"),
    "arith": SourceSpec(None, "arith"),
}
"""Built-in sources by name. ``gsm8k`` is the 1319-problem test split."""


def load_source(name_or_path: str | Path, *, adapter: str | Adapter | None = None,
                answer_field: str | None = None, split: str | None = None, n: int = 10000,
                seed: int = 0, max_operand: int = 19) -> PromptSource:
    """Open a built-in source by name (see :data:`SOURCES`) or a dataset file/directory.

    Args:
        name_or_path: a key of :data:`SOURCES`, or a path (the source name is then the file's stem).
        adapter: an adapter name from :data:`ADAPTERS` or a callable; by default
            the built-in's, or guessed from the first record's fields.
        answer_field: read the gold answer from this field (generic math adapter).
        split: split of a saved ``DatasetDict``.
        n, seed, max_operand: size, RNG seed and largest operand of the synthetic ``arith`` source.

    Raises:
        SourceError: unknown name, unreadable path, unknown adapter or empty source.
    """
    key = str(name_or_path)
    if key in SOURCES:
        spec = SOURCES[key]
        records = (arith_records(n, seed, max_operand) if spec.file is None
                   else read_records(DATA_DIR / spec.file))
        name, default_adapter = key, spec.adapter
    else:
        path = Path(key)
        if not path.exists():
            raise SourceError(f"unknown prompt source {key!r}: neither a built-in "
                              f"({', '.join(SOURCES)}) nor an existing path")
        records = read_records(path, split)
        name = path.name.split(".")[0]
        default_adapter = None
    if not records:
        raise SourceError(f"prompt source {key!r} has no records")
    if answer_field is not None and adapter is None:
        adapter = make_generic_adapter(answer_field=answer_field)
    chosen = adapter if adapter is not None else default_adapter
    if isinstance(chosen, str):
        if chosen not in ADAPTERS:
            raise SourceError(f"unknown adapter {chosen!r} (known: {', '.join(ADAPTERS)})")
        chosen = ADAPTERS[chosen]
    return PromptSource(name=name, records=records, adapter=chosen or guess_adapter(records[0]))
