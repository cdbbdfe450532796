"""AstraFlow: producers."""
