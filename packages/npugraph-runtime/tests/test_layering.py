"""devices/ is the runtime's bottom layer: each of its modules, imported alone in a fresh
interpreter, loads no runtime module but devices/ and the leaves below it (see the docstring of
``npugraph_runtime.devices``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import npugraph_runtime.devices

# what devices/ may import of the runtime besides itself: leaves that import nothing of ours but
# one another
BELOW_DEVICES = ("npugraph_runtime._compat", "npugraph_runtime.errors", "npugraph_runtime.schema",
                 "npugraph_runtime.spans")

DEVICES_DIR = Path(npugraph_runtime.devices.__file__).parent
PACKAGE_DIR = DEVICES_DIR.parent

# The package's __init__ imports the whole runtime, so it is replaced by an empty package of the
# same path: what a module loads is then what the module itself imports. Each module is imported
# after every runtime module of the previous one was dropped from sys.modules.
_SCRIPT = """
import importlib, json, sys, types
import torch
package = types.ModuleType("npugraph_runtime")
package.__path__ = [sys.argv[1]]
sys.modules["npugraph_runtime"] = package
loaded = {}
for name in sys.argv[2:]:
    for key in [k for k in sys.modules if k.startswith("npugraph_runtime.")]:
        del sys.modules[key]
    importlib.import_module(name)
    loaded[name] = sorted(k for k in sys.modules if k.startswith("npugraph_runtime."))
print(json.dumps(loaded))
"""


def _modules_of_devices() -> list[str]:
    names = ["npugraph_runtime.devices"]
    names += sorted(
        f"npugraph_runtime.devices.{p.stem}" for p in DEVICES_DIR.glob("*.py") if p.stem != "__init__"
    )
    return names


def _loaded_by(names: list[str]) -> dict[str, list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(PACKAGE_DIR), *names],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    loaded: dict[str, list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded


def _above_devices(modules: list[str]) -> list[str]:
    return [
        m
        for m in modules
        if m not in BELOW_DEVICES
        and m != "npugraph_runtime.devices"
        and not m.startswith("npugraph_runtime.devices.")
    ]


def test_every_module_of_devices_imports_nothing_above_it() -> None:
    names = _modules_of_devices()
    # the CPU pool and the core-unit probes live in devices/ now, next to the backends
    assert {"npugraph_runtime.devices.cpu_pool", "npugraph_runtime.devices.core_units"} <= set(names)
    loaded = _loaded_by([*names, "npugraph_runtime.graphs"])
    upward = {name: _above_devices(loaded[name]) for name in names}
    assert upward == {name: [] for name in names}
    # every module really was imported, and the check sees a module above devices/: graphs
    # loads streams
    for name in names:
        assert name in loaded[name]
    assert "npugraph_runtime.streams" in _above_devices(loaded["npugraph_runtime.graphs"])


def test_the_leaves_below_devices_import_only_one_another() -> None:
    loaded = _loaded_by(list(BELOW_DEVICES))
    for name in BELOW_DEVICES:
        assert set(loaded[name]) <= set(BELOW_DEVICES), (name, loaded[name])
