"""Kafka security: settings that do not fit are refused with the field named, a wrong password or a plaintext
client on the SASL_SSL listener fails with the reason, and the password shows nowhere but in librdkafka's config.
(The contract suite's core cases run on the SASL_SSL listener too: ``core`` in test_contract.py.)"""
import pytest
from pydantic import ValidationError

from astraflow.config import RunConfig
from tests.conftest import secure_kafka_env
from topics.bus import BusError, connect
from topics.kafka_security import KafkaSecurity

POLICIES = {"actor": {"model": "tiny"}}


def test_sasl_without_credentials_is_refused_naming_the_fields(monkeypatch):
    monkeypatch.delenv("ASTRAFLOW_KAFKA_SASL_PASSWORD", raising=False)
    with pytest.raises(ValidationError, match=r"needs kafka.sasl_username \(ASTRAFLOW_KAFKA_SASL_USERNAME\), "
                                              r"kafka.sasl_password"):
        KafkaSecurity(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512")


def test_settings_the_protocol_would_ignore_are_refused(tmp_path):
    with pytest.raises(ValidationError, match="kafka.sasl_username is set but security_protocol=PLAINTEXT"):
        KafkaSecurity(sasl_username="u")
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    with pytest.raises(ValidationError, match="kafka.ssl_ca_location is set but security_protocol=SASL_PLAINTEXT"):
        KafkaSecurity(security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN", sasl_username="u",
                      sasl_password="p", ssl_ca_location=ca)
    with pytest.raises(ValidationError, match="kafka.ssl_ca_location: no such file"):
        KafkaSecurity(security_protocol="SSL", ssl_ca_location=tmp_path / "missing.pem")
    with pytest.raises(ValidationError, match="kafka settings apply to a kafka:// bus"):
        RunConfig(policies=POLICIES, kafka={"security_protocol": "SSL"})


def test_unset_fields_come_from_the_environment_and_the_password_stays_hidden(monkeypatch):
    monkeypatch.setenv("ASTRAFLOW_KAFKA_SASL_PASSWORD", "planted-password-123")
    monkeypatch.setenv("ASTRAFLOW_KAFKA_SASL_USERNAME", "alice")
    cfg = RunConfig(policies=POLICIES, bus="kafka://127.0.0.1:1",
                    kafka={"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-256"})
    assert cfg.kafka.sasl_username == "alice"
    assert cfg.kafka.librdkafka() == {"security.protocol": "sasl_ssl", "sasl.mechanism": "SCRAM-SHA-256",
                                      "sasl.username": "alice", "sasl.password": "planted-password-123",
                                      "ssl.endpoint.identification.algorithm": "https"}
    for shown in (repr(cfg), str(cfg), cfg.model_dump_json(), str(cfg.model_dump())):
        assert "planted-password-123" not in shown


def test_a_wrong_password_is_refused_with_the_reason(monkeypatch):
    env = secure_kafka_env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("ASTRAFLOW_KAFKA_SASL_PASSWORD", "not-the-password")
    with pytest.raises(BusError, match="SASL authentication error"):
        connect(f"kafka://{env['ASTRAFLOW_SECURE_BOOTSTRAP']}").admin()


def test_a_plaintext_client_gets_nothing_from_the_sasl_ssl_listener(monkeypatch):
    env = secure_kafka_env()
    for name in env:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(BusError, match="cannot reach Kafka"):
        connect(f"kafka://{env['ASTRAFLOW_SECURE_BOOTSTRAP']}").admin()
