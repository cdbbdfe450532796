"""The versioned weight object store (DESIGN.md, "Weights").

Objects live at ``<run>/<policy>/<version:08d>/{delta.zst,full.safetensors}``
under a root URI, through obstore:

- ``file:///abs/dir``: a local directory (the default is ``<run dir>/weights``).
  obstore's local put writes a staging file next to the target and renames it
  into place, so a reader sees the whole object or none.
- ``s3://bucket/prefix``: any S3-compatible endpoint. Endpoint, region and
  credentials come from ``options``, else the standard ``AWS_*`` environment variables
  (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), else a profile of the standard
  shared files (``AWS_PROFILE``, ``~/.aws/credentials``, ``AWS_SHARED_CREDENTIALS_FILE``),
  read by boto3 through obstore's ``Boto3CredentialProvider``. An S3 PUT (and a
  completed multipart upload) is atomic.
"""
from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import obstore
from obstore.exceptions import AlreadyExistsError, NotFoundError
from obstore.store import from_url

log = logging.getLogger(__name__)

Kind = Literal["delta", "full"]
#: Object file name of each kind.
FILENAMES: dict[str, str] = {"delta": "delta.zst", "full": "full.safetensors"}
#: obstore retries a failed S3 request (connection errors, 5xx, timeouts) with back-off for at most this
#: long, then raises: an unreachable store shows up as a failed publish or pull (retried by the caller)
#: within seconds, not after obstore's default of 3 minutes.
RETRY_TIMEOUT_S = 20.0
#: An S3 request fails when no byte arrives for this long (a stalled connection; retried as above) ...
STALL_TIMEOUT_S = 30.0
#: ... or when it has not finished after this long. obstore's default, 30 s for the whole request, cut off every
#: object that takes longer to arrive: a 7B full snapshot (14 GB) crossing a 4 Gbit/s link between regions takes 28 s,
#: and each retry started over (scripts/bench_crossregion.py).
REQUEST_TIMEOUT_S = 3600.0
# objects up to this size (bytes) are downloaded in one request and written at once: obstore's stream costs ~5 ms
# even for one chunk of 1.4 MB (a float32 tiny model's snapshot, pulled twice per iteration by a solver-verifier
# RaaS worker), against 0.4 ms for a whole get; larger ones stream, so memory holds one chunk, not the object
WHOLE_DOWNLOAD_BYTES = 64 << 20
_KEY = re.compile(r"^(?P<policy>[^/]+)/(?P<version>\d{8})/(?P<file>delta\.zst|full\.safetensors)$")


class StoreError(RuntimeError):
    """An object-store operation failed (network, permissions, bad URI); the message says why in one line."""


class StoreUnavailable(StoreError):
    """The store failed a request (unreachable, no answer in time, an error status). The store logs such failures
    once per episode (:meth:`WeightStore._failed`), so a caller that retries logs each one at debug level."""


class ObjectMissing(StoreError):
    """The object does not exist (never written, deleted by retention, or not yet visible)."""


class ObjectExists(StoreError):
    """An object already exists at the key with other bytes: a version names one set of weights for ever, so
    it is never overwritten (retrying cannot help)."""


@dataclass(frozen=True)
class StoredObject:
    """One weight object: its policy, version, kind, key (relative to the store root) and size in bytes."""

    policy: str
    version: int
    kind: Kind
    key: str
    size: int


