"""The deployment files: docker-compose.yml validates (docker-compose's own schema check, offline: no Docker
engine runs here), every AstraFlow service runs an `astraflow` command that exists with a config and overrides
that load, and the Dockerfile copies what exists."""
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import typer.main
import yaml

from astraflow.cli import app
from astraflow.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict:
    """docker-compose.yml as docker-compose resolves it (anchors merged, `$$` kept)."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is not installed (scripts/test.sh installs Debian's docker-compose)")
    done = subprocess.run([exe, "-f", str(ROOT / "docker-compose.yml"), "config"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def _astraflow_argv(service: dict) -> list[str]:
    """The arguments after `astraflow` of a service of the AstraFlow image (its command, or an `sh -c` entrypoint
    that execs astraflow, $$VAR read as a value)."""
    entry = service.get("entrypoint")
    if entry:
        assert entry[:2] == ["sh", "-c"], entry
        argv = shlex.split(entry[2].replace("$$", ""))
        assert argv[:2] == ["exec", "astraflow"], argv
        return argv[2:]
    return list(service["command"])


def test_the_compose_file_validates_and_runs_every_component_of_the_example():
    services = _compose()["services"]
    ours = {name: s for name, s in services.items() if s.get("image") == "astraflow:cpu"}
    assert {"acquire", "raas", "policy", "trainer", "exporter"} <= set(ours)
    assert {"kafka", "minio", "minio-init"} <= set(services)
    commands = typer.main.get_command(app).commands
    for name, service in ours.items():
        argv = _astraflow_argv(service)
        command = commands[argv[0]]  # a command astraflow has
        flags = {opt for p in command.params for opt in p.opts}
        positional = [a for a in argv[1:] if not a.startswith("--")]
        for flag in (a for a in argv[1:] if a.startswith("--")):
            assert flag.split("=")[0] in flags, (name, flag)
        config, overrides = ROOT / positional[0], [a for a in positional[1:] if "=" in a]
        cfg = load_config(config, overrides)  # the config and its overrides load
        assert cfg.bus == "kafka://kafka:19092" and cfg.store == "s3://astraflow/weights", name
        assert service["environment"]["AWS_ENDPOINT_URL"] == "http://minio:9000"
        assert "container_name" not in service  # scalable
    assert "--worker-id" in _astraflow_argv(ours["raas"])  # replicas are distinct static group members
    assert "9400" in str(ours["exporter"]["ports"])


def test_the_dockerfile_copies_what_exists_and_installs_from_the_lock():
    text = (ROOT / "Dockerfile").read_text()
    sources = [src for line in re.findall(r"^COPY (.+)$", text, re.M) for src in line.split()[:-1]]
    assert sources and all((ROOT / s).exists() for s in sources), [s for s in sources if not (ROOT / s).exists()]
    assert "scripts/install.sh dev" in text and 'ENTRYPOINT ["astraflow"]' in text
