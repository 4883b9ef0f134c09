"""A streamed generation on one slot of a real llama-server, lasting until stopped."""

from __future__ import annotations

import http.client
import json
import threading
import time

LONG_GENERATION = 6000
"""Tokens generated (ignoring end-of-text): far longer than any test's steps take."""


class Stream:
    """A streamed generation on one slot that lasts until :meth:`stop` (closing the connection cancels it)."""

    def __init__(self, port: int, slot: int, prompt: str) -> None:
        self.tokens = 0
        self.ended_at = 0.0
        self.error: Exception | None = None
        self._stop = threading.Event()
        self._args = (port, slot, prompt)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        port, slot, prompt = self._args
        body = {"prompt": prompt, "n_predict": LONG_GENERATION, "ignore_eos": True, "stream": True, "id_slot": slot}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
            for line in conn.getresponse():
                if line.startswith(b"data: "):
                    self.tokens += 1
                if self._stop.is_set():
                    break
        except OSError as exc:  # the server was killed mid-stream
            self.error = exc
        finally:
            conn.close()
            self.ended_at = time.time()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()
