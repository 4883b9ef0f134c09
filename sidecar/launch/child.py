"""One llama-server process the launcher started: its start, its output, its end, and how it is stopped.

The child runs in a session of its own, so a Ctrl-C in the terminal (SIGINT
to the foreground process group) reaches the sidecar only: the sidecar saves
the slots first, then stops the server. On Linux the child also gets SIGKILL
when the sidecar dies (``PR_SET_PDEATHSIG``), so a sidecar killed with
``kill -9`` leaves no server behind holding the port and the memory.

How a process ended is read from its exit status alone (:func:`ended`, pure):
a status, or the signal that killed it, never a guess from polls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import dataclasses
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from sidecar.core import outcomes, tasks
from sidecar.launch import output

_PR_SET_PDEATHSIG = 1
TAIL_LINES = 8
"""The child's last stderr lines kept, to quote when it could not start."""


@dataclasses.dataclass(frozen=True, slots=True)
class Exit:
    """How one run of the child ended."""

    cause: outcomes.ServerExit
    code: int | None = None
    """Its exit status, when it exited."""
    signal: str | None = None
    """The signal that ended it (``SIGKILL``), when one did."""
    error: str = ""
    """Why it could not be started (``not_started``)."""

    def describe(self) -> str:
        if self.signal is not None:
            return f"killed by {self.signal}"
        if self.code is not None:
            return f"exit status {self.code}"
        return f"could not be started: {self.error}"


def ended(returncode: int, *, asked: bool) -> Exit:
    """The end of a process from its ``returncode`` (negative: the signal); ``asked``: the sidecar stopped it."""
    sig = _signal_name(-returncode) if returncode < 0 else None
    code = returncode if returncode >= 0 else None
    if asked:
        cause = outcomes.ServerExit.STOPPED
    elif sig is not None:
        cause = outcomes.ServerExit.KILLED
    elif returncode == 0:
        cause = outcomes.ServerExit.EXITED
    else:
        cause = outcomes.ServerExit.FAILED
    return Exit(cause, code=code, signal=sig)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the sidecar's thread that started it ends (Linux only)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Child:
    """A started llama-server: :meth:`wait` for its end, :meth:`stop` it, or :meth:`kill` it at once."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        relays: tuple[asyncio.Task[None], ...],
        tail: collections.deque[str] | None = None,
    ) -> None:
        self._process = process
        self._relays = relays
        self.tail: collections.deque[str] = tail if tail is not None else collections.deque(maxlen=TAIL_LINES)
        """Its last non-empty stderr lines (read them once :meth:`wait` returned: its output is read then)."""
        self.asked = False
        """The sidecar asked it to stop (its end is then ``stopped``)."""

    @classmethod
    async def start(cls, argv: Sequence[str], *, env: Mapping[str, str] | None = None) -> Child:
        """Start ``argv``, its output relayed to the log; raises ``OSError`` when it cannot be run.

        ``env``: variables set over the sidecar's own environment (Vertex AI mode's private port)."""
        process = await asyncio.create_subprocess_exec(
            *argv,
            env={**os.environ, **env} if env else None,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        relays = []
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        for name, stream in (("stdout", process.stdout), ("stderr", process.stderr)):
            assert stream is not None  # both are pipes
            kept = tail if name == "stderr" else None
            relays.append(
                tasks.watch(
                    asyncio.create_task(
                        output.relay(stream, name=name, pid=process.pid, tail=kept), name=f"server-{name}"
                    ),
                    effect=f"llama-server's {name} is no longer copied to the log",
                )
            )
        return cls(process, tuple(relays), tail)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process.returncode is None

    async def wait(self) -> Exit:
        """Its end, once it has ended and its output is read to the end (at most a second after).

        Processes it left behind in its process group are killed: they would hold the port and its pipes.
        """
        returncode = await self._process.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signal.SIGKILL)  # what it left behind in its group (a router's servers)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):  # a grandchild holding the pipes open must not hold this up
                await asyncio.gather(*self._relays, return_exceptions=True)
        return ended(returncode, asked=self.asked)

    async def stop(self, timeout: float) -> Exit:
        """SIGTERM, and SIGKILL to its whole process group if it has not ended ``timeout`` seconds later."""
        self.asked = True
        if self.running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._process.pid, signal.SIGTERM)  # not send_signal: its poll may reap the child (see kill)
            try:
                async with asyncio.timeout(timeout):
                    await self._process.wait()
            except TimeoutError:
                self.kill()
        return await self.wait()

    def kill(self) -> None:
        """SIGKILL to its process group (a router's model servers too), now; nothing if it has ended."""
        if not self.running:
            return
        try:  # the child leads its group (a session of its own): this kills it too
            os.killpg(self._process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            # Only where the group could not be signalled: not Popen.kill, whose poll may reap the child before
            # asyncio's own wait (asyncio then reports exit status 255, not the SIGKILL).
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._process.pid, signal.SIGKILL)
