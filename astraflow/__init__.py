"""AstraFlow: astraflow."""
