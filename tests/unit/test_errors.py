"""Every celery-fence error says something without a message, docstrings stripped or not."""

from __future__ import annotations

import subprocess
import sys

import pytest

from celery_fence import errors

ERRORS = [
    cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.FenceError)
]


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: cls.__name__)
def test_an_error_raised_without_a_message_has_its_own(cls: type[errors.FenceError]) -> None:
    message = str(cls())
    assert message == cls.default and message
    if cls is not errors.FenceError:  # each says what happened, not its parent's words
        assert cls.default != cls.__mro__[1].default  # type: ignore[attr-defined]


def test_the_default_messages_survive_python_oo() -> None:
    # Given Python run with -OO (docstrings stripped), an error raised without a message says
    # what happened; a message from the class docstring would be empty (or fail).
    out = subprocess.run(
        [
            sys.executable,
            "-OO",
            "-c",
            "from celery_fence.errors import LeaseLost; print(LeaseLost())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.strip() == "the lease was lost: this attempt must not start new side effects"
