"""AstraFlow: topics."""
