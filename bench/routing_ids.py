"""The routing's own round trips: a turn's token ids with the token cache vs ``/tokenize`` whole.

Before the proxy routes a chat turn it needs the prompt's token ids, as
llama-server will make them: ``/apply-template`` renders the conversation,
then the ids come from ``/tokenize`` (the whole text), or from the token
cache (``sidecar.library.tokens.Cached``: the ids remembered up to the
previous turn's last special token, and ``/tokenize`` of the rest only).
:func:`time_routing_ids` times both side by side on one llama-server, turn by
turn over multi-turn chats, with the same HTTP client the proxy uses, and
``/apply-template`` on its own (the round trip the cache cannot save: the
server's template must render each new turn).

The chats' replies are fixed text (nothing is generated: only the two
endpoints are timed). Run alone with ``python -m bench.routing_ids
[--quick]``: the test model with Gemma 3's own chat template (its turn
markers are special tokens, as a chat model's are) and with the server's
ChatML fallback (plain-text markers in this vocabulary: nothing to cut, so
the cache's own overhead shows).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench import REPO_ROOT, rig
from bench.beds import llamabed
from sidecar.core import config
from sidecar.library import tokens
from sidecar.observe import upstream

REPLY = "The archive's next record lists a river, a stone and a market, in that order."
FOLLOW_UP = "And what does the record after it say? Answer in one sentence."


@dataclasses.dataclass(frozen=True, slots=True)
class RoutingIds:
    """Seconds per turn (turns after each chat's first), and the bytes sent to ``/tokenize``."""

    template: list[float]
    """``/apply-template`` alone."""
    whole: list[float]
    """``/tokenize`` of the whole rendered text (the routing without the cache)."""
    cached: list[float]
    """The token cache (the routing with it)."""
    text_bytes: int
    """Bytes of those turns' rendered texts."""
    asked_bytes: int
    """Bytes the cache sent to ``/tokenize`` for them."""
    prompt_tokens: int
    """Tokens of the last turn's prompt (the largest)."""

    @property
    def without(self) -> float:
        """Median routing ids time without the cache: render, then tokenize whole."""
        return rig.median(self.template) + rig.median(self.whole)

    @property
    def with_cache(self) -> float:
        return rig.median(self.template) + rig.median(self.cached)


async def _measure(url: str, *, prompt_tokens: int, chats: int, turns: int, api_key: str | None) -> RoutingIds:
    template: list[float] = []
    whole: list[float] = []
    cached_s: list[float] = []
    text_bytes = asked = last_tokens = 0
    async with aiohttp.ClientSession() as session:  # keep-alive, as the proxy's one session
        client = upstream.LlamaClient(session, config.UpstreamSettings(url=url, api_key=api_key))
        cached = tokens.Cached(client.prompts)
        for chat in range(chats):
            first = llamabed.make_prompt(url, prompt_tokens, 100 + chat, api_key)
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": "You answer in one sentence."},
                {"role": "user", "content": first},
            ]
            for turn in range(turns):
                start = time.perf_counter()
                text = await client.prompts.apply_template({"messages": messages})
                rendered = time.perf_counter()
                before = cached.asked_bytes
                order = (True, False) if turn % 2 else (False, True)  # alternate which goes first
                for use_cache in order:
                    began = time.perf_counter()
                    ids = await (cached.tokenize(text) if use_cache else client.prompts.tokenize(text))
                    took = time.perf_counter() - began
                    if use_cache:
                        got, cached_took = ids, took
                    else:
                        plain, whole_took = ids, took
                if got != plain:
                    raise rig.BenchError(f"chat {chat} turn {turn}: the token cache's ids differ from /tokenize's")
                if turn:  # the first turn of a chat has nothing to cut from
                    template.append(rendered - start)
                    whole.append(whole_took)
                    cached_s.append(cached_took)
                    text_bytes += len(text.encode())
                    asked += cached.asked_bytes - before
                last_tokens = max(last_tokens, len(plain))
                messages += [{"role": "assistant", "content": REPLY}, {"role": "user", "content": FOLLOW_UP}]
    return RoutingIds(template, whole, cached_s, text_bytes, asked, last_tokens)


def time_routing_ids(
    url: str, *, prompt_tokens: int = 4000, chats: int = 3, turns: int = 6, api_key: str | None = None
) -> RoutingIds:
    """Time a turn's token ids with the cache and without, side by side, on the llama-server at ``url``.

    ``chats`` conversations of ``turns`` turns each, the first message about
    ``prompt_tokens`` tokens; every turn's ids from the cache are checked
    equal to ``/tokenize``'s (:class:`rig.BenchError` otherwise).
    """
    return asyncio.run(_measure(url, prompt_tokens=prompt_tokens, chats=chats, turns=turns, api_key=api_key))


def table(rows: list[tuple[str, RoutingIds]]) -> str:
    ms = 1000.0
    return rig.table(
        ["template", "prompt tokens", "apply-template ms", "tokenize whole ms", "cache ms", "ids without / with",
         "bytes asked"],
        [
            (
                name,
                r.prompt_tokens,
                rig.median(r.template) * ms,
                rig.median(r.whole) * ms,
                rig.median(r.cached) * ms,
                f"{r.without * ms:.2f} / {r.with_cache * ms:.2f} ms ({r.without / r.with_cache:.2f}x)",
                f"{r.asked_bytes} of {r.text_bytes} ({r.asked_bytes / r.text_bytes:.1%})",
            )
            for name, r in rows
        ],
        digits=2,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing_ids", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer and shorter chats")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "out", help="logs go here")
    parser.add_argument("--threads", type=int, default=2, help="llama-server -t (default 2)")
    ns = parser.parse_args(argv)
    bed = rig.Rig(log_dir=ns.out / f"logs-routing-ids-{time.strftime('%Y%m%d-%H%M%S')}", threads=ns.threads)
    size, chats, turns = (2000, 2, 5) if ns.quick else (6000, 4, 8)
    try:
        before = rig.busy()
        rows = []
        for name, args in (("Gemma 3", llamabed.gemma3_template(bed.work)), ("ChatML fallback", [])):
            server = bed.server(slot_dir=bed.slot_dir("routing-ids"), n_slots=1, ctx_size=16384, extra_args=args)
            rows.append((name, time_routing_ids(server.url, prompt_tokens=size, chats=chats, turns=turns)))
        print(f"## Routing ids: token cache vs /tokenize whole\n({before} at start, {rig.busy()} at end)\n")
        print(table(rows))
    finally:
        bed.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