def describe_failure(e: BaseException) -> str:
    """The cause of obstore exception ``e`` in one line of words, e.g. ``unreachable: connection refused at
    http://127.0.0.1:9000 (9 retries in 2.6 s)``, ``unreachable: no answer (timed out) at ...``, ``answered HTTP
    404 NoSuchBucket (The specified bucket does not exist) at ...``. obstore's message carries a ~40-line Rust
    debug dump of the error chain; this reads the cause out of it (the dump itself belongs in a debug log)."""
    text = str(e)
    head = " ".join(text.split("Debug source:", 1)[0].split())
    endpoint = re.search(r"(https?://[^/\s,]+)", text)
    at = f" at {endpoint.group(1)}" if endpoint else ""
    os_error = re.search(r'Os \{[^}]*?message: "([^"]+)"', text, re.S)
    status = re.search(r"\bstatus: (\d{3})\b", text)
    if os_error:
        cause = f"unreachable: {os_error.group(1).lower()}{at}"
    elif re.search(r"\bkind: Timeout\b|\bTimedOut\b", text):
        cause = f"unreachable: no answer (timed out){at}"
    elif re.search(r"\bkind: Connect\b", text):
        cause = f"unreachable: cannot connect{at}"
    elif status:
        code, message = re.search(r"<Code>([^<]*)</Code>", text), re.search(r"<Message>([^<]*)</Message>", text)
        cause = (f"answered HTTP {status.group(1)}" + (f" {code.group(1)}" if code else "")
                 + (f" ({message.group(1)})" if message else "") + at)
    else:
        return f"{type(e).__name__}: {head[:300]}"
    retries, elapsed = re.search(r"\bretries: (\d+)", text), re.search(r"\belapsed: ([\d.]+)(ms|s)\b", text)
    if retries and elapsed:
        seconds = float(elapsed.group(1)) / (1000.0 if elapsed.group(2) == "ms" else 1.0)
        cause += f" ({retries.group(1)} retries in {seconds:.1f} s)"
    return cause


def _profile_credentials(options: dict[str, Any]) -> Any:
    """obstore's boto3 credential provider for the AWS profile in use, when neither ``options`` nor the
    environment give keys and a profile is configured (``AWS_PROFILE``, or a shared credentials file);
    else None (obstore's own chain: environment, web identity, container and instance metadata)."""
    if "access_key_id" in options or os.environ.get("AWS_ACCESS_KEY_ID"):
        return None
    shared = Path(os.environ.get("AWS_SHARED_CREDENTIALS_FILE", Path.home() / ".aws" / "credentials"))
    if not os.environ.get("AWS_PROFILE") and not shared.is_file():
        return None
    import boto3
    from obstore.auth.boto3 import Boto3CredentialProvider

    return Boto3CredentialProvider(boto3.Session())


def check_store_uri(uri: str) -> None:
    """Refuse a weight store URI that is not ``file:///abs/dir`` or ``s3://bucket/prefix`` (no I/O).

    Raises:
        StoreError: the scheme is neither ``file`` nor ``s3``, nothing follows it, or a ``file`` path is relative.
    """
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in ("file", "s3") or not rest:
        raise StoreError(f"weight store URI {uri!r} must be file:///abs/dir or s3://bucket/prefix")
    if scheme == "file" and not rest.startswith("/"):
        raise StoreError(f"weight store URI {uri!r}: a file:// path must be absolute")


