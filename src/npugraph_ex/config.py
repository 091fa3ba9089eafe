"""The options of the npugraph_ex backend (shared/API.md, "Options")."""

from npugraph_backend.config import CompilerConfig, OptionError, PassOptionError, option_names

__all__ = ["CompilerConfig", "OptionError", "PassOptionError", "option_names"]
