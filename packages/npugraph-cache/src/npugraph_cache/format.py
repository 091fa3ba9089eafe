"""The on-disk format of one cache entry.

    MAGIC (8 bytes) | format version (u16) | metadata length (u32) | payload length (u64)
    | tag (32 bytes) | metadata (UTF-8 JSON) | payload (bytes)

The tag is an HMAC-SHA256, with this user's secret key (``npugraph_cache.secret``), of every
other byte of the entry (header fields, metadata and payload). ``decode`` verifies the magic,
the version, both lengths and the tag before it parses anything, so the payload (torch's
serialized compiled function, a pickle) reaches torch only when the entry was written with this
user's key: a truncated, corrupted, foreign or forged file is refused before any unpickling.
The metadata is JSON; ``read_metadata`` parses it without the key (for ``cache show``), never
touching the payload.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from npugraph_cache.errors import FormatError
from npugraph_cache.secret import tag, verify

MAGIC = b"NGXCACHE"
# 2: HMAC tag (version 1 had an unkeyed sha256 anyone could recompute); 3: every guard torch
# can save is in the entry, the others recorded with the parameters they read (issue 24); 4: a
# function's description digests nested code by content (code_digest), not by its address
FORMAT_VERSION = 4
_PREFIX = struct.Struct("<8sHIQ")
_TAG = 32
HEADER_SIZE = _PREFIX.size + _TAG
_MAX_METADATA = 64 * 1024 * 1024

__all__ = ["FORMAT_VERSION", "HEADER_SIZE", "MAGIC", "Entry", "FormatError", "decode", "encode"]


@dataclass(frozen=True)
class Entry:
    metadata: dict[str, Any]
    payload: bytes


def encode(metadata: dict[str, Any], payload: bytes, key: bytes) -> bytes:
    meta = json.dumps(metadata, sort_keys=True, default=str).encode("utf-8")
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(meta), len(payload))
    return prefix + tag(key, prefix + meta + payload) + meta + payload


def _split(data: bytes) -> tuple[bytes, bytes, int]:
    """(the bytes the tag covers, the tag, metadata length) of an entry of this version whose
    lengths add up; FormatError otherwise."""
    if len(data) < HEADER_SIZE:
        raise FormatError(
            f"truncated: {len(data)} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    magic, version, meta_len, payload_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise FormatError(f"not an npugraph_ex cache entry (magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise FormatError(f"format version {version}, this npugraph_cache reads {FORMAT_VERSION}")
    if meta_len > _MAX_METADATA:
        raise FormatError(f"metadata length {meta_len} is implausible")
    expected = HEADER_SIZE + meta_len + payload_len
    if len(data) != expected:
        raise FormatError(f"truncated or padded: {len(data)} bytes, header says {expected}")
    signed = data[: _PREFIX.size] + data[HEADER_SIZE:]
    return signed, data[_PREFIX.size : HEADER_SIZE], meta_len


def _metadata(raw: bytes) -> dict[str, Any]:
    try:
        metadata = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"metadata is not JSON: {exc}") from None
    if not isinstance(metadata, dict):
        raise FormatError("metadata is not a JSON object")
    return metadata


def decode(data: bytes, key: bytes) -> Entry:
    """Parse and authenticate a whole entry. Raises FormatError for anything but an intact entry
    of FORMAT_VERSION written with ``key``."""
    signed, expected_tag, meta_len = _split(data)
    if not verify(key, signed, expected_tag):
        raise FormatError(
            "authentication failed: not written with your cache key (tampered with, copied from "
            "another user or machine, or written before the key was replaced)"
        )
    body = data[HEADER_SIZE:]
    return Entry(_metadata(body[:meta_len]), bytes(body[meta_len:]))


def read_metadata(data: bytes, key: bytes | None) -> tuple[dict[str, Any], bool]:
    """(metadata, authenticated) without touching the payload: for showing an entry, never for
    loading one. ``key`` None: not authenticated."""
    signed, expected_tag, meta_len = _split(data)
    authenticated = key is not None and verify(key, signed, expected_tag)
    return _metadata(data[HEADER_SIZE : HEADER_SIZE + meta_len]), authenticated
