"""Option errors where the README says they surface: up front from validate_options /
CompilerConfig as a plain OptionError, and at the first call of a torch.compile'd function
wrapped by torch in BackendCompilerFailed (which is not a ValueError)."""

from __future__ import annotations

import pytest
import torch

import npugraph_ex


def test_validate_options_returns_the_config_or_raises_option_error() -> None:
    config = npugraph_ex.validate_options({"capture_limit": 3, "clone_output": True})
    assert isinstance(config, npugraph_ex.CompilerConfig)
    assert (config.capture_limit, config.clone_output) == (3, True)
    with pytest.raises(npugraph_ex.OptionError, match="Did you mean 'capture_limit'"):
        npugraph_ex.validate_options({"capture_limt": 3})
    with pytest.raises(TypeError, match="post_grad_custom_pre_pass"):
        npugraph_ex.validate_options({"post_grad_custom_pre_pass": 1})


def test_capture_limit_range_reads_as_words() -> None:
    with pytest.raises(npugraph_ex.OptionError) as info:
        npugraph_ex.CompilerConfig(capture_limit=0)
    message = str(info.value)
    assert "an int ≥ 1" in message and "'capture_limit'" in message and "value 0" in message
    assert str(2**63 - 1) not in message


def test_torch_compile_surfaces_the_option_error_at_the_first_call_wrapped() -> None:
    torch.compiler.reset()
    f = torch.compile(lambda x: x + 1, backend="npugraph_ex", options={"capture_limit": 0})
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        f(torch.ones(2))
    assert not isinstance(info.value, ValueError)
    assert isinstance(info.value.inner_exception, npugraph_ex.OptionError)
    assert "an int ≥ 1" in str(info.value)
    torch.compiler.reset()
