"""The keys of an ``npugraph_ex.scope_enter`` scope, and the op namespace: shared by the ops that
carry scopes (``ops``), the code that leaves them in a graph (``streams``, ``core_limit``) and the
backend that lowers them. A leaf: it imports nothing."""

NAMESPACE = "npugraph_ex"
USER_STREAM_LABEL = "_user_stream_label"
AICORE_KEY = "_op_aicore_num"
VECTORCORE_KEY = "_op_vectorcore_num"
DEVICE_KEY = "_device"
