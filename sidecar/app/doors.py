"""What takes requests from outside besides the HTTP endpoints: the proxy (``--proxy-listen``) and the
agent-check port (``--agent-check-listen``), started once the watch is wired and closed before the final
snapshots.

Invariants and trade-offs: docs/modules.md, `sidecar/app/run.py`.
"""

from __future__ import annotations

import asyncio
import functools

import structlog

from sidecar.app import agentcheck, parts
from sidecar.core import config, errors, metrics, rates
from sidecar.proxy import listener, relay, sentinel

log = structlog.get_logger("sidecar.app")


async def start_agent(settings: config.ServerSettings, engines: agentcheck.Known) -> agentcheck.Handle | None:
    """The agent-check port (--agent-check-listen), if asked for."""
    if settings.agent_host is None:
        return None
    try:
        agent = await agentcheck.start(engines, host=settings.agent_host, port=settings.agent_port)
    except OSError as exc:
        raise errors.ConfigError(
            f"--agent-check-listen {settings.agent_host}:{settings.agent_port}: cannot listen there "
            f"({exc.strerror or exc})"
        ) from exc
    log.info("agent_check_listening", host=agent.host, port=agent.port)
    return agent


async def start_proxy(
    settings: config.Settings, wired: parts.Parts, stats: metrics.Metrics, ledger: rates.Ledger
) -> listener.Listener | None:
    """The reverse proxy (--proxy-listen), if asked for: the relay in front of the mode's restore gate(s)."""
    if settings.proxy.host is None:
        return None
    restore_gate = wired.restore_gate
    client = listener.client(settings.upstream)
    handler = relay.Relay(
        client=client,
        restore_gate=restore_gate,
        stats=stats,
        upstream=settings.upstream,
        settings=settings.proxy,
        admin_token=settings.server.admin_token,
        rates=None if settings.upstream.router else ledger,
        pinner=wired.library,
        admit=wired.admit,
        on_leave=functools.partial(wired.quiet, relay.QUIET_SECONDS) if wired.quiet is not None else None,
    )
    try:
        sentry = (
            None  # router mode: each model's engine has its own gate
            if settings.upstream.router
            else sentinel.Sentinel(
                settings.upstream.url, restore_gate, connect_timeout=settings.upstream.connect_timeout
            )
        )
        proxy = await listener.start(handler, client, settings.proxy, stats, sentry=sentry)
    except OSError as exc:
        await client.close()
        raise errors.ConfigError(
            f"--proxy-listen {settings.proxy.host}:{settings.proxy.port}: cannot listen there ({exc.strerror or exc})"
        ) from exc
    except BaseException:
        await client.close()
        raise
    log.info(
        "proxy_listening",
        host=proxy.host,
        port=proxy.port,
        server=settings.upstream.url,
        hold_seconds=settings.proxy.hold_seconds,
    )
    return proxy


class Closing:
    """Closes the doors once: on the stop flag while the watch still runs, or after the task group ended
    otherwise (a crash); a close a cancellation cut short goes on, and the second call waits for it."""

    def __init__(self, wired: parts.Parts, agent: agentcheck.Handle | None, proxy: listener.Listener | None) -> None:
        self._doors = (wired, agent, proxy)
        self._task: asyncio.Task[None] | None = None

    async def close(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(close(*self._doors), name="doors-close")
        await asyncio.shield(self._task)


async def close(wired: parts.Parts, agent: agentcheck.Handle | None, proxy: listener.Listener | None) -> None:
    """Close what takes requests from outside, before the final snapshots."""
    if agent is not None:
        await agent.close()  # the balancer sees the node go (its health check) and stops sending to it
    if proxy is not None:
        await proxy.close()  # no new requests may change the slots during the final snapshots
    if wired.slots_reader is not None:
        await wired.slots_reader.close()
