"""A test that changes os.environ itself does not hand the change to the next test on its worker
(tests/conftest.py restores it): the launcher sets an operator key that way, and a stack started
by a later test inherited it."""

from __future__ import annotations

import os

PROBE = "SLINFER_TEST_ENV_PROBE"


def test_code_under_test_sets_a_variable_directly() -> None:
    os.environ[PROBE] = "leaked"
    os.environ.pop("HOME", None)


def test_the_next_test_does_not_see_it() -> None:
    assert PROBE not in os.environ
    assert "HOME" in os.environ  # and what was removed is back
