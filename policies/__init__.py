"""AstraFlow: policies."""
