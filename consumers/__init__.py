"""AstraFlow: consumers."""
