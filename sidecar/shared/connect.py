"""Open the object store a ``--shared-store`` location names."""

from __future__ import annotations

from sidecar.core import location
from sidecar.shared import filestore, objstore, s3store


def open_store(where: location.Location) -> objstore.ObjectStore:
    if where.scheme is location.Scheme.FILE:
        return filestore.FileStore(where)
    return s3store.S3Store(where)
