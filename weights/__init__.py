"""AstraFlow: weights."""
