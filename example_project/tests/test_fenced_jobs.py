"""build_report and generate_export converge under the windows, and the app's own rows agree."""

import pytest

from example_project import db
from example_project.tasks import build_report, generate_export


def report_row_is_the_completing_attempts(record):
    """The report row (written in build_report's fence.transaction()) is the stored attempt's."""
    row = db.get_report("2026-q3")
    assert row is not None, "no report row"
    assert (row["generation"], row["attempt_id"]) == (record.generation, record.attempt_id), row
    return True


@pytest.mark.parametrize("window", ["pause", "pause-inside-block", "kill"])
def test_build_report_converges(fence_chaos, window):
    fence_chaos.inject(window, build_report.s("2026-q3"))
    fence_chaos.assert_converged("report:2026-q3", check=report_row_is_the_completing_attempts)


@pytest.mark.parametrize("window", ["pause", "kill"])
def test_generate_export_converges(fence_chaos, window):
    export = db.request_export("alice@example.com", export_id="export-1")
    fence_chaos.inject(window, generate_export.s(export.id))

    def export_request_unchanged(record):
        assert record.result["input_version"] == export.input_version
        return db.get_export(export.id) == export

    fence_chaos.assert_converged(f"export:{export.id}", check=export_request_unchanged)
