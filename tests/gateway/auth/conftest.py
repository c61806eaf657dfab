"""Real ``kvgate serve`` processes for the auth tests (SIGHUP, two processes on one Redis)."""

from tests.gateway.http.test_serving import kvgate_factory  # noqa: F401 - a fixture
