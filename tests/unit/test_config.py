"""Settings are read once, validated, and a bad value names the setting and the fix."""

from __future__ import annotations

import dataclasses

import pytest
from celery import Celery

from celery_fence import FencedTask
from celery_fence.config import FenceConfig
from celery_fence.errors import ConfigurationError, FenceError
from celery_fence.settings import FIELD_NAMES


def test_defaults_are_the_embedded_ones() -> None:
    config = FenceConfig.from_mapping({})
    assert config.database_url.startswith("sqlite:///")
    assert (config.lease_ttl, config.renew_interval, config.key_prefix) == (30.0, 10.0, "fence")


def test_lowercase_uppercase_and_django_namespace_forms_are_read() -> None:
    assert FenceConfig.from_mapping({"fence_lease_ttl": 12}).lease_ttl == 12.0
    assert FenceConfig.from_mapping({"FENCE_LEASE_TTL": "12"}).lease_ttl == 12.0
    assert FenceConfig.from_mapping({"CELERY_FENCE_LEASE_TTL": 12}).lease_ttl == 12.0


def test_no_silent_fallback_to_the_broker_url() -> None:
    config = FenceConfig.from_mapping({"broker_url": "redis://elsewhere:6379/3"})
    assert "elsewhere" not in config.redis_url


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({"fence_renew_interval": 30.0}, ["fence_renew_interval", "fence_lease_ttl", "third"]),
        ({"fence_lease_ttl": 0}, ["fence_lease_ttl", "positive"]),
        ({"fence_lease_ttl": "soon"}, ["fence_lease_ttl", "number"]),
        ({"fence_key_prefix": "a{b}"}, ["fence_key_prefix", "braces"]),
        ({"fence_max_attempts": 0}, ["fence_max_attempts"]),
        ({"fence_database_url": "celery.sqlite3"}, ["fence_database_url", "sqlite:///"]),
        ({"fence_redis_url": "localhost:6379"}, ["fence_redis_url", "redis://"]),
        ({"fence_permanent_exceptions": ["nodots"]}, ["fence_permanent_exceptions", "dotted"]),
        ({"fence_record_transitions": "maybe"}, ["fence_record_transitions", "True or False"]),
    ],
)
def test_bad_values_fail_early_naming_the_setting_and_the_fix(
    settings: dict[str, object], names: list[str]
) -> None:
    with pytest.raises(ConfigurationError) as err:
        FenceConfig.from_mapping(settings)
    assert isinstance(err.value, FenceError)
    for name in names:
        assert name in str(err.value)


def test_exception_types_may_be_dotted_paths() -> None:
    config = FenceConfig.from_mapping({"fence_permanent_exceptions": ["json.JSONDecodeError"]})
    import json

    assert config.permanent_exceptions == (json.JSONDecodeError,)


def test_per_task_options_override_and_are_validated() -> None:
    app = Celery("t", set_as_current=False)
    app.conf.update(fence_lease_ttl=30.0, fence_renew_interval=10.0)

    @app.task(base=FencedTask, bind=True, lease_ttl=6.0, renew_interval=2.0, shared=False)
    def quick(self: FencedTask) -> None: ...

    @app.task(base=FencedTask, bind=True, lease_ttl=6.0, shared=False)
    def broken(self: FencedTask) -> None: ...

    config = quick.fence_config()
    assert (config.lease_ttl, config.renew_interval) == (6.0, 2.0)
    with pytest.raises(ConfigurationError, match=r"broken.*fence_renew_interval"):
        broken.fence_config()


