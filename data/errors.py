"""The data package's one error type, in a module of its own so that every data
module can raise it without importing another (sources and tfrecords used to import
each other for it)."""


class DatasetError(RuntimeError):
    """The data could not be found or read; the message says what to do."""
