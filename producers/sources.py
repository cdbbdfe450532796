"""Prompt sources: read a dataset and map each record to a :class:`topics.schemas.Prompt`.

A source is a list of raw records (dicts) plus an *adapter* that turns record
``i`` into a Prompt. Records come from

- a JSONL file, optionally gzipped (``.jsonl``, ``.jsonl.gz``, ``.json``);
- a parquet file (``.parquet``, read with pyarrow);
- a directory holding an HF dataset saved with ``save_to_disk`` (read with the
  optional ``datasets`` package);
- the synthetic ``arith`` task (``a+b=``), the CPU demo's task.

The ``search`` source is the search-agent demo's questions (``code of <name>?``), whose answers are
only in the search tool's corpus (``producers/data/search_kb.jsonl``).

Built-in datasets ship in ``producers/data`` (see ``producers/data/SOURCES.md``
for provenance and licences) and are named in :data:`SOURCES`.

Profiling (DESIGN.md, step 1): every Prompt gets a stable ``prompt_id`` (a hash
of the source name and the record index), its ``source``, ``task_type`` and a
``metadata`` dict with ``index``, ``length`` (characters of the prompt text) and
``difficulty`` when the dataset has one.

Bad records cost one record each. A JSONL line that is not UTF-8, not JSON or
not a JSON object is kept as an :class:`Unreadable` placeholder (so the records
after it keep their index and ``prompt_id``); ``source[i]`` raises
:class:`SourceError` for it, and for a record that lacks a field its adapter
needs or whose prompt is longer than ``max_prompt_chars``, with a message that
starts with where the record is (``path:line``, see :meth:`PromptSource.where`)
and says why. :mod:`producers.acquisition` dead-letters such records and goes on.
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

from pydantic import ValidationError

from topics.schemas import Prompt

DATA_DIR = Path(__file__).resolve().parent / "data"

MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
CODE_INSTRUCTION = "Write a Python function that solves the task. Put the code in a ```python block."

#: An adapter maps (record, index, source name) to a Prompt. It raises :class:`SourceError` with the reason
#: for a record it cannot use; :class:`PromptSource` prefixes where the record is.
Adapter = Callable[[dict[str, Any], int, str], Prompt]


class SourceError(ValueError):
    """A prompt source cannot be read, or one of its records cannot be made a Prompt."""


@dataclass(frozen=True)
class Unreadable:
    """Stands in for a line of a JSONL file that could not be parsed, so that later records keep their index.

    Attributes:
        raw: the line's bytes, without its line break.
        reason: why, e.g. ``not JSON (Expecting value: line 1 column 1 (char 0))``.
    """

    raw: bytes
    reason: str


#: A raw record: a dict, or an :class:`Unreadable` placeholder.
RawRecord = dict[str, Any] | Unreadable


def prompt_id(source: str, index: int) -> str:
    """The stable id of record ``index`` of ``source``: the first 16 hex digits of sha256("source:index")."""
    return hashlib.sha256(f"{source}:{index}".encode()).hexdigest()[:16]


def _field(record: dict[str, Any], name: str) -> Any:
    """``record[name]``; a SourceError naming the field (and the fields the record has) when missing or null."""
    if name not in record:
        raise SourceError(f"no field {name!r} (fields: {sorted(record)})")
    if record[name] is None:
        raise SourceError(f"field {name!r} is null")
    return record[name]


def _answer(record: dict[str, Any], name: str) -> str:
    """The gold answer in field ``name`` as text. A list gives its first element: a Prompt holds one gold
    answer, and the rewards (:mod:`producers.rewards`) compare a completion with that one.

    Raises:
        SourceError: the field is missing, null or an empty list, or holds a mapping or nested list.
    """
    value = _field(record, name)
    if isinstance(value, (list, tuple)):
        if not value:
            raise SourceError(f"field {name!r} is an empty list")
        value = value[0]
    if isinstance(value, (dict, list, tuple)) or value is None:
        raise SourceError(f"field {name!r} holds {type(value).__name__} {str(value)[:60]!r}, not an answer")
    return str(value).strip()


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
    question = _field(record, "question")
    try:
        answer = gsm8k_answer(_field(record, "answer"))
    except ValueError as e:
        raise SourceError(str(e)) from None
    return _math_prompt(source, index, question, answer)


def adapt_math(record: dict[str, Any], index: int, source: str) -> Prompt:
    """MATH-style records (MATH-500, DeepScaleR): ``problem`` and ``answer`` (a list: its first element);
    ``level``/``difficulty`` kept."""
    difficulty = record.get("level", record.get("difficulty"))
    return _math_prompt(source, index, _field(record, "problem"), _answer(record, "answer"), difficulty=difficulty,
                        subject=record.get("subject", record.get("type")))


def adapt_humaneval(record: dict[str, Any], index: int, source: str) -> Prompt:
    """HumanEval: a code-completion prompt; tests are ``test`` plus ``check(entry_point)``.

    ``metadata["code_prefix"]`` holds the prompt code (signature and docstring),
    which the code reward places before the completion, and
    ``metadata["solution"]`` the canonical solution body.
    """
    code = _field(record, "prompt")
    entry = _field(record, "entry_point")
    tests = f"{_field(record, 'test')}\n\ncheck({entry})\n"
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
        raise SourceError(f"neither field 'prompt' nor 'text' (fields: {sorted(record)})")
    test_list = list(_field(record, "test_list"))
    if not test_list:
        raise SourceError("field 'test_list' is empty")
    entry = _mbpp_entry_point(test_list[0], record.get("code"))
    setup = "\n".join(list(record.get("test_imports") or []) + [record.get("test_setup_code") or ""])
    content = f"{task}\nYour code should pass this test:\n{test_list[0]}\n\n{CODE_INSTRUCTION}"
    return Prompt(prompt_id=prompt_id(source, index), source=source, task_type="code",
                  messages=[{"role": "user", "content": content}],
                  tests=setup.strip() + "\n" + "\n".join(test_list) + "\n", entry_point=entry,
                  metadata=_metadata(index, content, task_id=record.get("task_id"), solution=record.get("code")))


def adapt_arith(record: dict[str, Any], index: int, source: str) -> Prompt:
    """Synthetic addition: text ``"a+b="``, answer ``str(a+b)``."""
    a, b = int(_field(record, "a")), int(_field(record, "b"))
    text = f"{a}+{b}="
    return Prompt(prompt_id=prompt_id(source, index), source=source, task_type="arith", text=text,
                  answer=str(a + b), metadata=_metadata(index, text))


def adapt_search(record: dict[str, Any], index: int, source: str) -> Prompt:
    """Search-agent questions (``search_qa.jsonl``): text ``question`` (e.g. ``"code of kavor?\\n"``), answer
    ``answer`` (the entity's code, found only in the search tool's corpus); ``entity`` is kept in the metadata."""
    question = _field(record, "question")
    if not isinstance(question, str):
        raise SourceError(f"field 'question' holds {type(question).__name__}, not the question's text")
    return Prompt(prompt_id=prompt_id(source, index), source=source, task_type="search", text=question,
                  answer=_answer(record, "answer"), metadata=_metadata(index, question, entity=record.get("entity")))


def make_generic_adapter(text_field: str | None = None, answer_field: str | None = None,
                         task_type: str = "math") -> Adapter:
    """An adapter for any record with a question field and an answer field.

    Args:
        text_field: the question's field; by default the first of ``problem``,
            ``question``, ``prompt``, ``text`` that the record has. It must hold text.
        answer_field: the gold answer's field; by default ``answer``. A list-valued answer gives its
            first element (a Prompt holds one gold answer; the rewards compare a completion with that one).
        task_type: the Prompt's task type (``math`` wraps the question with the boxed-answer instruction).

    The adapter raises :class:`SourceError` naming the missing field (and the fields the record has),
    a question that is not text, or an answer that is null, an empty list or a mapping.
    """
    def adapt(record: dict[str, Any], index: int, source: str) -> Prompt:
        name = text_field or next((f for f in ("problem", "question", "prompt", "text") if f in record), None)
        if name is None:
            raise SourceError(f"no question field (tried problem, question, prompt, text; fields: {sorted(record)})")
        question = _field(record, name)
        if not isinstance(question, str):
            raise SourceError(f"field {name!r} holds {type(question).__name__}, not the question's text")
        answer = _answer(record, answer_field or "answer")
        if task_type == "math":
            return _math_prompt(source, index, question, answer, difficulty=record.get("difficulty"))
        return Prompt(prompt_id=prompt_id(source, index), source=source, task_type=task_type, text=question,
                      answer=answer, metadata=_metadata(index, question))
    return adapt


ADAPTERS: dict[str, Adapter] = {
    "gsm8k": adapt_gsm8k,
    "math": adapt_math,
    "humaneval": adapt_humaneval,
    "mbpp": adapt_mbpp,
    "arith": adapt_arith,
    "search": adapt_search,
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


def read_records(path: str | Path, split: str | None = None) -> tuple[list[RawRecord], list[int]]:
    """Read every record of a JSONL(.gz), parquet or saved-HF-dataset path.

    Args:
        path: the file or dataset directory.
        split: for a saved ``DatasetDict``, the split to read (default: ``train``, or the only one).

    Returns:
        ``(records, lines)``: the records in file order, and each one's 1-based line (JSONL; blank
        lines are skipped) or row (parquet, saved dataset). A JSONL line that is not UTF-8, not JSON
        or not a JSON object is an :class:`Unreadable` record.

    Raises:
        SourceError: the path is missing, its format is unknown, the file itself cannot be read
            (a corrupt gzip or parquet file), or a dataset directory needs ``datasets``
            (``pip install datasets``).
    """
    path = Path(path)
    if not path.exists():
        raise SourceError(f"prompt source {str(path)!r} does not exist")
    if path.is_dir():
        records: list[RawRecord] = _read_hf_dataset(path, split)
        return records, list(range(1, len(records) + 1))
    name = path.name.lower()
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            records = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise SourceError(f"{path}: not a readable parquet file ({e})") from None
        return records, list(range(1, len(records) + 1))
    if name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
        return _read_jsonl(path)
    raise SourceError(f"prompt source {str(path)!r}: unknown format (use .jsonl[.gz], .parquet "
                      "or a directory saved with datasets' save_to_disk)")


def _read_jsonl(path: Path) -> tuple[list[RawRecord], list[int]]:
    """The records and line numbers of a JSONL(.gz) file (see :func:`read_records`)."""
    records: list[RawRecord] = []
    lines: list[int] = []
    lineno = 0
    try:
        with (gzip.open if path.name.lower().endswith(".gz") else open)(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                raw = raw.rstrip(b"\r\n")
                if raw.strip():
                    records.append(_parse_line(raw, first=lineno == 1))
                    lines.append(lineno)
    except (OSError, EOFError) as e:  # a corrupt or truncated gzip stream
        raise SourceError(f"{path}: unreadable after line {lineno} ({e})") from None
    return records, lines


def _parse_line(raw: bytes, first: bool) -> RawRecord:
    """One JSONL line as a dict, or :class:`Unreadable` with the reason. The first line may start with a UTF-8 BOM."""
    try:
        text = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        return Unreadable(raw, f"not UTF-8 ({e.reason} in {raw[e.start:e.start + 4]!r} at byte {e.start} "
                               "of the line)")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return Unreadable(raw, f"not JSON ({e})")
    except (ValueError, RecursionError) as e:  # an integer past Python's 4,300-digit limit; nesting past the stack
        return Unreadable(raw, f"not readable JSON ({type(e).__name__}: {e})")
    if not isinstance(record, dict):
        return Unreadable(raw, f"expected a JSON object, got {type(record).__name__}")
    return record


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


def prompt_chars(prompt: Prompt) -> int:
    """The length of a prompt's content in characters: its ``text``, or its turns' contents together."""
    if prompt.text is not None:
        return len(prompt.text)
    return sum(len(turn["content"]) for turn in prompt.messages or [])


def _one_line(e: Exception) -> str:
    """An adapter's error as one line: a SourceError's message, a pydantic error's fields and messages,
    else the exception's type and message."""
    if isinstance(e, SourceError):
        return str(e)
    if isinstance(e, ValidationError):
        return "not a valid Prompt: " + "; ".join(f"{'.'.join(map(str, err['loc'])) or 'prompt'}: {err['msg']}"
                                                  for err in e.errors())
    return " ".join(f"{type(e).__name__}: {e}".split())


