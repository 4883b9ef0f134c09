"""Faults the real llama-server cannot produce on demand, against fakes and real processes."""
