"""`astraflow run` refuses a bad config before starting anything, naming what is wrong."""
import pytest
from typer.testing import CliRunner

from astraflow.cli import app


@pytest.mark.parametrize("override, message", [
    ("workflow.name=nope", "unknown workflow 'nope'; registered: ["),
    ("policies.actor.filters=[{name: nope}]", "policy 'nope': unknown policy; known: accept_all"),
    ("policies.actor.model=/nonexistent", "/nonexistent is not an HF model directory"),
    ("bus=kafka://127.0.0.1:1", "cannot reach Kafka at 127.0.0.1:1"),
])
def test_run_preflight_rejects_bad_config(tmp_path, override, message):
    result = CliRunner().invoke(app, ["run", "examples/arith-tiny.yaml", f"run_dir={tmp_path}", override])
    assert result.exit_code == 2
    assert message in result.output
    assert not (tmp_path / "logs").exists()  # nothing was started