class WeightStore:
    """Weight objects of one run under a root URI.

    Args:
        uri: ``file:///abs/dir`` or ``s3://bucket[/prefix]``.
        run: the run name (first path component of every key).
        options: obstore config for S3 (``endpoint``, ``region``,
            ``access_key_id``, ``secret_access_key``, ...); environment
            variables fill in what is not given. An ``http://`` endpoint, given here
            or in ``AWS_ENDPOINT_URL(_S3)``, turns on ``allow_http``.

    Raises:
        StoreError: the URI scheme is not ``file`` or ``s3``, or a ``file`` path is not absolute.
    """

    def __init__(self, uri: str, run: str, **options: Any):
        check_store_uri(uri)
        scheme, _, rest = uri.partition("://")
        if "/" in run or not run:
            raise StoreError(f"run name {run!r} must be a non-empty path component")
        self.uri, self.run = uri.rstrip("/"), run
        self._lock = threading.Lock()
        self._failing: tuple[float, int] | None = None  # (monotonic start, failed requests) of an ongoing failure
        try:
            if scheme == "file":
                Path(rest).mkdir(parents=True, exist_ok=True)
                self._store = from_url(uri, mkdir=True, automatic_cleanup=True)  # deleted versions leave no empty dirs
            else:
                endpoint = (options.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3")
                            or os.environ.get("AWS_ENDPOINT_URL") or "")
                client: dict[str, Any] = {"read_timeout": timedelta(seconds=STALL_TIMEOUT_S),
                                          "timeout": timedelta(seconds=REQUEST_TIMEOUT_S)}
                if str(endpoint).startswith("http://"):
                    client["allow_http"] = True
                self._store = from_url(uri, config=options or None, client_options=client,
                                       credential_provider=_profile_credentials(options),
                                       retry_config={"retry_timeout": timedelta(seconds=RETRY_TIMEOUT_S)})
        except StoreError:
            raise
        except Exception as e:
            raise StoreError(f"weight store {uri!r}: cannot open ({type(e).__name__}: {e})") from None

    def key(self, policy: str, version: int, kind: Kind) -> str:
        """The key of an object: ``<run>/<policy>/<version:08d>/<file>``."""
        if kind not in FILENAMES:
            raise ValueError(f"kind must be 'delta' or 'full', got {kind!r}")
        return f"{self.run}/{policy}/{version:08d}/{FILENAMES[kind]}"

    def uri_of(self, key: str) -> str:
        """The full URI of ``key`` (what an announcement carries)."""
        return f"{self.uri}/{key}"

    def _failed(self, what: str, uri: str, e: Exception) -> StoreUnavailable:
        """The StoreUnavailable for obstore failure ``e`` of request ``what`` ``uri`` (``put s3://b/p/k``), its message
        the cause in one line (:func:`describe_failure`). Logged once per episode: the first failure after an
        answer is one warning with its cause, :meth:`_answered` ends the episode; the failures between (each
        caller's retries) go to the debug log, with obstore's whole message."""
        cause = describe_failure(e)
        log.debug("%s %s failed: %s", what, uri, e)
        with self._lock:
            if self._failing is None:
                log.warning("store %s %s, on %s %s; further failures go to the debug log until it answers",
                            self.uri, cause, what, uri)
                self._failing = (time.monotonic(), 0)
            self._failing = (self._failing[0], self._failing[1] + 1)
        return StoreUnavailable(f"{what} {uri} failed: store {cause}")

    def _answered(self) -> None:
        """The store answered a request: an ongoing failure episode ends, with one warning line."""
        with self._lock:
            if self._failing is not None:
                since, failed = self._failing
                self._failing = None
                log.warning("store %s back after %.1f s (%d requests failed)", self.uri, time.monotonic() - since,
                            failed)

    def put(self, key: str, data: bytes | Path) -> None:
        """Write ``data`` (bytes, or a local file streamed in parts) to ``key`` atomically, only if nothing is
        there yet (a create-only put: S3 ``If-None-Match: *``, a no-clobber link on a local directory). An object
        already there with the same bytes is accepted (a retried put whose first attempt landed).

        Raises:
            ObjectExists: ``key`` holds other bytes (it is left as it was).
            StoreError: the write failed; no partial object is visible.
        """
        try:
            obstore.put(self._store, key, data, mode="create")
            self._answered()
            return
        except AlreadyExistsError:
            pass
        except Exception as e:
            raise self._failed("put", self.uri_of(key), e) from None
        ours = data.read_bytes() if isinstance(data, Path) else bytes(data)
        if self.get(key) != ours:
            raise ObjectExists(f"put {self.uri_of(key)} refused: an object with other bytes is already there "
                               f"(a version is never overwritten)")

    def get(self, key: str, start: int | None = None, length: int | None = None) -> bytes:
        """Read object ``key`` (or ``length`` bytes from ``start``).

        Raises:
            ObjectMissing: no such object.
            StoreError: any other failure.
        """
        try:
            if start is None:
                out = obstore.get(self._store, key).bytes().to_bytes()
            else:
                out = obstore.get_range(self._store, key, start=start, length=length).to_bytes()
        except (NotFoundError, FileNotFoundError):
            self._answered()
            raise ObjectMissing(f"weight object {self.uri_of(key)} does not exist") from None
        except Exception as e:
            raise self._failed("get", self.uri_of(key), e) from None
        self._answered()
        return out

    def exists(self, key: str) -> bool:
        """Whether object ``key`` exists (one HEAD request).

        Raises:
            StoreError: the store did not answer.
        """
        try:
            obstore.head(self._store, key)
        except (NotFoundError, FileNotFoundError):
            self._answered()
            return False
        except Exception as e:
            raise self._failed("head", self.uri_of(key), e) from None
        self._answered()
        return True

    def download(self, key: str, path: Path, size: int | None = None) -> int:
        """Stream object ``key`` into the local file ``path``; returns its size in bytes. An object of a known
        ``size`` (bytes, from the listing) up to ``WHOLE_DOWNLOAD_BYTES`` is read whole and written at once.

        Raises:
            ObjectMissing, StoreError: as :meth:`get`.
        """
        if size is not None and size <= WHOLE_DOWNLOAD_BYTES:
            data = self.get(key)
            path.write_bytes(data)
            return len(data)
        try:
            size = 0
            with open(path, "wb") as f:
                for chunk in obstore.get(self._store, key):
                    f.write(chunk)
                    size += len(chunk)
        except NotFoundError:
            self._answered()
            raise ObjectMissing(f"weight object {self.uri_of(key)} does not exist") from None
        except Exception as e:
            raise self._failed("download", self.uri_of(key), e) from None
        self._answered()
        return size

    def objects(self, policy: str) -> list[StoredObject]:
        """Every weight object of ``policy``, sorted by (version, kind).

        Raises:
            StoreError: the listing failed.
        """
        out = []
        prefix = f"{self.run}/{policy}/"
        try:
            for batch in obstore.list(self._store, prefix):
                for meta in batch:
                    m = _KEY.match(meta["path"][len(self.run) + 1:])
                    if m and m["policy"] == policy:
                        kind = "delta" if m["file"] == FILENAMES["delta"] else "full"
                        out.append(StoredObject(policy, int(m["version"]), kind, meta["path"], int(meta["size"])))
        except Exception as e:
            raise self._failed("list", f"{self.uri}/{prefix}", e) from None
        self._answered()
        return sorted(out, key=lambda o: (o.version, o.kind))

    def versions(self, policy: str) -> dict[int, dict[str, StoredObject]]:
        """``{version: {kind: object}}`` for ``policy``, ascending by version."""
        out: dict[int, dict[str, StoredObject]] = {}
        for o in self.objects(policy):
            out.setdefault(o.version, {})[o.kind] = o
        return out

    def retain(self, policy: str, keep: int) -> list[str]:
        """Delete objects no live chain needs; returns the deleted keys.

        The newest ``keep`` versions are retained. So is the newest full
        snapshot at or below the oldest retained version, and every object
        after it, so that every retained version stays reachable as "full
        snapshot + deltas". Without such a snapshot nothing is deleted.

        Raises:
            ValueError: ``keep`` < 1.
            StoreError: listing or deleting failed.
        """
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        versions = self.versions(policy)
        ordered = sorted(versions)
        if len(ordered) <= keep:
            return []
        oldest_kept = ordered[-keep]
        fulls = [v for v in ordered if v <= oldest_kept and "full" in versions[v]]
        if not fulls:
            return []
        doomed = [o.key for v in ordered if v < fulls[-1] for o in versions[v].values()]
        if doomed:
            try:
                obstore.delete(self._store, doomed)
            except Exception as e:
                raise self._failed("delete", f"{len(doomed)} objects under {self.uri}/{self.run}/{policy}", e) from None
        return doomed