def test_database_and_generation_settings_are_validated() -> None:
    config = FenceConfig.from_mapping({"fence_database_timeout": "2.5"})
    assert config.database_timeout == 2.5
    assert config.recover_after_seconds == 3 * config.lease_ttl
    assert FenceConfig.from_mapping({"fence_recover_after": 120}).recover_after_seconds == 120
    assert config.recover_interval_seconds == config.lease_ttl / 2
    assert FenceConfig.from_mapping({"fence_recover_interval": 0}).recover_interval_seconds == 0
    with pytest.raises(ConfigurationError, match=r"fence_recover_interval=-1.*0 to turn them off"):
        FenceConfig.from_mapping({"fence_recover_interval": -1})
    for bad in (
        {"fence_database_timeout": 0},
        {"fence_generation_ttl": 5, "fence_lease_ttl": 30},
        {"fence_recover_after": 10, "fence_lease_ttl": 30},
        {"fence_max_runtime": -1},
    ):
        with pytest.raises(ConfigurationError, match=next(iter(bad))):
            FenceConfig.from_mapping(bad)
    assert FenceConfig.from_mapping({"fence_generation_ttl": 0}).generation_ttl_ms == 0


@pytest.mark.parametrize(
    ("written", "meant"),
    [
        ("CELERY_FENCE_LEASE_TIL", "CELERY_FENCE_LEASE_TTL"),
        ("CELERY_FENCE_MAX_ATTEMPT", "CELERY_FENCE_MAX_ATTEMPTS"),
        ("FENCE_RENEW_INTERVALL", "FENCE_RENEW_INTERVAL"),
        ("fence_databse_url", "fence_database_url"),
    ],
)
def test_a_misspelt_setting_is_an_error_that_names_the_real_one(written: str, meant: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        FenceConfig.from_mapping({written: 60})
    assert repr(written) in str(err.value)
    assert f"did you mean {meant!r}" in str(err.value)


def test_an_error_names_the_setting_as_the_user_wrote_it() -> None:
    with pytest.raises(ConfigurationError) as err:
        FenceConfig.from_mapping({"CELERY_FENCE_LEASE_TTL": 0})
    assert "CELERY_FENCE_LEASE_TTL" in str(err.value)
    with pytest.raises(ConfigurationError) as err:
        FenceConfig.from_mapping({"FENCE_LEASE_TTL": "soon"})
    assert "FENCE_LEASE_TTL" in str(err.value)
    with pytest.raises(ConfigurationError) as err:  # the cross-field rule, in the user's names
        FenceConfig.from_mapping({"CELERY_FENCE_LEASE_TTL": 3, "CELERY_FENCE_RENEW_INTERVAL": 5})
    assert "CELERY_FENCE_RENEW_INTERVAL" in str(err.value)
    assert "fence_renew_interval" not in str(err.value)


def test_a_misspelt_task_option_is_an_error_naming_the_task() -> None:
    app = Celery("typo", set_as_current=False)

    @app.task(base=FencedTask, bind=True, shared=False, fence_lease_til=5)
    def job(self: FencedTask) -> None: ...

    with pytest.raises(ConfigurationError) as err:
        FenceConfig.for_task(job)
    assert job.name in str(err.value)
    assert "did you mean 'fence_lease_ttl'" in str(err.value)


def test_the_retired_deferral_setting_is_accepted_ignored_and_said() -> None:
    # fence_defer_first_registration no longer earns its place (one durable commit a task is
    # the default): an existing configuration keeps working and is told to drop it
    with pytest.warns(FutureWarning, match="fence_defer_first_registration is retired"):
        config = FenceConfig.from_mapping({"fence_defer_first_registration": True})
    assert config.generation_ttl_ms == 600_000  # no longer forced to counters that never expire


def test_the_renew_interval_follows_the_lease_ttl_unless_it_is_set() -> None:
    # A TTL alone brings its renew interval (a third), in any spelling ...
    for name in ("fence_lease_ttl", "FENCE_LEASE_TTL", "CELERY_FENCE_LEASE_TTL"):
        assert FenceConfig.from_mapping({name: 6}).renew_interval == 2.0
    # ... and a task's own TTL too, when the app set no interval;
    app = Celery("t", set_as_current=False)
    app.conf.update(fence_lease_ttl=9.0)

    @app.task(base=FencedTask, bind=True, lease_ttl=1.5, shared=False)
    def quick(self: FencedTask) -> None: ...

    assert FenceConfig.from_app(app).renew_interval == 3.0
    assert (quick.fence_config().lease_ttl, quick.fence_config().renew_interval) == (1.5, 0.5)
    # an interval that is set is kept, and one that does not fit is named as it was written.
    assert (
        FenceConfig.from_mapping({"fence_lease_ttl": 6, "fence_renew_interval": 1}).renew_interval
        == 1
    )
    with pytest.raises(ConfigurationError) as bad:
        FenceConfig.from_mapping(
            {
                "CELERY_FENCE_LEASE_TTL": 3,
                "CELERY_FENCE_LEASE_MARGIN": 0.4,
                "CELERY_FENCE_RENEW_INTERVAL": 2,
            }
        )
    assert "CELERY_FENCE_RENEW_INTERVAL=2.0" in str(bad.value)
    assert "CELERY_FENCE_LEASE_TTL x (1 - CELERY_FENCE_LEASE_MARGIN)" in str(bad.value)
    with pytest.raises(ConfigurationError, match=r"^FENCE_RENEW_INTERVAL=.*FENCE_LEASE_MARGIN"):
        FenceConfig.from_mapping({"FENCE_RENEW_INTERVAL": 40})  # the margin left at its default


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({"fence_outbox_max_attempts": 0}, ["fence_outbox_max_attempts", "at least 1", "20"]),
        ({"fence_outbox_max_attempts": "many"}, ["fence_outbox_max_attempts", "whole number"]),
        ({"fence_outbox_backoff": 0}, ["fence_outbox_backoff", "positive", "10"]),
        ({"fence_outbox_backoff": "slow"}, ["fence_outbox_backoff", "number"]),
        (
            {"fence_outbox_backoff": 60, "fence_outbox_backoff_max": 30},
            ["fence_outbox_backoff_max=30", "at least fence_outbox_backoff=60", "3600"],
        ),
        ({"CELERY_FENCE_OUTBOX_BACKOFF": -1}, ["CELERY_FENCE_OUTBOX_BACKOFF", "positive"]),
    ],
)
def test_outbox_retry_settings_are_validated(settings: dict[str, object], names: list[str]) -> None:
    with pytest.raises(ConfigurationError) as err:
        FenceConfig.from_mapping(settings)
    for name in names:
        assert name in str(err.value)


