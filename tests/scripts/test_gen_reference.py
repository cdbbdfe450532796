"""The generated pages match their sources: regenerating docs/reference/config.md, cli.md and metrics.md, and the
tables of docs/benchmarks/index.md, yields no diff; every config field and every emitted metric has a
description; the check notices a field without one, a table that disagrees with its JSON, and a JSON without its
provenance."""
import json
import shutil
import sys
from pathlib import Path

from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import scripts.gen_reference as gen  # noqa: E402
from scripts.gen_reference import CLI_PAGE, CONFIG_PAGE, config_models, main, undescribed  # noqa: E402


def test_the_committed_pages_are_what_the_code_generates(capsys):
    assert main(["--check"]) == 0, capsys.readouterr().err


def test_every_config_field_is_described_and_listed():
    from astraflow.config import RunConfig

    assert undescribed(RunConfig) == []
    text = CONFIG_PAGE.read_text()
    for model, _ in config_models(RunConfig):
        assert f"## {model.__name__}\n" in text
        for name in model.model_fields:
            assert f"| `{name}` |" in text, (model.__name__, name)
    assert "## `astraflow run`" in CLI_PAGE.read_text() and "## `astraflow verify-rewards`" in CLI_PAGE.read_text()


def test_a_field_without_a_description_is_named():
    class Inner(BaseModel):
        ok: int = Field(default=1, description="described")
        bare: str = "x"

    class Outer(BaseModel):
        items: list[Inner] = Field(default_factory=list, description="nested in a list")
        by_name: dict[str, Inner] = Field(default_factory=dict, description="nested in a mapping")

    assert undescribed(Outer) == ["Inner.bare"]
    assert config_models(Outer) == [(Outer, [""]), (Inner, ["items[]", "by_name.<key>"])]


def test_every_emitted_metric_is_described_and_listed():
    assert gen.metrics_problems() == []
    text = gen.METRICS_PAGE.read_text()
    for source in gen.METRIC_SOURCES:
        names = gen.emitted_names(source)
        assert names, source  # the source still builds its records where METRIC_SOURCES says
        for name in names:
            assert f"| `{name}` |" in text, name
    assert '| `staleness_hist/<k>` | `astraflow_staleness_hist{staleness="<k>"}` |' in text
    for family, _, _ in gen.exporter_families():
        assert f"| `{family}` |" in text


def test_a_benchmark_table_that_disagrees_with_its_json_is_noticed(tmp_path, monkeypatch):
    page, data = tmp_path / "index.md", tmp_path / "data"
    shutil.copy(gen.BENCH_PAGE, page)
    shutil.copytree(gen.BENCH_DATA, data)
    monkeypatch.setattr(gen, "BENCH_PAGE", page)
    monkeypatch.setattr(gen, "BENCH_DATA", data)
    assert gen.bench_problems() == [] and gen.bench_page() == page.read_text()

    stability = json.loads((data / "stability.json").read_text())
    stability["per_run"][0]["reward_last"] += 0.1
    (data / "stability.json").write_text(json.dumps(stability))
    assert gen.bench_page() != page.read_text()

    del stability["commit"]
    (data / "stability.json").write_text(json.dumps(stability))
    (data / "new.json").write_text(json.dumps({"command": ["x"], "machine": "m", "commit": "c"}))
    assert gen.bench_problems() == ["data/new.json has no generated block in index.md",
                                    "data/stability.json lacks commit"]


def test_a_bench_without_a_table_of_its_own_shows_every_figure_of_its_line():
    line = {"metric": "async_speedup", "value": 12.5, "ratio_spread": {"runs": [1.5, 2.25], "n": 2, "median": 1.875,
            "min": 1.5, "max": 2.25}, "sync_s_by_threads": {"1": [20.0, 21.0]}, "placement": [],
            "command": ["scripts/bench_async.py", "--quick"], "commit": "abc1234", "machine": "Linux, nproc 2"}
    assert gen.result_table(line).splitlines() == [
        "| figure | value |", "|---|---|", "| `metric` | async_speedup |", "| `value` | 12.5 |",
        "| `ratio_spread` | 1.875 [1.5, 2.25] (runs 1.5, 2.25) |", "| `sync_s_by_threads.1` | 20, 21 |",
        "| `placement` | none |", "",
        "`scripts/bench_async.py --quick`, commit `abc1234`, on Linux, nproc 2."]
