"""Unit tests: each module of `sidecar` against hand-made inputs and the in-memory server `memllama`."""