def test_the_outbox_retries_for_hours_by_default() -> None:
    from celery_fence.ops.outbox_backoff import dead_after, retry_ceiling

    config = FenceConfig.from_mapping({})
    assert (config.outbox_max_attempts, config.outbox_backoff, config.outbox_backoff_max) == (
        20,
        10.0,
        3600.0,
    )
    # the ceilings double from 10 s up to the one-hour cap; the whole run is hours, not seconds
    assert [retry_ceiling(n, config) for n in (1, 2, 3, 9, 10, 19)] == [
        10.0,
        20.0,
        40.0,
        2560.0,
        3600.0,
        3600.0,
    ]
    low, high = dead_after(config)
    assert (round(low), round(high)) == (20555, 41110)  # about 5.7 and 11.4 hours
    small = FenceConfig.from_mapping(
        {"fence_outbox_max_attempts": 3, "fence_outbox_backoff": 1, "fence_outbox_backoff_max": 1.5}
    )
    assert dead_after(small) == (1.25, 2.5)


def test_the_settings_table_names_every_field_of_the_config_and_no_other() -> None:
    # (a field without a row in celery_fence.settings could not be set; a row without a field
    # would be accepted and dropped)
    fields = {f.name for f in dataclasses.fields(FenceConfig) if not f.name.startswith("_")}
    assert fields == set(FIELD_NAMES)
