"""``python -m astraflow`` runs the command line (the launcher starts components this way)."""
from astraflow.cli import app

app(prog_name="astraflow")
