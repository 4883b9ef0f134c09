"""The placer's cached tokenizer: remembered cuts, only the new part asked, nothing trusted unproven."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from typing import Any

from prometheus_client import CollectorRegistry

from sidecar.core import apikeys, events, metrics
from sidecar.library import prefixes, tokens

SPECIAL = {"<start_of_turn>": 2, "<end_of_turn>": 3}
_SPLIT = re.compile("(<start_of_turn>|<end_of_turn>)")


class Server:
    """Tokenizes like llama-server: BOS, special tokens split out, the text between them by words."""

    def __init__(self, bos: bool = True) -> None:
        self.asked: list[str] = []
        """Texts asked with their pieces."""
        self.plain: list[str] = []
        """Texts asked for their ids alone."""
        self.bos = bos

    async def apply_template(self, body: dict[str, Any]) -> str:
        return render(body)

    async def pieces(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[tuple[int, bytes]]:
        self.asked.append(text)
        return split(text, add_special=add_special and self.bos, parse_special=parse_special)

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        self.plain.append(text)
        return [i for i, _ in split(text, add_special=add_special and self.bos, parse_special=True)]


def render(body: dict[str, Any]) -> str:
    return "".join(f"<start_of_turn>{m['role']}\n{m['content']}<end_of_turn>\n" for m in body["messages"])


def split(text: str, *, add_special: bool, parse_special: bool) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = [(1, b"<bos>")] if add_special else []
    for part in _SPLIT.split(text) if parse_special else [text]:
        if part in SPECIAL and parse_special:
            out.append((SPECIAL[part], part.encode()))
            continue
        for word in re.findall(r"\s*\S+|\s+", part):  # a word joins the spaces before it
            out.append((100 + sum(word.encode()) % 5000, word.encode()))
    return out


def _whole(text: str) -> list[int]:
    return [i for i, _ in split(text, add_special=True, parse_special=True)]


def _chat(turns: int) -> str:
    body = {"messages": [{"role": "user", "content": f"question {n} " * 50} for n in range(turns)]}
    return render(body) + "<start_of_turn>model\n"


def test_a_later_turn_asks_only_what_follows_the_last_marker() -> None:
    server = Server()
    cached = tokens.Cached(server)

    async def run() -> None:
        first, second = _chat(3), _chat(4)
        assert await cached.tokenize(first) == _whole(first)
        server.asked.clear()
        assert await cached.tokenize(second) == _whole(second)
        tail = second[len(first) - len("<start_of_turn>model\n") :]
        assert server.asked == [tail]  # from the cut before the first text's last marker
        server.asked.clear()
        assert await cached.tokenize(second) == _whole(second)
        assert server.asked == []  # known whole: no round trip

    asyncio.run(run())
    assert cached.answered == 1


def test_what_one_owners_texts_taught_is_never_used_for_another_owner() -> None:
    """With API keys, a text another key sent must not be answered faster (no round trip, or a shorter one):
    the time would tell a client what another's prompt starts with."""
    server = Server()
    cached = tokens.Cached(server)
    alice, bob = apikeys.owner_of(key="sk-alice"), apikeys.owner_of(key="sk-bob")

    async def run() -> None:
        first, second = _chat(3), _chat(4)
        assert await cached.tokenize(first, owner=alice) == _whole(first)
        server.asked.clear()
        assert await cached.tokenize(first, owner=bob) == _whole(first)
        assert server.asked == [first]  # asked whole, as if never seen
        server.asked.clear()
        assert await cached.tokenize(second, owner=alice) == _whole(second)
        assert server.asked == [second[len(first) - len("<start_of_turn>model\n") :]]  # alice's own cut serves her

    asyncio.run(run())


def test_marker_looking_text_is_not_trusted_as_a_cut() -> None:
    server = Server()
    cached = tokens.Cached(server)
    text = "<start_of_turn>user\nsee <b> here <b>"

    async def run() -> None:
        assert await cached.tokenize(text) == _whole(text)
        server.asked.clear()
        longer = text + "bold</b> done"
        assert await cached.tokenize(longer) == _whole(longer)
        assert server.asked[0] == longer  # the first text known whole is no cut for a longer one

    asyncio.run(run())
    assert not [k for k, v in cached._special.items() if v is not None and k != b"<start_of_turn>"]


