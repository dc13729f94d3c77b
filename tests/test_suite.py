"""The test suite's own setup: what make test relies on to share work between its workers."""

from __future__ import annotations

import os

import pytest

from tests.helpers import on_one_worker


@on_one_worker("suite-self-check")
def test_pytest_xdist_sees_the_worker_groups(request):
    """on_one_worker's groups keep a real model's tests on one worker; pytest-xdist gives each test of
    a group an id ending in the group's name, which a pytest it does not support leaves out."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        pytest.skip("runs under pytest-xdist (make test)")
    assert request.node.nodeid.endswith("@suite-self-check")
