"""Restoring: snapshots put back into the slots after a restart, and the verdict on each.

``plan`` (pure) says which snapshot goes into which slot; ``restorer`` is the face the engine
calls, over the round (``rounds``), one restore call (``send``) and its verdict (``verify``).
Nothing here saves.
"""
