"""report.Liveness: how long the poll loop may go without finishing a poll, fed hand-made statuses."""

from __future__ import annotations

from pathlib import Path

from sidecar.core import config, events
from sidecar.engine import report

SETTINGS = config.Settings(
    upstream=config.UpstreamSettings(request_timeout=5.0, action_timeout=300.0),
    poll=config.PollSettings(interval=1.0, down_interval=0.25),
    snapshots=config.SnapshotSettings(slot_dir=Path("slots")),
    server=config.ServerSettings(),
)


def _status(*, progress_at: float, acting: bool, slots: int = 0) -> report.Status:
    views = tuple(events.SlotView(i, 4096, processing=False, task=None, tokens=0) for i in range(slots))
    return report.Status(
        server_url="http://llama:8080",
        observation=events.Observation(at=progress_at, health=events.Health.OK, slots=views),
        identity=None,
        link_ok=None,
        link_problem="",
        last_snapshot=None,
        last_restore=(),
        progress_at=progress_at,
        acting=acting,
    )


def test_bounds_follow_the_settings() -> None:
    live = report.Liveness.of(SETTINGS)
    assert live.poll_seconds == 5 * 1.0 + 8 * 5.0
    assert live.action_seconds == 300.0 + 5.0
    assert live.bound(_status(progress_at=0, acting=False, slots=4)) == 45.0
    # A restore round may act on each slot in turn.
    assert live.bound(_status(progress_at=0, acting=True, slots=4)) == 45.0 + 4 * 305.0
    assert live.bound(_status(progress_at=0, acting=True, slots=0)) == 45.0 + 305.0


def test_a_loop_is_stuck_only_past_its_bound() -> None:
    live = report.Liveness.of(SETTINGS)
    idle = _status(progress_at=100.0, acting=False, slots=2)
    assert live.stall(idle, now=145.0) is None
    problem = live.stall(idle, now=146.0)
    assert problem is not None
    assert "46 s" in problem
    assert "45 s" in problem
    assert "restart the sidecar" in problem
    acting = _status(progress_at=100.0, acting=True, slots=2)
    assert live.stall(acting, now=146.0) is None  # a long save is progress, not a stall
    late = live.stall(acting, now=100.0 + 45.0 + 2 * 305.0 + 1)
    assert late is not None
    assert "slot action" in late
