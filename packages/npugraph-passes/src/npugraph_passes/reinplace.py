"""Re-inplacing: functional ops turned back into in-place ops where nobody can tell.

AOT hands us a functional graph. Each ``y = op(x, ...)`` allocates a new ``y``; each mutation of
a graph input ``p`` became ``new = op(p, ...)`` plus a ``copy_(p, new)`` epilogue, so a KV cache
updated with ``index_copy_`` is copied whole every step. Two passes undo that:

* :func:`inplace_pass` (intermediates): ``y = op(x, ...)`` becomes ``op_(x, ...)`` when ``x`` is
  an intermediate (no graph input, no view of one) that nothing reads afterwards;
* :func:`input_inplace_pass` (graph inputs): ``new = op(p, ...)`` + ``copy_(p, new)`` becomes
  ``op_(p, ...)`` and the epilogue goes; ``index_copy``, ``index_put``, ``scatter`` and every
  functional op with an in-place twin, ``slice_scatter``/``select_scatter``/``diagonal_scatter``/
  ``as_strided_scatter`` (a view of ``p`` plus ``copy_``), the generic epilogue
  ``copy_(p, f(...))`` where ``f`` has an ``out=`` variant (``f(..., out=p)``), and custom ops
  with mutable arguments (``auto_functionalized``: no clone of what may be written directly).
  ``p`` may be a view of a graph input as well (``kc[layer].index_put_(...)`` on one stacked
  KV buffer): the ``copy_`` into a view that a ``*_scatter`` becomes is an epilogue like AOT's.

Both refuse when the old value is read afterwards (for an input: before the functional graph
wrote it back) through any alias, when the shapes,
strides or dtypes differ (broadcasting, type promotion, another layout), when the written tensor
may overlap itself (:mod:`npugraph_passes.overlap`) or another argument, when a node on another
stream uses the tensor with no event between, and when a collective reads or writes the tensor
(its inputs, its result, what its wait returns). Collectives and their waits are never rewritten: a
functional collective stays functional (:mod:`npugraph_passes.collectives`).

The passes live in :mod:`npugraph_passes.inplace_intermediates`,
:mod:`npugraph_passes.inplace_inputs` and :mod:`npugraph_passes.inplace_custom_ops` (the
auto_functionalized part), over the analysis in :mod:`npugraph_passes.inplace_analysis` and the
checks and rewrite in :mod:`npugraph_passes.inplace_rewrite`; this module names them.
"""

from __future__ import annotations

from npugraph_passes.inplace_analysis import SCATTER_VIEWS
from npugraph_passes.inplace_custom_ops import lower_auto_functionalized
from npugraph_passes.inplace_inputs import input_inplace_pass
from npugraph_passes.inplace_intermediates import inplace_pass

__all__ = ["SCATTER_VIEWS", "inplace_pass", "input_inplace_pass", "lower_auto_functionalized"]