def test_pieces_that_do_not_spell_the_text_are_not_remembered() -> None:
    class Odd(Server):
        async def pieces(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[tuple[int, bytes]]:
            got = await super().pieces(text, add_special=add_special, parse_special=parse_special)
            return [(i, p.upper()) for i, p in got]  # pieces not the text's own bytes

    server = Odd()
    cached = tokens.Cached(server)
    text = _chat(2)
    asyncio.run(cached.tokenize(text))
    asyncio.run(cached.tokenize(text))
    assert server.asked == [text, text]  # every time whole: nothing could be trusted


def test_a_cut_serves_only_a_text_that_goes_on_with_its_special_token() -> None:
    server = Server()
    cached = tokens.Cached(server)
    head = "<start_of_turn>user\n" + "about the" * 30

    async def run() -> None:
        first = head + "<start_of_turn>model\n"
        assert await cached.tokenize(first) == _whole(first)
        server.asked.clear()
        other = head + "ory and more words"  # the same bytes up to the cut, then no special token
        assert await cached.tokenize(other) == _whole(other)
        assert server.asked == [other]  # asked whole: the joined ids would split "theory"

    asyncio.run(run())
    assert cached.refused == 0  # turned down before any round trip, from the bytes


def test_a_cut_the_server_tokenizes_otherwise_is_refused_and_asked_whole() -> None:
    class Longer(Server):
        """``<start_of_turn>model`` is a special token of its own: the cut's bytes match, its id does not."""

        async def pieces(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[tuple[int, bytes]]:
            self.asked.append(text)
            marker = "<start_of_turn>model"
            if parse_special and marker in text:
                before, _, after = text.partition(marker)
                out = split(before, add_special=add_special, parse_special=True)
                return [*out, (9, marker.encode()), *split(after, add_special=False, parse_special=True)]
            return split(text, add_special=add_special, parse_special=parse_special)

    server = Longer()
    cached = tokens.Cached(server)
    first = "<start_of_turn>user\nhello there<start_of_turn>user\n"

    async def run() -> list[int]:
        await cached.tokenize(first)
        server.asked.clear()
        return await cached.tokenize(first[: -len("user\n")] + "model\nhi")

    got = asyncio.run(run())
    second = first[: -len("user\n")] + "model\nhi"
    assert got == [i for i, _ in asyncio.run(Longer().pieces(second, add_special=True))]
    assert cached.refused == 1
    assert server.asked == [second[len("<start_of_turn>user\nhello there") :], second]  # the rest, then whole


def test_a_restart_forgets_every_id() -> None:
    server = Server()
    cached = tokens.Cached(server)
    text = _chat(2)
    asyncio.run(cached.tokenize(text))
    cached.emptied()
    server.asked.clear()
    asyncio.run(cached.tokenize(text))
    assert server.asked[0] == text  # asked whole again: the new process may tokenize otherwise


IDENTITY = events.Identity("b1-abc", "/m/model.gguf", 4, 8192, weights="xxh3-128:00ff")


def _restarted(now: events.Identity | None) -> list[str]:
    """What a text learned under IDENTITY asks of the server once the server restarted as ``now``."""
    server = Server()
    seen: list[events.Identity | None] = [IDENTITY]
    cached = tokens.Cached(server, vocabulary=lambda: seen[0])
    text = _chat(2)
    asyncio.run(cached.tokenize(text))
    cached.emptied()
    seen[0] = now
    server.asked.clear()
    asyncio.run(cached.tokenize(text))
    return server.asked


def test_a_restart_of_the_same_model_and_build_keeps_the_ids() -> None:
    restarted = dataclasses.replace(IDENTITY, n_ctx=4096, total_slots=2)  # other flags: the same vocabulary
    assert _restarted(restarted) == []  # answered from memory


def test_a_restart_onto_another_model_or_build_or_an_unread_one_forgets_the_ids() -> None:
    text = _chat(2)
    for now in (
        dataclasses.replace(IDENTITY, weights="xxh3-128:1234"),
        dataclasses.replace(IDENTITY, build_info="b2-def"),
        dataclasses.replace(IDENTITY, weights=None),  # the model file unreadable: cannot be sure
        None,  # the server's identity not read yet
    ):
        assert _restarted(now)[:1] == [text], now  # asked whole


def test_prefixes_are_bounded_by_ids_and_forget_the_oldest() -> None:
    known = prefixes.Prefixes(max_ids=10)
    known.remember(b"aaaa<s>", 4, [1, 2, 3, 4], token=2, piece=b"<s>")
    known.remember(b"bbbb<s>", 4, [5, 6, 7, 8], token=2, piece=b"<s>")
    known.remember(b"cccc<s>", 4, [9, 10, 11], token=2, piece=b"<s>")
    assert known.held_ids <= 10
    assert known.longest(b"aaaa<s>") is None  # the oldest went first
    hit = known.longest(b"cccc<s> and more")
    assert hit is not None
    assert (hit.cut, hit.ids.tolist(), hit.token) == (4, [9, 10, 11], 2)


def test_the_longest_remembered_cut_wins() -> None:
    known = prefixes.Prefixes()
    known.remember(b"ab<cdef", 2, [1], token=5, piece=b"<")
    known.remember(b"abcd<ef", 4, [1, 2], token=5, piece=b"<")
    known.remember(b"xyz", 3, [7])
    known.remember(b"abcd<", 5, [1, 2, 3])
    assert known.longest(b"abcd<X").cut == 4  # type: ignore[union-attr]  # a whole text is no cut
    assert known.longest(b"abcd<").cut == 5  # type: ignore[union-attr]
    hit = known.longest(b"abcd<X")
    assert hit is not None
    assert (hit.cut, hit.ids.tolist()) == (4, [1, 2])
    assert known.longest(b"abcdX") is None  # the cut at 4 needs "<" next; the one at 2 too
    short = known.longest(b"ab<Xdef")
    assert short is not None
    assert short.cut == 2
    assert known.longest(b"a") is None


def test_bytes_are_counted_asked_or_remembered() -> None:
    registry = CollectorRegistry()
    cached = tokens.Cached(Server(), stats=metrics.Metrics(registry, version="test"))
    first, second = _chat(3), _chat(4)

    def sample(source: str) -> float | None:
        return registry.get_sample_value("llama_sidecar_library_prompt_bytes_total", {"source": source})

    assert (sample("asked"), sample("remembered")) == (0.0, 0.0)  # pre-initialised

    async def run() -> None:
        await cached.tokenize(first)
        await cached.tokenize(second)
        await cached.tokenize(second)

    asyncio.run(run())
    asked = len(first.encode()) + len(second.encode()) - len(first.encode()) + len("<start_of_turn>model\n")
    assert sample("asked") == asked == cached.asked_bytes
    assert sample("remembered") == cached.text_bytes - asked


def test_plain_text_markers_are_asked_for_their_ids_alone_once_known() -> None:
    server = Server()
    cached = tokens.Cached(server)

    def chatml(turns: int) -> str:
        return "".join(f"<|im_start|>user\nquestion {n} <b>x</b><|im_end|>\n" for n in range(turns)) + "<|im_start|>"

    async def run() -> None:
        first, second = chatml(2), chatml(3)
        assert await cached.tokenize(first) == _whole(first)
        assert server.asked[0] == first  # with pieces: its markers were unknown
        assert not server.plain
        server.asked.clear()
        assert await cached.tokenize(second) == _whole(second)
        assert server.plain == [second]  # known plain text: ids alone, no pieces
        assert server.asked == []
        server.plain.clear()
        with_marker = second + "<start_of_turn>model\n"
        assert await cached.tokenize(with_marker) == _whole(with_marker)
        assert server.asked[0] == with_marker  # a marker not known yet: with pieces
        assert not server.plain

    asyncio.run(run())
