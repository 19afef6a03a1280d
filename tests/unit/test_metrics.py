"""The metrics observer: counters per transition, label vocabularies, settings; off by default."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from celery_fence import metrics
from celery_fence.actions import Action
from celery_fence.announce.transitions import emit_transition
from celery_fence.config import FenceConfig
from celery_fence.errors import ConfigurationError
from celery_fence.metrics.families import Metrics, retry_reason


@pytest.fixture
def observed() -> object:
    registry = CollectorRegistry()
    previous = metrics.active
    metrics.active = Metrics(registry)
    yield registry
    metrics.active = previous


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_every_transition_moves_its_counter(observed: CollectorRegistry) -> None:
    for action in (Action.CLAIMED, Action.COMPLETED, Action.LOST, Action.BUSY, Action.DEAD):
        emit_transition(action, "proj.t", key="k", generation=2, reason="x")
    emit_transition(Action.STALE, "proj.t", key="k", generation=1, where="block")
    emit_transition(Action.STALE, "proj.t", key="k", generation=1)  # a completion
    emit_transition(Action.RETRY_SCHEDULED, "proj.t", key="k", reason="lease lost")
    for name in ("claims", "completions", "lease_losses", "busy_resends", "dead_jobs"):
        assert value(observed, f"celery_fence_{name}_total", task="proj.t") == 1, name
    stale = "celery_fence_stale_refusals_total"
    assert value(observed, stale, task="proj.t", where="block") == 1
    assert value(observed, stale, task="proj.t", where="completion") == 1
    retries = "celery_fence_retries_total"
    assert value(observed, retries, task="proj.t", reason="lease_lost") == 1


def test_labels_never_carry_the_key(observed: CollectorRegistry) -> None:
    emit_transition(Action.CLAIMED, "proj.t", key="secret-key-123", generation=1)
    text = "\n".join(f"{s.name}{s.labels}" for family in observed.collect() for s in family.samples)
    assert "secret-key-123" not in text


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("lease lost", "lease_lost"),
        ("newer generation 3 still running", "newer_generation"),
        ("store unavailable (OperationalError)", "unavailable"),
        ("error ValueError; retry in 0.400s", "error"),
        ("completion not recorded: store unavailable (X)", "unavailable"),
        (None, "other"),
    ],
)
def test_retry_reasons_are_a_small_vocabulary(reason: str | None, expected: str) -> None:
    assert retry_reason(reason) == expected


def test_settings_decide_and_a_bad_port_is_named() -> None:
    def wanted(settings: dict[str, object]) -> bool:
        config = FenceConfig.from_mapping(settings)
        return metrics.wanted(setting=config.metrics, port=config.metrics_port)

    assert not wanted({})
    assert wanted({"fence_metrics_port": 9808})
    assert not wanted({"fence_metrics_port": 9808, "fence_metrics": False})
    with pytest.raises(ConfigurationError, match="fence_metrics_port=0 is not a TCP port"):
        FenceConfig.from_mapping({"fence_metrics_port": 0})


def test_off_by_default_no_prometheus_import_and_a_clear_error_without_it() -> None:
    # Given a process where prometheus_client cannot be imported ...
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import celery_fence, celery_fence.announce.transitions as t\n"
        "from celery_fence import metrics\n"
        "from celery_fence.actions import Action\n"
        "t.emit_transition(Action.CLAIMED, 'x', key='k')  # off: nothing observed\n"
        "assert metrics.active is None\n"
        "try:\n"
        "    metrics.wanted(setting=None, port=9808)\n"
        "except Exception as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # ... asking for metrics names the extra to install.
    assert "pip install 'celery-fence[prometheus]'" in out.stdout


def test_off_no_family_is_registered_even_with_prometheus_installed() -> None:
    # Given metrics off (the default) in a fresh process with prometheus_client importable ...
    code = (
        "import prometheus_client\n"
        "from celery_fence.actions import Action\n"
        "from celery_fence.announce.transitions import emit_transition\n"
        "for action in (Action.CLAIMED, Action.STALE, Action.COMPLETED):\n"
        "    emit_transition(action, 'proj.t', key='k', generation=1)\n"
        "names = [m.name for m in prometheus_client.REGISTRY.collect()]\n"
        "print(sorted(n for n in names if n.startswith('celery_fence')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # ... transitions register and observe nothing.
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("settings", "observing", "stamped"),
    [
        ({}, False, False),  # metrics off: the message carries no publish time
        ({"fence_metrics": False, "fence_metrics_port": 9808}, False, False),
        ({"fence_metrics_port": 9808}, False, True),  # a worker with these settings observes
        ({"CELERY_FENCE_METRICS": True}, False, True),  # any spelling of the setting
        ({}, True, True),  # metrics on in the sending process (a worker's own send)
    ],
)
def test_a_send_carries_its_publish_time_only_when_metrics_may_observe_it(
    settings: dict[str, object], observing: bool, stamped: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery import Celery
    from celery.signals import before_task_publish

    from celery_fence import FencedTask
    from celery_fence.adapters.sending import PUBLISHED_HEADER

    monkeypatch.delenv(metrics.MULTIPROC_ENV, raising=False)
    monkeypatch.setattr(metrics, "active", Metrics(CollectorRegistry()) if observing else None)
    # Given an app with these settings and a fenced task ...
    app = Celery("stamps", broker="memory://", set_as_current=False)
    app.conf.update(settings)

    @app.task(base=FencedTask, bind=True, fence_key=lambda n: f"n:{n}")
    def job(self: FencedTask, n: int) -> int:
        return n

    seen: list[dict[str, object]] = []

    def published(headers: dict[str, object], **_: object) -> None:
        seen.append(headers)

    before_task_publish.connect(published, weak=False)
    try:
        # ... when it is sent twice (the decision is read once per app),
        job.delay(1)
        job.apply_async((2,), headers={"mine": 1})
    finally:
        before_task_publish.disconnect(published)
        app.close()
    # then both messages carry the publish time exactly when a worker may observe the queue wait.
    assert [PUBLISHED_HEADER in h for h in seen] == [stamped, stamped]
    assert seen[1]["mine"] == 1
