"""The soak: agent conversations through the product while a seeded schedule injects faults, alone and overlapping.

``python -m bench.soak [--minutes N] [--seed S]``. Modules, top to bottom:
:mod:`~bench.soak.runner` (the run, its clean-up) over :mod:`~bench.soak.product` (the processes: S3
server, store mount, the launcher, a cold reference llama-server), :mod:`~bench.soak.agents` (the
conversations, sent with the official SDKs), :mod:`~bench.soak.faults` (each fault's doing and undoing) and
:mod:`~bench.soak.report`; :mod:`~bench.soak.schedule` (which fault when, from the seed) and
:mod:`~bench.soak.invariants` (what each turn proves) are pure.
"""
