"""Every test (and every worker process it starts) uses a cache key of its own session, never
the user's real one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from npugraph_cache.secret import KEY_ENV


@pytest.fixture(autouse=True, scope="session")
def session_cache_key(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("cache-key") / "cache.key"
    old = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = str(path)
    yield path
    if old is None:
        os.environ.pop(KEY_ENV, None)
    else:
        os.environ[KEY_ENV] = old
