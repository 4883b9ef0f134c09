"""llama-kv-sidecar: keeps llama-server's slot KV cache alive across restarts."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("llama-kv-sidecar")
except metadata.PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+unknown"
