"""What the tests and benchmarks share: process beds, a fake llama-server, waits, readers and the fake clock.

Imported as `tests.support` from the repository's root, by the tests and by `bench/` alike.
"""
