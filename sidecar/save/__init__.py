"""Saving: when a slot is due for a save, and the save carried out, committed and kept within retention.

``policy`` (pure) says when a slot is due and what to delete; ``snapshotter`` saves (the disk's
room, the server's save, the store's commit). Nothing here restores.
"""
