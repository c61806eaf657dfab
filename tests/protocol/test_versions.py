import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.protocol.errors import UNSUPPORTED_PROTOCOL_VERSION, ProtocolError
from kvgate.protocol.versions import (
    LATEST_LEGACY_VERSION,
    SUPPORTED_VERSIONS,
    Era,
    era_of,
    negotiate_legacy,
)


@pytest.mark.parametrize(
    ("header", "era"),
    [
        ("2026-07-28", Era.MODERN),
        ("2025-11-25", Era.LEGACY),
        ("2025-06-18", Era.LEGACY),
        ("2025-03-26", Era.LEGACY),
        (None, Era.LEGACY),
    ],
)
def test_era_follows_the_header(header: str | None, era: Era) -> None:
    assert era_of(header) is era


@pytest.mark.parametrize("header", ["1900-01-01", "v999.0.0", "2024-11-05", ""])
def test_unknown_versions_list_what_is_supported(header: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        era_of(header)
    assert caught.value.code == UNSUPPORTED_PROTOCOL_VERSION
    assert caught.value.data == {"supported": list(SUPPORTED_VERSIONS), "requested": header}
    assert caught.value.http_status(modern=True) == 400


def test_initialize_negotiation() -> None:
    assert negotiate_legacy("2025-06-18") == "2025-06-18"
    assert negotiate_legacy("2026-07-28") == LATEST_LEGACY_VERSION
    assert negotiate_legacy(None) == LATEST_LEGACY_VERSION


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_version_header_picks_an_era_or_lists_the_supported(header: str) -> None:
    try:
        era = era_of(header)
    except ProtocolError as error:
        assert header not in SUPPORTED_VERSIONS
        assert error.code == UNSUPPORTED_PROTOCOL_VERSION and error.data["requested"] == header
    else:
        assert header in SUPPORTED_VERSIONS and era is (
            Era.MODERN if header >= "2026" else Era.LEGACY
        )
