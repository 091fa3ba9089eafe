"""The on-disk format refuses anything but an intact entry of its own version."""

from __future__ import annotations

import struct

import pytest
from npugraph_cache.format import FORMAT_VERSION, HEADER_SIZE, MAGIC, FormatError, decode, encode


def test_roundtrip_keeps_metadata_and_payload() -> None:
    data = encode({"func": "Model.prompt", "n": [1, 2]}, b"\x00payload\xff")
    entry = decode(data)
    assert entry.metadata == {"func": "Model.prompt", "n": [1, 2]}
    assert entry.payload == b"\x00payload\xff"


@pytest.mark.parametrize("keep", [0, HEADER_SIZE - 1, HEADER_SIZE + 3, -1])
def test_truncated_entry_is_refused(keep: int) -> None:
    data = encode({"a": 1}, b"x" * 100)
    with pytest.raises(FormatError, match=r"truncated|shorter"):
        decode(data[:keep] if keep >= 0 else data[:-1])


def test_foreign_file_is_refused() -> None:
    with pytest.raises(FormatError, match="not an npugraph_ex cache entry"):
        decode(b"\x80\x04garbage that is long enough to hold a header" * 3)


def test_other_format_version_is_refused() -> None:
    data = bytearray(encode({"a": 1}, b"payload"))
    struct.pack_into("<H", data, len(MAGIC), FORMAT_VERSION + 1)
    with pytest.raises(FormatError, match="format version"):
        decode(bytes(data))


def test_flipped_payload_byte_fails_the_checksum() -> None:
    data = bytearray(encode({"a": 1}, b"payload"))
    data[-2] ^= 0xFF
    with pytest.raises(FormatError, match="checksum"):
        decode(bytes(data))
