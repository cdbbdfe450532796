"""AstraFlow: trainer."""
