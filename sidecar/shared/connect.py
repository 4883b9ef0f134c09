"""Open the object store a ``--shared-store`` location names.

The S3 client (aiobotocore, with botocore and its ~20 packages) is the
``s3`` extra: ``pip install .`` leaves it out, so ``s3store`` is imported
only for an ``s3://`` location, and :func:`require_client` turns its
absence into a :class:`errors.ConfigError` at start-up (exit 2) that names
the extra to install.
"""

from __future__ import annotations

import importlib

from sidecar.core import errors, location
from sidecar.shared import filestore, objstore

S3_EXTRA = "llama-kv-sidecar[s3]"
S3_CLIENT = "aiobotocore"


def require_client(where: location.Location) -> location.Location:
    """``where`` itself once the client its scheme needs imports; ConfigError naming the extra if not."""
    if where.scheme is not location.Scheme.S3:
        return where
    try:
        importlib.import_module(f"{S3_CLIENT}.session")
    except ImportError as exc:
        raise errors.ConfigError(
            f"--shared-store {where.describe()} needs the S3 client ({S3_CLIENT}), which is an optional "
            f"extra that this install does not have ({exc}): run pip install '{S3_EXTRA}' (from a "
            "checkout: pip install '.[s3]'), or use a file:///PATH shared store"
        ) from None
    return where


def open_store(where: location.Location) -> objstore.ObjectStore:
    if where.scheme is location.Scheme.FILE:
        return filestore.FileStore(where)
    require_client(where)
    from sidecar.shared import s3store  # noqa: PLC0415  (the optional extra: imported only for s3://)

    return s3store.S3Store(where)
