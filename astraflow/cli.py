"""The ``astraflow`` command line."""
import typer

app = typer.Typer(help="AstraFlow: dataflow-oriented RL for agentic LLMs.", no_args_is_help=True)


@app.command()
def version() -> None:
    """Print the AstraFlow version."""
    from importlib.metadata import version as v

    typer.echo(v("astraflow"))
