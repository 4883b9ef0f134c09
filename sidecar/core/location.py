"""Where the shared store is: the ``--shared-store`` URL and the standard AWS environment. Pure code.

``s3://BUCKET/PREFIX`` reads the endpoint and keys the way the AWS tools do:
``AWS_ENDPOINT_URL_S3`` (else ``AWS_ENDPOINT_URL``; neither: AWS S3
itself), ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, optional
``AWS_SESSION_TOKEN``, and ``AWS_REGION`` (else ``AWS_DEFAULT_REGION``,
else ``us-east-1``). ``file:///PATH`` is a directory on a filesystem every
node mounts (NFS, CephFS, EFS). Anything missing or malformed is a
:class:`errors.ConfigError` at start-up that names what to set.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

from sidecar.core import errors

DEFAULT_REGION = "us-east-1"
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class Scheme(enum.StrEnum):
    S3 = "s3"
    FILE = "file"


@dataclasses.dataclass(frozen=True, slots=True)
class Location:
    scheme: Scheme
    bucket: str
    """The S3 bucket; empty for ``file://``."""
    prefix: str
    """Key prefix inside the bucket (no leading or trailing ``/``), or the directory for ``file://``."""
    endpoint: str | None = None
    """``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``; None: AWS S3 itself."""
    region: str = DEFAULT_REGION
    access_key_id: str = dataclasses.field(default="", repr=False)
    secret_access_key: str = dataclasses.field(default="", repr=False)
    session_token: str | None = dataclasses.field(default=None, repr=False)

    @property
    def key_prefix(self) -> str:
        """What every key starts with: the S3 prefix; empty for a directory (it is the root)."""
        return self.prefix if self.scheme is Scheme.S3 else ""

    def describe(self) -> str:
        """The URL without credentials, for logs and /status."""
        if self.scheme is Scheme.FILE:
            return f"file://{self.prefix}"
        where = f" at {self.endpoint}" if self.endpoint else ""
        return f"s3://{self.bucket}/{self.prefix}{where}"


def parse(url: str, env: Mapping[str, str]) -> Location:
    """The location of ``url`` with the credentials from ``env``; raise ConfigError naming what to fix."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == Scheme.FILE:
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise errors.ConfigError(
                f"--shared-store {url!r}: a file URL needs an absolute path, e.g. file:///mnt/kv-shared"
            )
        path = Path(urllib.parse.unquote(parts.path))
        if not path.is_dir():
            raise errors.ConfigError(
                f"--shared-store {url!r}: {path} is not a directory: mount the shared filesystem there, "
                "or create the directory"
            )
        return Location(Scheme.FILE, "", str(path))
    if parts.scheme != Scheme.S3:
        raise errors.ConfigError(
            f"--shared-store {url!r}: use s3://BUCKET/PREFIX (S3 or any S3-compatible server) "
            "or file:///PATH (a shared filesystem)"
        )
    bucket = parts.netloc
    if not _BUCKET_RE.match(bucket):
        raise errors.ConfigError(
            f"--shared-store {url!r}: {bucket!r} is not a bucket name (3-63 lower-case letters, digits, '.', '-')"
        )
    if parts.query or parts.fragment:
        raise errors.ConfigError(f"--shared-store {url!r}: no query or fragment; the endpoint comes from AWS_*")
    prefix = parts.path.strip("/")
    missing = [name for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if not env.get(name)]
    if missing:
        raise errors.ConfigError(
            f"--shared-store {url!r} needs credentials: set {' and '.join(missing)} "
            "(and AWS_ENDPOINT_URL_S3 for a server other than AWS S3, AWS_REGION for its region)"
        )
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
    if endpoint is not None:
        ends = urllib.parse.urlsplit(endpoint)
        if ends.scheme not in ("http", "https") or not ends.netloc:
            raise errors.ConfigError(
                f"AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL {endpoint!r} is not an http(s) URL, "
                "e.g. http://minio:9000 or https://s3.eu-central-1.amazonaws.com"
            )
    return Location(
        Scheme.S3,
        bucket,
        prefix,
        endpoint=endpoint,
        region=env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or DEFAULT_REGION,
        access_key_id=env["AWS_ACCESS_KEY_ID"],
        secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        session_token=env.get("AWS_SESSION_TOKEN") or None,
    )
