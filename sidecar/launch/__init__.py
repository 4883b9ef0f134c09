"""Launcher mode (``run [options] -- llama-server ARGS...``): the sidecar starts llama-server and supervises it.

``supervisor`` (the ``launcher`` task: start, restart with backoff, stop at
shutdown) over ``child`` (one process: its start, its end, its stop) over
``output`` (its stdout and stderr as log lines), ``argv`` (the command line,
and the arguments refused; pure) and ``restarts`` (restart or give up, after
how long; pure).
"""
