"""Debugging aids (DFX): TORCH_COMPILE_DEBUG dumps (``debug``), tensor data dumps
(``data_dump``), the ``npugraph_ex`` logger (``log``) and profiler ranges (``ranges``).

Every hook costs one cheap check when its feature is off; the compiler calls them, the user
only sets environment variables and options."""
