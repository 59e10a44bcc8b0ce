"""Errors that cross package boundaries (torch-free)."""


class InvalidRequestError(ValueError):
    """A request that can never be served as given; the message names the offending field.

    Raised before anything is allocated, so rejecting a request never leaks resources.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class UnsupportedModelError(ValueError):
    """A model directory whose architecture or configuration the engine cannot run."""


class StartupError(RuntimeError):
    """A cluster that could not start (a worker failed to load, no node fits it); the message is
    one line saying which part failed and why."""
