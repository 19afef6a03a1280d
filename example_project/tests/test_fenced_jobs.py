"""build_report and generate_export converge under the pause and kill windows."""

import pytest

from example_project import db
from example_project.tasks import build_report, generate_export


@pytest.mark.parametrize("window", ["pause", "kill"])
def test_build_report_converges(fence_chaos, window):
    fence_chaos.inject(window, build_report.s("2026-q3"))
    fence_chaos.assert_converged("report:2026-q3")


@pytest.mark.parametrize("window", ["pause", "kill"])
def test_generate_export_converges(fence_chaos, window):
    export = db.request_export("alice@example.com", export_id="export-1")
    fence_chaos.inject(window, generate_export.s(export.id))
    fence_chaos.assert_converged(f"export:{export.id}")
