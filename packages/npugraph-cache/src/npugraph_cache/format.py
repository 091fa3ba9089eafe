"""The on-disk format of one cache entry.

    MAGIC (8 bytes) | format version (u16) | metadata length (u32) | payload length (u64)
    | sha256 of metadata + payload (32 bytes) | metadata (UTF-8 JSON) | payload (bytes)

The metadata is JSON, so reading it never runs an unpickler; the payload (torch's serialized
compiled function) is handed to torch only after the magic, the version, both lengths and the
checksum have been verified, so a truncated, corrupted or foreign file is refused before any
unpickling happens.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

MAGIC = b"NGXCACHE"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sHIQ32s")
HEADER_SIZE = _HEADER.size
_MAX_METADATA = 64 * 1024 * 1024


class FormatError(ValueError):
    """A file that is not a valid entry of this format version (the message says why)."""


@dataclass(frozen=True)
class Entry:
    metadata: dict[str, Any]
    payload: bytes


def encode(metadata: dict[str, Any], payload: bytes) -> bytes:
    meta = json.dumps(metadata, sort_keys=True, default=str).encode("utf-8")
    digest = hashlib.sha256(meta + payload).digest()
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(meta), len(payload), digest) + meta + payload


def read_header(data: bytes) -> tuple[int, int, int, bytes]:
    """(version, metadata length, payload length, digest); FormatError when not ours or too short."""
    if len(data) < HEADER_SIZE:
        raise FormatError(
            f"truncated: {len(data)} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    magic, version, meta_len, payload_len, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FormatError(f"not an npugraph_ex cache entry (magic {magic!r}, expected {MAGIC!r})")
    return version, meta_len, payload_len, digest


def decode(data: bytes) -> Entry:
    """Parse and verify a whole entry. Raises FormatError for anything but a valid, intact entry
    of FORMAT_VERSION."""
    version, meta_len, payload_len, digest = read_header(data)
    if version != FORMAT_VERSION:
        raise FormatError(f"format version {version}, this npugraph_cache reads {FORMAT_VERSION}")
    if meta_len > _MAX_METADATA:
        raise FormatError(f"metadata length {meta_len} is implausible")
    expected = HEADER_SIZE + meta_len + payload_len
    if len(data) != expected:
        raise FormatError(f"truncated or padded: {len(data)} bytes, header says {expected}")
    body = data[HEADER_SIZE:]
    if hashlib.sha256(body).digest() != digest:
        raise FormatError("checksum mismatch (corrupted)")
    try:
        metadata = json.loads(body[:meta_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"metadata is not JSON: {exc}") from None
    if not isinstance(metadata, dict):
        raise FormatError("metadata is not a JSON object")
    return Entry(metadata, bytes(body[meta_len:]))
