"""The ``astraflow`` command line."""
import typer

app = typer.Typer(help="AstraFlow: dataflow-oriented RL for agentic LLMs.", no_args_is_help=True)


@app.command()
def version() -> None:
    """Print the AstraFlow version."""
    from importlib.metadata import version as v

    typer.echo(v("astraflow"))


@app.command("verify-rewards")
def verify_rewards(
    dataset: str = typer.Option(..., "--dataset", help="a built-in source (gsm8k, math500, humaneval, mbpp, ...) or a JSONL/parquet file"),
    answer_field: str = typer.Option(None, "--answer-field", help="read the gold answer from this field"),
    limit: int = typer.Option(0, "--limit", help="check only the first N prompts (0: all)"),
    timeout_s: float = typer.Option(10.0, "--timeout", help="per-item reward timeout, seconds"),
) -> None:
    """Score each gold answer and a perturbed wrong one; print disagreements, then a JSON line
    {"gold_accept", "wrong_reject", "n"}."""
    import json

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from producers.rewards import check_rewards
    from producers.sources import load_source

    source = load_source(dataset, answer_field=answer_field)
    candidates = [source.get(i) for i in range(min(limit, len(source)) if limit > 0 else len(source))]
    prompts = [p for p in candidates if p is not None]
    if len(prompts) < len(candidates):
        Console(stderr=True).print(f"skipped {len(candidates) - len(prompts)} malformed record(s)")
    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(f"scoring {source.name}", total=2 * len(prompts))
        result = check_rewards(prompts, timeout_s=timeout_s, on_done=lambda: progress.advance(task))
    if result.disagreements:
        table = Table("index", "kind", "gold", "completion", "score", title="disagreements")
        for p, kind, completion, score in result.disagreements:
            gold = p.answer if p.answer is not None else str(p.metadata.get("task_id", ""))
            table.add_row(str(p.metadata.get("index")), kind, gold[:40], completion.strip()[:60], f"{score:g}")
        Console().print(table)
    print(json.dumps({"gold_accept": round(result.gold_accept, 4), "wrong_reject": round(result.wrong_reject, 4),
                      "n": result.n}), flush=True)
