"""The scale bench's restore goal: a restore rebuilt from blocks over the same file's restore staged whole.

The wait for a restored slot against the whole-file way (its slot dir on disk) is printed beside, not judged.
"""

from __future__ import annotations

import pytest

from bench import scale, scale_restore


def _restores(rebuild: float, call: float, staged: float) -> scale_restore.Restores:
    """Five reps: the rebuild ``rebuild`` s then the call ``call`` s, against ``staged`` s, each rep a little apart."""
    jitter = [0.0, 0.004, -0.002, 0.006, -0.004]
    return scale_restore.Restores(
        tokens=2_400,
        bytes=314_572_800,
        small_pages=True,
        rebuilt_s=[rebuild + call + j for j in jitter],
        rebuild_s=[rebuild + j for j in jitter],
        rebuilt_server_s=[call - 0.01] * 5,
        staged_s=[staged - j for j in jitter],
        staged_server_s=[staged - 0.01] * 5,
    )


def _ways(restores: scale_restore.Restores, *, wait: float = 0.36) -> list[scale.Way]:
    """Both ways meeting their byte and reuse goals; the block store waits ``wait`` s, the whole files 0.33 s."""
    whole = scale.Way(scale.WHOLE, 9 * 2**29, 5 * 2**29, 4096, 0.33, 0.13, 0, [1.0, 1.0, 1.0], 4)
    blocks = scale.Way(scale.BLOCKS, 2**29, 2**29, 4096, wait, 0.11, 2, [1.0, 1.0, 1.0], 4, restores)
    return [whole, blocks]


def _restore_line(lines: list[str]) -> str:
    return next(line for line in lines if "from the block store" in line)


@pytest.mark.parametrize(
    ("rebuild", "call", "ratio", "word", "figure"),
    [
        (0.010, 0.100, 1.1, "MET ", "1.10x (110 against 100 ms, 315 MB: the rebuild 10 ms (31.46 GB/s)"),
        (
            0.150,
            0.090,
            2.4,
            "MISSED ",
            "2.40x (240 against 100 ms, 315 MB: the rebuild 150 ms (2.10 GB/s), then the call 90 ms",
        ),
    ],
    ids=["within the goal: met", "a rebuild outweighing the server's read: missed, saying where the time went"],
)
def test_a_restore_rebuilt_from_blocks_is_judged_against_the_same_file_staged_whole(
    rebuild: float, call: float, ratio: float, word: str, figure: str
) -> None:
    restores = _restores(rebuild=rebuild, call=call, staged=0.100)
    assert restores.ratio == pytest.approx(ratio)
    line = _restore_line(scale.verdicts(_ways(restores)))
    assert line.startswith(word), line
    assert figure in line


def test_the_wait_against_whole_files_on_disk_is_reported_not_judged() -> None:
    """A tmpfs of small pages makes the block store's wait 3.56x the disk's: reported beside, no miss of its own."""
    lines = scale.verdicts(_ways(_restores(rebuild=0.010, call=0.100, staged=0.100), wait=0.33 * 3.56))
    assert not [line for line in lines if line.startswith("MISSED")], lines
    report = next(line for line in lines if "the wait for a restored slot" in line)
    assert report.startswith("REPORT "), report
    assert "3.56x" in report


def test_each_pair_is_compared_and_the_ratio_is_of_the_medians() -> None:
    restores = _restores(rebuild=0.050, call=0.100, staged=0.100)
    assert restores.pairs[0] == pytest.approx(1.5)
    assert restores.rebuilt_call_s == pytest.approx([0.1] * 5)
    assert restores.ratio == pytest.approx(0.150 / 0.100)
    assert "rebuilt from blocks" in scale_restore.table(restores)
