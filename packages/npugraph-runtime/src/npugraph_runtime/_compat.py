"""Every private torch API the runtime touches, each with the torch versions it was checked on.
A torch upgrade is a change to this file only."""

from __future__ import annotations
