"""The order of a stop: the doors close while the watch still runs, once, then the task group stops."""

from __future__ import annotations

import asyncio

import pytest

from sidecar.app import doors, parts, run


async def test_on_the_stop_flag_the_doors_close_while_the_watch_still_runs_then_the_group_stops() -> None:
    stop = asyncio.Event()
    seen: list[str] = []
    watching = asyncio.Event()

    async def watch() -> None:
        watching.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append("watch cancelled")
            raise

    async def close_doors() -> None:
        await asyncio.sleep(0.01)  # a close takes a while: in-flight requests end meanwhile
        seen.append("doors closed")

    async def lifecycle() -> None:
        async with asyncio.TaskGroup() as group:
            group.create_task(watch())
            group.create_task(run._stopper(stop, close_doors))
            await watching.wait()
            stop.set()

    with pytest.raises(ExceptionGroup) as ended:
        await lifecycle()
    assert ended.group_contains(run.Terminate)
    assert seen == ["doors closed", "watch cancelled"]


class _Proxy:
    def __init__(self) -> None:
        self.closes = 0
        self.release = asyncio.Event()

    async def close(self) -> None:
        self.closes += 1
        await self.release.wait()


async def test_the_doors_close_once_and_a_close_cut_short_by_a_cancellation_goes_on_for_the_next_caller() -> None:
    proxy = _Proxy()
    wired = parts.Parts(engines=None, loops={}, restore_gate=None)  # type: ignore[arg-type]
    closing = doors.Closing(wired, None, proxy)  # type: ignore[arg-type]
    first = asyncio.create_task(closing.close())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    first.cancel()  # the stopper, cancelled by a crash of another task of the group
    with pytest.raises(asyncio.CancelledError):
        await first
    second = asyncio.create_task(closing.close())  # the lifecycle's own, after the group
    await asyncio.sleep(0)
    assert not second.done()
    proxy.release.set()
    await second
    assert proxy.closes == 1
