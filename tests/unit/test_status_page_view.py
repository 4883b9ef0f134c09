"""The status page's view-model and template (pure): what it prints, escaped, and that it loads nothing."""

from __future__ import annotations

import dataclasses
import re

from sidecar.app import history, page, view
from sidecar.core import events, outcomes
from sidecar.engine import report
from sidecar.restore import restorer, savings
from sidecar.snapshots import store
from tests.unit import memllama

NOW = 1_764_600_000.0
HOSTILE = '<script>alert("x")</script>&"\''


def inputs(**changes: object) -> view.Inputs:
    identity = dataclasses.replace(memllama.IDENTITY, model_path=f"/models/{HOSTILE}.gguf")
    obs = events.Observation(
        at=1.0,
        health=events.Health.OK,
        slots=(memllama.slot(0, task=7, tokens=1500), memllama.slot(1)),
        identity=identity,
    )
    done = restorer.Done(
        serial=1,
        by=outcomes.SavedBy.RESTORE,
        slot=0,
        file=f"slot0-{HOSTILE}.bin",
        tokens=1500,
        seconds=0.006,
        at=NOW - 8,
        verdict=outcomes.Verification.EFFECTIVE,
        reused_tokens=1490,
        saved_seconds=12.5,
    )
    status = report.Status(
        server_url="http://127.0.0.1:8080",
        observation=obs,
        identity=identity,
        link_ok=True,
        link_problem="",
        last_snapshot=None,
        last_restore=(),
        progress_at=0.0,
        acting=False,
        saved=savings.Totals(seconds=12.5, tokens=1490, by=(("restore", 12.5),), rate=119.2),
        recent=(done,),
        slot_since=((0, NOW - 3),),
    )
    base = view.Inputs(
        status=status,
        library=(),
        usage=store.Usage(used_bytes=25_100_000, snapshot_files=2, free_bytes=74_800_000_000),
        max_bytes=100_000_000,
        min_free_bytes=1 << 30,
        figures={"prefill_saved_seconds": 12.5, "prefill_saved_tokens": 1490, "restores_ok": 1, "restores": 2},
        samples=(history.Sample(NOW - 120, 0, 0.0, 0.0, 0.0), history.Sample(NOW - 60, 1, 12.5, 20.0, 1490.0)),
        now=NOW,
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_every_value_is_escaped() -> None:
    text = page.render(view.build(inputs()))
    assert "<script>" not in text
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in text
    assert "slot0-&lt;script&gt;" in text


def test_it_loads_nothing_and_refreshes_itself() -> None:
    text = page.render(view.build(inputs()))
    references = re.findall(r'(?:src|href|action)="([^"]*)"', text)
    assert references == ["data:,"]  # the empty icon: no request for /favicon.ico either
    assert "<script" not in text.lower().replace("&lt;script", "")
    assert f'http-equiv="refresh" content="{page.REFRESH_SECONDS}"' in text
    assert 'name="viewport"' in text
    assert "default-src 'none'" in page.CSP


def test_the_headline_is_the_time_saved_with_its_tokens_and_rate() -> None:
    built = view.build(inputs())
    saved = built.figures[0]
    assert (saved.key, saved.text, saved.value) == ("saved_seconds", "12 s", 12.5)
    assert "1,490 tokens" in saved.note
    assert "119 tokens/s" in saved.note
    (act,) = built.acts
    assert act.cells == ("8.0 s ago", "restore", "0", "1,500", "6 ms", "effective", "1,490", "12 s")
    assert act.tone == "good"
    assert built.slots[0].cells[:2] == ("0", "idle")
    assert built.slots[0].cells[3].startswith("restore of slot0-")
    assert built.slots[1].cells[1] == "empty"
    assert ("used", "25.1 MB of 100.0 MB (--max-bytes), 25%") in built.disk


def test_with_a_block_store_the_disk_says_what_its_blocks_hold_against_what_they_represent() -> None:
    usage = store.Usage(
        used_bytes=500_000_000,
        snapshot_files=6,
        free_bytes=74_800_000_000,
        unique_bytes=500_000_000,
        represented_bytes=1_750_000_000,
    )
    built = view.build(inputs(usage=usage))
    assert (
        "block store",
        "500.0 MB of blocks hold 1.8 GB of snapshots (3.5x: what conversations share is kept once)",
    ) in (built.disk)
    assert not any(key == "block store" for key, _ in view.build(inputs()).disk)  # whole files: no such row


def test_the_disk_says_where_llama_server_stages_and_what_staging_on_disk_costs() -> None:
    ram = view.build(inputs(staging=("/dev/shm/llama-kv-sidecar-0-ab", "ram", ""))).disk
    assert ("staging", "in RAM (a tmpfs): /dev/shm/llama-kv-sidecar-0-ab") in ram
    disk = view.build(inputs(staging=("/var/lib/s/slots", "disk", "/dev/shm has 64 MiB free"))).disk
    assert ("staging", "on disk: /var/lib/s/slots; /dev/shm has 64 MiB free") in disk
    assert not any(key == "staging" for key, _ in view.build(inputs()).disk)  # beside a server: no such row


def test_no_rate_yet_is_said_and_waiting_tokens_counted() -> None:
    st = inputs().status
    st = dataclasses.replace(st, saved=savings.Totals(unpriced_tokens=800))
    figure = view.build(inputs(status=st, figures={})).figures[0]
    assert figure.value == 0
    assert "no prefill rate measured yet" in figure.note
    assert "800 tokens wait" in figure.note


def test_charts_per_interval_and_a_restart_of_the_servers_counters() -> None:
    samples = (
        history.Sample(0.0, 0, 0.0, 100.0, 0.0),
        history.Sample(60.0, 1, 4.0, 110.0, 990.0),  # 990 of 1,000 tokens from the cache
        history.Sample(120.0, 1, 4.0, 30.0, 70.0),  # llama-server restarted: its counters began again
        history.Sample(180.0, 1, 4.0, None, None),
    )
    assert [p.value for p in history.restores(samples)] == [1, 0, 0]
    assert [p.value for p in history.hit_rate(samples)] == [0.99, 0.7, None]
    assert [p.value for p in history.saved(samples)] == [0.0, 4.0, 4.0, 4.0]
    ring = history.History(capacity=2)
    for s in samples:
        ring.add(s)
    assert ring.samples() == samples[2:]


def test_a_chart_without_data_says_so_and_one_with_data_draws_it() -> None:
    empty = page.chart(view.Chart("Hit", (history.Point(1.0, None),), "share", bars=True))
    assert "no data yet" in empty
    bars = page.chart(view.Chart("Restores", (history.Point(1.0, 2), history.Point(61.0, 0)), "count", bars=True))
    assert bars.count("<rect") == 2
    line = page.chart(view.Chart("Saved", (history.Point(1.0, 0.0), history.Point(61.0, 70.0)), "seconds", bars=False))
    assert "<polyline" in line
    assert "1 min 10 s" in line
