import pytest

from kvgate.gateway.http.security import OriginPolicy

LOCAL = OriginPolicy("127.0.0.1", ("https://app.example.com",))
PUBLIC = OriginPolicy("0.0.0.0")


@pytest.mark.parametrize(
    ("origin", "allowed"),
    [
        (None, True),
        ("http://localhost:3000", True),
        ("https://127.0.0.1", True),
        ("http://[::1]:8080", True),
        ("https://app.example.com/", True),
        ("http://app.example.com", False),  # scheme is part of an origin
        ("http://evil.example.com", False),
        ("http://localhost.evil.com", False),
        ("null", False),
        ("file://localhost", False),
    ],
)
def test_origins(origin: str | None, allowed: bool) -> None:
    assert LOCAL.origin_allowed(origin) is allowed


def test_only_configured_origins_join_localhost() -> None:
    assert PUBLIC.origin_allowed("http://localhost:3000")
    assert not PUBLIC.origin_allowed("https://app.example.com")


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("localhost:8000", True),
        ("127.0.0.1", True),
        ("[::1]:8000", True),
        ("app.example.com", True),
        ("evil.example.com", False),
        (None, False),
        ("", False),
    ],
)
def test_loopback_server_checks_host(host: str | None, allowed: bool) -> None:
    assert LOCAL.host_allowed(host) is allowed


def test_public_server_leaves_host_to_the_load_balancer() -> None:
    assert PUBLIC.host_allowed("kvgate.internal:8000")


def test_wildcard_allows_any_origin() -> None:
    assert OriginPolicy("127.0.0.1", ("*",)).origin_allowed("https://anything.example")
