"""Private bits of other libraries that the façade relies on, in one place (like each package's
``_compat.py`` for torch), each with the versions it was checked on."""

from __future__ import annotations

import warnings
from typing import Any


def compile_on_every_device(compile_config: Any) -> None:
    """Make ``generate`` compile on every device, not only on the ones transformers lists.

    transformers' ``generate`` compiles the decode step only on CUDA (4.5x; 5.x: CUDA, XPU,
    Neuron, TPU) unless the private flag ``CompileConfig._compile_all_devices`` is set; on the
    CPU and on an Ascend NPU it otherwise skips compilation with one log line. Checked on
    transformers 4.57.6 and 5.18.0 (``GenerationMixin._valid_auto_compile_criteria``
    reads the flag; ``CompileConfig.to_dict`` leaves it out of torch.compile's arguments)."""
    if not hasattr(type(compile_config), "_compile_all_devices"):
        import transformers

        warnings.warn(
            f"transformers {transformers.__version__} has no CompileConfig._compile_all_devices: "
            "generate may compile only on CUDA here; check torch._dynamo.utils.counters"
            "['npugraph_ex'] for captured_* entries after generate",
            RuntimeWarning,
            stacklevel=3,
        )
    compile_config._compile_all_devices = True
