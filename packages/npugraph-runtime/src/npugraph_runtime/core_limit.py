"""limit_core_num: per-stream compute-unit limits. (Filled by the runtime work.)"""
