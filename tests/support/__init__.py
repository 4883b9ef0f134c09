"""What the tests and benchmarks share: process beds, a fake llama-server, waits and readers.

`pyproject.toml` puts `tests/` on pytest's path, so every test imports these
as `from support import ...`; `bench/` puts the same folder on `sys.path`.
"""
