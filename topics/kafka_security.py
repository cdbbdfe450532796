"""How AstraFlow authenticates to Kafka and encrypts its traffic: SASL (SCRAM or PLAIN) and TLS.

:class:`KafkaSecurity` is the ``kafka:`` section of a run config. What the config does not set comes
from the environment, ``ASTRAFLOW_KAFKA_<FIELD>`` (e.g. ``ASTRAFLOW_KAFKA_SASL_PASSWORD``), read by
pydantic-settings; a password is best given there, not in a file. The settings become librdkafka
properties (:meth:`KafkaSecurity.librdkafka`, names as in librdkafka's CONFIGURATION.md:
``security.protocol``, ``sasl.mechanism``, ``sasl.username``, ``sasl.password``, ``ssl.ca.location``,
``ssl.certificate.location``, ``ssl.key.location``, ``ssl.endpoint.identification.algorithm``) on every
Kafka client of the process: producers, consumers, admin clients and the group-describe helper.

The password is a :class:`pydantic.SecretStr`: ``repr``, ``str`` and ``model_dump`` show ``**********``,
so it reaches no log, metric, status output or ``components.json``; only :meth:`librdkafka` reveals it,
to librdkafka.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

#: The environment variable prefix of :class:`KafkaSecurity`'s fields.
ENV_PREFIX = "ASTRAFLOW_KAFKA_"


class KafkaSecurity(BaseSettings):
    """Kafka client security: protocol, SASL credentials and TLS files.

    Attributes:
        security_protocol: ``PLAINTEXT`` (default), ``SSL``, ``SASL_PLAINTEXT`` or ``SASL_SSL``.
        sasl_mechanism: ``SCRAM-SHA-512``, ``SCRAM-SHA-256`` or ``PLAIN``; required with ``SASL_*``.
        sasl_username, sasl_password: the SASL credentials; required with ``SASL_*``.
        ssl_ca_location: PEM file of the CA that signed the brokers' certificates (``SSL``/``SASL_SSL``;
            default: the system's trust store).
        ssl_certificate_location, ssl_key_location: PEM client certificate and key, for brokers that
            authenticate clients by TLS (both or neither).
        ssl_verify_hostname: check that the broker's certificate names the host connected to (librdkafka's
            ``ssl.endpoint.identification.algorithm=https``); turn off only for test certificates.

    Raises:
        pydantic.ValidationError: a field that does not fit the protocol (SASL fields without ``SASL_*``, TLS
            files without ``SSL``/``SASL_SSL``, missing SASL credentials, a TLS file that does not exist); the
            message names the field.
    """

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")

    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="PLAINTEXT (no TLS, no authentication), SSL (TLS), SASL_PLAINTEXT (SASL "
                                         "without TLS) or SASL_SSL (SASL over TLS)")
    sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"] | None = Field(
        default=None, description="the SASL mechanism; required with SASL_*")
    sasl_username: str | None = Field(default=None, description="the SASL user name; required with SASL_*")
    sasl_password: SecretStr | None = Field(default=None, description="the SASL password; required with SASL_*; "
                                            "best given in the environment, not in a file")
    ssl_ca_location: Path | None = Field(default=None, description="PEM file of the CA that signed the brokers' "
                                         "certificates (SSL/SASL_SSL); None: the system's trust store")
    ssl_certificate_location: Path | None = Field(default=None, description="PEM client certificate, for brokers "
                                                  "that authenticate clients by TLS; with ssl_key_location")
    ssl_key_location: Path | None = Field(default=None, description="PEM key of the client certificate; with "
                                          "ssl_certificate_location")
    ssl_verify_hostname: bool = Field(default=True, description="check that the broker's certificate names the host "
                                      "connected to; turn off only for test certificates")

    @model_validator(mode="after")
    def _fits_protocol(self) -> "KafkaSecurity":
        sasl = self.security_protocol.startswith("SASL_")
        tls = self.security_protocol in ("SSL", "SASL_SSL")
        sasl_fields = ("sasl_mechanism", "sasl_username", "sasl_password")
        if sasl:
            missing = [f for f in sasl_fields if getattr(self, f) is None]
            if missing:
                raise ValueError(f"security_protocol={self.security_protocol} needs "
                                 + ", ".join(f"kafka.{f} ({ENV_PREFIX}{f.upper()})" for f in missing))
        else:
            given = [f for f in sasl_fields if getattr(self, f) is not None]
            if given:
                raise ValueError(f"kafka.{given[0]} is set but security_protocol={self.security_protocol} does not "
                                 "use SASL (use SASL_SSL or SASL_PLAINTEXT)")
        tls_files = ("ssl_ca_location", "ssl_certificate_location", "ssl_key_location")
        for f in tls_files:
            path = getattr(self, f)
            if path is None:
                continue
            if not tls:
                raise ValueError(f"kafka.{f} is set but security_protocol={self.security_protocol} does not use "
                                 "TLS (use SSL or SASL_SSL)")
            if not path.is_file():
                raise ValueError(f"kafka.{f}: no such file {path}")
        if (self.ssl_certificate_location is None) != (self.ssl_key_location is None):
            raise ValueError("kafka.ssl_certificate_location and kafka.ssl_key_location go together (TLS client "
                             "authentication needs both)")
        return self

    @property
    def is_default(self) -> bool:
        """True when nothing differs from plaintext without authentication."""
        return self == KafkaSecurity.model_construct()

    def librdkafka(self) -> dict[str, str]:
        """These settings as librdkafka client properties (the password in clear, for librdkafka only);
        empty for ``PLAINTEXT``."""
        if self.security_protocol == "PLAINTEXT":
            return {}
        conf = {"security.protocol": self.security_protocol.lower()}
        if self.sasl_mechanism is not None:
            conf.update({"sasl.mechanism": self.sasl_mechanism, "sasl.username": self.sasl_username,
                         "sasl.password": self.sasl_password.get_secret_value()})
        if self.security_protocol.endswith("SSL"):
            conf["ssl.endpoint.identification.algorithm"] = "https" if self.ssl_verify_hostname else "none"
            for field, prop in (("ssl_ca_location", "ssl.ca.location"),
                                ("ssl_certificate_location", "ssl.certificate.location"),
                                ("ssl_key_location", "ssl.key.location")):
                if getattr(self, field) is not None:
                    conf[prop] = str(getattr(self, field))
        return conf
