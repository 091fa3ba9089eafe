"""Public hand-written capture API: Graph, graph(), pools, synchronize. (Filled by the runtime work.)"""
