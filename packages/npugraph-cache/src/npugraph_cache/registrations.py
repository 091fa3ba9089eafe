"""How many parameters, buffers and submodules were assigned to any module in this process:
torch's global registration hooks count every ``setattr`` of one, a ``register_*`` call,
``load_state_dict(assign=True)``. npugraph_cache.guards looks the modules whose ``training``
flags it checks up again only after this count moved. A ``.data`` swap keeps the object and is
the compiler's to see (the npugraph_ex capture manager checks every parameter's address on each
call)."""

from __future__ import annotations

from npugraph_cache import _compat

__all__ = ["count_registrations", "registrations"]

_count = [0]
_installed = False


def _bump(*_: object) -> None:
    # Code that dynamo traces may build modules (ModuleList slicing, as transformers' models
    # do): traced, this count would be a side effect and a guard, recompiling every call.
    # Inside a compiled region nothing is assigned at run time, so it counts nothing there. Only
    # this thread's compile: an assignment in another thread meanwhile is counted (it was not,
    # and that thread's check kept the old submodule for good)
    if _compat.traced_here():
        return
    _count[0] += 1


def registrations() -> int:
    """How many parameters, buffers and submodules were assigned to any module since the hooks
    were installed (by the first ``count_registrations``)."""
    return _count[0]


def count_registrations() -> bool:
    """Install the hooks ``registrations`` counts with (once); False where torch lacks them."""
    global _installed
    if not _installed:
        from torch.nn.modules import module as nn_module

        hooks = ("register_module_parameter_registration_hook",
                 "register_module_buffer_registration_hook",
                 "register_module_module_registration_hook")
        if not all(hasattr(nn_module, h) for h in hooks):
            return False
        for h in hooks:
            getattr(nn_module, h)(_bump)
        _installed = True
    return True