@dataclass
class PromptSource:
    """An indexed prompt source: ``len(src)`` records, ``src[i]`` is record i as a Prompt.

    Attributes:
        name: the source name stamped on prompts (part of every ``prompt_id``).
        records: the raw records (:class:`Unreadable` for a line that could not be parsed).
        adapter: maps (record, index, name) to a Prompt.
        path: the file or directory the records came from; None for a synthetic source.
        lines: each record's 1-based line or row in ``path`` (see :func:`read_records`); None: ``index + 1``.
        max_prompt_chars: the longest prompt accepted, in characters (:func:`prompt_chars`); None: no limit.
    """

    name: str
    records: list[RawRecord]
    adapter: Adapter
    path: str | None = None
    lines: list[int] | None = None
    max_prompt_chars: int | None = None

    def __len__(self) -> int:
        return len(self.records)

    def line(self, index: int) -> int:
        """The 1-based line (JSONL) or row (parquet, saved dataset) of record ``index``; ``index + 1`` if synthetic."""
        return self.lines[index] if self.lines is not None else index + 1

    def where(self, index: int) -> str:
        """Where record ``index`` is, for messages: ``path:line`` (``name:index+1`` for a synthetic source)."""
        return f"{self.path or self.name}:{self.line(index)}"

    def raw(self, index: int) -> bytes:
        """Record ``index`` as bytes, for a dead letter: the line as read when unreadable, else the record as JSON."""
        record = self.records[index]
        if isinstance(record, Unreadable):
            return record.raw
        return json.dumps(record, ensure_ascii=False, default=str).encode()

    def __getitem__(self, index: int) -> Prompt:
        """Record ``index`` as a Prompt.

        Raises:
            IndexError: ``index`` is out of range.
            SourceError: ``"<where>: <reason>"`` (:meth:`where`): the record is :class:`Unreadable`, its
                adapter cannot use it (a missing or null field, a value of the wrong type, an invalid
                Prompt), or its prompt is longer than ``max_prompt_chars``.
        """
        record = self.records[index]
        if isinstance(record, Unreadable):
            raise SourceError(f"{self.where(index)}: {record.reason}")
        try:
            prompt = self.adapter(record, index, self.name)
        except (ValueError, TypeError, KeyError) as e:  # SourceError and pydantic's ValidationError are ValueErrors
            raise SourceError(f"{self.where(index)}: {_one_line(e)}") from None
        if self.max_prompt_chars is not None and prompt_chars(prompt) > self.max_prompt_chars:
            raise SourceError(f"{self.where(index)}: prompt is {prompt_chars(prompt)} characters long, over the "
                              f"limit of {self.max_prompt_chars} (data.max_prompt_chars, counted in characters)")
        return prompt

    def __iter__(self) -> Iterator[Prompt]:
        return (self[i] for i in range(len(self)))

    def head(self, limit: int = 0) -> tuple[list[Prompt], list[str]]:
        """The first ``limit`` records (0: all) as Prompts, and why each of them that cannot be one cannot
        (:meth:`__getitem__`'s ``"<where>: <reason>"``), in order."""
        prompts, errors = [], []
        for i in range(min(limit, len(self)) if limit > 0 else len(self)):
            try:
                prompts.append(self[i])
            except SourceError as e:
                errors.append(str(e))
        return prompts, errors

    def get(self, index: int) -> Prompt | None:
        """Record ``index`` as a Prompt, or None when ``self[index]`` raises :class:`SourceError`
        (some datasets have a few bad records, e.g. DeepScaleR-math has a null answer).

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
    "search": SourceSpec("search_qa.jsonl", "search"),
}
"""Built-in sources by name. ``gsm8k`` is the 1319-problem test split; ``search`` is the search-agent demo's
512 questions (``scripts/make_search_kb.py``), answerable only through the search tool's corpus
(``search_kb.jsonl``)."""


def source_name(name_or_path: str | Path) -> str:
    """The name a source stamps on its prompts, part of every ``prompt_id``: a built-in's key, or a file's name
    up to its first dot (``data/train.jsonl.gz`` -> ``train``). Two sources of one run must not share it: their
    records would get the same ids and one's be dropped as the other's duplicates."""
    key = str(name_or_path)
    return key if key in SOURCES else Path(key).name.split(".")[0]


def load_source(name_or_path: str | Path, *, adapter: str | Adapter | None = None,
                answer_field: str | None = None, split: str | None = None, n: int = 10000,
                seed: int = 0, max_operand: int = 19, max_prompt_chars: int | None = None) -> PromptSource:
    """Open a built-in source by name (see :data:`SOURCES`) or a dataset file/directory.

    Args:
        name_or_path: a key of :data:`SOURCES`, or a path (the source name is then the file's stem).
        adapter: an adapter name from :data:`ADAPTERS` or a callable; by default
            the built-in's, or guessed from the first readable record's fields.
        answer_field: read the gold answer from this field (generic math adapter).
        split: split of a saved ``DatasetDict``.
        n, seed, max_operand: size, RNG seed and largest operand of the synthetic ``arith`` source.
        max_prompt_chars: reject prompts longer than this many characters (:attr:`PromptSource.max_prompt_chars`).

    Raises:
        SourceError: unknown name, unreadable path, unknown adapter, empty source, or a source
            none of whose records is readable (the message shows the first).
    """
    key = str(name_or_path)
    path: Path | None
    name = source_name(key)
    if key in SOURCES:
        spec = SOURCES[key]
        path = None if spec.file is None else DATA_DIR / spec.file
        default_adapter = spec.adapter
    else:
        path = Path(key)
        if not path.exists():
            raise SourceError(f"unknown prompt source {key!r}: neither a built-in "
                              f"({', '.join(SOURCES)}) nor an existing path")
        default_adapter = None
    records, lines = (arith_records(n, seed, max_operand), None) if path is None else read_records(path, split)
    if not records:
        raise SourceError(f"prompt source {key!r} has no records")
    first = next((r for r in records if not isinstance(r, Unreadable)), None)
    if first is None:
        raise SourceError(f"prompt source {key!r}: none of its {len(records)} records is readable; "
                          f"the first, {path}:{lines[0]}: {records[0].reason}")
    if answer_field is not None and adapter is None:
        adapter = make_generic_adapter(answer_field=answer_field)
    chosen = adapter if adapter is not None else default_adapter
    if isinstance(chosen, str):
        if chosen not in ADAPTERS:
            raise SourceError(f"unknown adapter {chosen!r} (known: {', '.join(ADAPTERS)})")
        chosen = ADAPTERS[chosen]
    return PromptSource(name=name, records=records, adapter=chosen or guess_adapter(first),
                        path=None if path is None else str(path), lines=lines, max_prompt_chars=max_prompt_chars)
