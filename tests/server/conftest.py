"""Fixtures of the server tests (helpers live in helpers.py)."""

from __future__ import annotations

import pytest

from .helpers import make_engine, running_server


@pytest.fixture(scope="module")
def server():
    """One shared server per test module (fresh engine)."""
    with running_server(make_engine()) as srv:
        yield srv
