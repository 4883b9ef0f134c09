"""The shared store: snapshots uploaded to S3 (or a shared filesystem) and fetched by other nodes.

The local slot dir stays the working copy; the shared store is where every
node's committed snapshots meet. Modules, top to bottom: ``service`` (the facade
the rest of the sidecar uses), ``uploader`` and ``downloader`` (the
background upload and the fetch into the slot dir), ``blockup`` and
``blockdown`` (the same as blocks, with ``--store-dir``), ``fence`` (uploads
against a gc in progress), ``catalog`` (lookup by
prefix hash chain), ``gc`` (retention), ``connect`` with ``s3store`` and
``filestore`` (the implementations of ``objstore``'s Protocol), ``records``
(the shared manifest object), ``keys`` and ``decide`` (pure), ``location``
(the ``--shared-store`` URL and the AWS environment).
"""
