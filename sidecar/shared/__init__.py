"""The shared store: snapshots uploaded to S3 (or a shared filesystem) and fetched by other nodes.

The local slot dir stays the working copy; the shared store is where every
node's committed snapshots meet. Modules, top to bottom: ``uploader`` and
``downloader`` (the background work and the fetch into the slot dir),
``library`` (lookup by prefix hash chain), ``gc`` (retention),
``objstore`` (a Protocol with S3 and file implementations), ``records``
(the shared manifest object), ``keys`` and ``decide`` (pure), ``location``
(the ``--shared-store`` URL and the AWS environment).
"""
