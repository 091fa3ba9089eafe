"""The capture manager: GraphedCallable and make_graphed_callable. (Filled by the runtime work.)"""
