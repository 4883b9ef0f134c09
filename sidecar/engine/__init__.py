"""The engine's core: what each observation of a watched llama-server means, and when to save and restore.

``lifecycle`` (pure) says where the server is in its life and when a restore round is owed;
``gate`` holds requests while it is; ``consumer`` reads each poll, ``runner`` runs the restore
round and the due saves (``saves``), one at a time. How a restore or a save is carried out is
:mod:`sidecar.restore`'s and :mod:`sidecar.save`'s.
"""
