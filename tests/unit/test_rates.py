"""llama-server's rate gauges as a scraper through the proxy reads them, whatever the sidecar read between."""

from __future__ import annotations

import pytest

from sidecar.core import rates

P, PS = "llamacpp:prompt_tokens_seconds", "llamacpp:prompt_seconds_total"
G, GS = "llamacpp:predicted_tokens_seconds", "llamacpp:tokens_predicted_seconds_total"


def _read(prompt_rate: float, prompt_seconds: float, gen_rate: float, gen_seconds: float) -> dict[str, float]:
    return {P: prompt_rate, PS: prompt_seconds, G: gen_rate, GS: gen_seconds}


def test_the_sidecars_reads_between_two_scrapes_are_summed_back() -> None:
    ledger = rates.Ledger()
    # llama-server's windows: 100 steps in 2 s (the sidecar's read), then 300 steps in 1 s (the next one)
    ledger.read("1", _read(50.0, 2.0, 10.0, 1.0))
    ledger.read("1", _read(300.0, 3.0, 0.0, 1.0))
    seen = ledger.scrape("1", _read(0.0, 3.0, 20.0, 2.0))  # nothing new prefilled; 20 steps in 1 s generated
    assert seen[P] == pytest.approx(400 / 3)
    assert seen[G] == pytest.approx((10 + 20) / 2)
    assert ledger.scrape("1", _read(0.0, 3.0, 0.0, 2.0)) == {P: 0.0, G: 0.0}, "no work since: 0, as llama-server says"


def test_a_new_process_starts_afresh_and_a_late_answer_is_ignored() -> None:
    ledger = rates.Ledger()
    ledger.read("1", _read(50.0, 2.0, 10.0, 1.0))
    ledger.read("2", _read(40.0, 1.0, 0.0, 0.0))  # a restart: its window since its own start
    ledger.read("2", _read(99.0, 0.5, 0.0, 0.0))  # an older read that answered late: counters behind
    assert ledger.scrape("2", _read(0.0, 1.0, 0.0, 0.0)) == {P: 40.0, G: 0.0}


def test_the_answer_text_gets_the_gauges_printed_as_llama_server_prints_them() -> None:
    text = (
        b"# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s\n"
        b"# TYPE llamacpp:prompt_tokens_seconds gauge\nllamacpp:prompt_tokens_seconds 0\n"
        b"llamacpp:prompt_seconds_total 3\nllamacpp:predicted_tokens_seconds 0\n"
        b"llamacpp:tokens_predicted_seconds_total 2\nllamacpp:requests_processing 0\n"
    )
    ledger = rates.Ledger()
    ledger.read("1", _read(133.0, 3.0, 7.0, 2.0))
    out = rates.for_client(ledger, "1", text)
    assert b"llamacpp:prompt_tokens_seconds 133\n" in out
    assert b"llamacpp:predicted_tokens_seconds 7\n" in out
    assert out.replace(b"seconds 133\n", b"seconds 0\n").replace(b"seconds 7\n", b"seconds 0\n") == text
    assert rates.for_client(rates.Ledger(), None, b"other text\n") == b"other text\n"
