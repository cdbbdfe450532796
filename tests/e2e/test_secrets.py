"""A run on Kafka's SASL_SSL listener, with secrets planted in its environment: the run learns through the
secure bus, and no secret appears in anything it leaves behind or prints (logs, metrics, status output,
``components.json``, every file of the run directory)."""
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import secure_kafka_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_sasl_ssl_run_leaves_no_secret_in_its_run_dir_or_output(tmp_path):
    secure = secure_kafka_env()
    password = secure["ASTRAFLOW_KAFKA_SASL_PASSWORD"]
    planted = {"AWS_SECRET_ACCESS_KEY": f"planted-aws-{uuid.uuid4().hex}",
               "HF_TOKEN": f"hf_planted{uuid.uuid4().hex}"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAFLOW_KAFKA_")}
    # the password only in the environment; the rest of the kafka section as overrides, as a user would
    env.update(planted, ASTRAFLOW_KAFKA_SASL_PASSWORD=password, COLUMNS="160")
    run = f"secret{uuid.uuid4().hex[:8]}"
    args = ["examples/arith-tiny.yaml", f"run={run}", f"run_dir={tmp_path}",
            f"bus=kafka://{secure['ASTRAFLOW_SECURE_BOOTSTRAP']}", "policies.actor.steps=6",
            "kafka.security_protocol=SASL_SSL", "kafka.sasl_mechanism=SCRAM-SHA-512",
            f"kafka.sasl_username={secure['ASTRAFLOW_KAFKA_SASL_USERNAME']}",
            f"kafka.ssl_ca_location={secure['ASTRAFLOW_KAFKA_SSL_CA_LOCATION']}"]
    done = subprocess.run([sys.executable, "-m", "astraflow", "run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["complete"] and summary["versions"] == {"actor": 6}, summary
    status = subprocess.run([sys.executable, "-m", "astraflow", "status", *args, "--json", "--seconds", "1"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr[-3000:]
    assert json.loads(status.stdout.strip().splitlines()[-1])["policies"]["actor"]["version"] == 6

    secrets = [password, *planted.values()]
    outputs = {"run stdout": done.stdout, "run stderr": done.stderr,
               "status stdout": status.stdout, "status stderr": status.stderr}
    for name, text in outputs.items():
        for secret in secrets:
            assert secret not in text, f"a planted secret is in the {name}"
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {"components.json", "metrics.jsonl"} <= {p.name for p in files}
    assert any(p.parent.name == "logs" for p in files)
    for path in files:
        data = path.read_bytes()
        for secret in secrets:
            assert secret.encode() not in data, f"a planted secret is in {path}"
