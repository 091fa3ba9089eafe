"""Stream, Event and the stream() context manager. (Filled by the runtime work.)"""
