"""The test suite's own machinery."""
import os

import pytest


@pytest.fixture(scope="module")
def shared():
    return object()


def test_tests_sharing_a_fixture_are_grouped_on_one_worker(shared, request):
    """conftest.py marks the tests that read a module or session fixture (a trained run) with an xdist_group, so
    that one worker computes it once: under --dist loadgroup each such test's id carries its group. With pytest 9
    and pytest-xdist 3.8 it did not, and each worker trained the shared runs again (requirements-test.txt)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("the suite runs without pytest-xdist's workers")
    assert request.node.nodeid.endswith("@test_suite")
