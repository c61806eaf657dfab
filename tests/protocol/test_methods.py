import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.protocol.errors import METHOD_NOT_FOUND, ProtocolError
from kvgate.protocol.methods import CACHEABLE_METHODS, LEGACY_METHODS, MODERN_METHODS, check_method
from kvgate.protocol.versions import Era


@pytest.mark.parametrize(
    "method",
    [
        "initialize",
        "ping",
        "logging/setLevel",
        "resources/subscribe",
        "resources/unsubscribe",
        "no/such",
    ],
)
def test_removed_and_unknown_methods_are_not_found_under_modern_rules(method: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        check_method(method, Era.MODERN)
    assert caught.value.code == METHOD_NOT_FOUND
    assert caught.value.http_status(modern=True) == 404
    assert caught.value.http_status(modern=False) == 200


def test_each_era_serves_its_own_methods() -> None:
    for method in ("initialize", "ping", "tools/list", "tools/call", "prompts/get"):
        check_method(method, Era.LEGACY)
    for method in ("server/discover", "subscriptions/listen"):
        check_method(method, Era.MODERN)
        with pytest.raises(ProtocolError):
            check_method(method, Era.LEGACY)


def test_cacheable_methods_are_the_specs() -> None:
    assert CACHEABLE_METHODS == {
        "server/discover",
        "tools/list",
        "prompts/list",
        "resources/list",
        "resources/templates/list",
        "resources/read",
    }


@settings(max_examples=300, deadline=None)
@given(
    method=st.text() | st.sampled_from(sorted(MODERN_METHODS | LEGACY_METHODS)),
    era=st.sampled_from(list(Era)),
)
def test_any_method_is_served_in_its_era_or_not_found(method: str, era: Era) -> None:
    served = MODERN_METHODS if era is Era.MODERN else LEGACY_METHODS
    try:
        check_method(method, era)
    except ProtocolError as error:
        assert method not in served and error.code == METHOD_NOT_FOUND
        assert error.data == {"method": method}
    else:
        assert method in served
