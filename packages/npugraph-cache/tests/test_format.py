"""The on-disk format refuses anything but an intact entry of its own version, written with the
user's key."""

from __future__ import annotations

import struct

import pytest
from npugraph_cache.format import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    FormatError,
    decode,
    encode,
    read_metadata,
)

KEY = b"k" * 32


def test_roundtrip_keeps_metadata_and_payload() -> None:
    data = encode({"func": "Model.prompt", "n": [1, 2]}, b"\x00payload\xff", KEY)
    entry = decode(data, KEY)
    assert entry.metadata == {"func": "Model.prompt", "n": [1, 2]}
    assert entry.payload == b"\x00payload\xff"


@pytest.mark.parametrize("keep", [0, HEADER_SIZE - 1, HEADER_SIZE + 3, -1])
def test_truncated_entry_is_refused(keep: int) -> None:
    data = encode({"a": 1}, b"x" * 100, KEY)
    with pytest.raises(FormatError, match=r"truncated|shorter"):
        decode(data[:keep] if keep >= 0 else data[:-1], KEY)


def test_foreign_file_is_refused() -> None:
    with pytest.raises(FormatError, match="not an npugraph_ex cache entry"):
        decode(b"\x80\x04garbage that is long enough to hold a header" * 3, KEY)


def test_other_format_version_is_refused() -> None:
    data = bytearray(encode({"a": 1}, b"payload", KEY))
    struct.pack_into("<H", data, len(MAGIC), FORMAT_VERSION + 1)
    with pytest.raises(FormatError, match="format version"):
        decode(bytes(data), KEY)


def test_flipped_payload_byte_fails_authentication() -> None:
    data = bytearray(encode({"a": 1}, b"payload", KEY))
    data[-2] ^= 0xFF
    with pytest.raises(FormatError, match="authentication failed"):
        decode(bytes(data), KEY)


def test_entry_written_with_another_key_is_refused() -> None:
    data = encode({"a": 1}, b"payload", b"o" * 32)
    with pytest.raises(FormatError, match="not written with your cache key"):
        decode(data, KEY)


def test_metadata_is_read_without_the_key_and_says_so() -> None:
    data = encode({"a": 1}, b"payload", KEY)
    assert read_metadata(data, None) == ({"a": 1}, False)
    assert read_metadata(data, KEY) == ({"a": 1}, True)
    assert read_metadata(data, b"o" * 32) == ({"a": 1}, False)
