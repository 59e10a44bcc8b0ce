"""Errors that cross package boundaries (torch-free)."""


class InvalidRequestError(ValueError):
    """A request that can never be served as given; the message names the offending field.

    Raised before anything is allocated, so rejecting a request never leaks resources.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Raised in the router's body-parsing process (router/request_body.py) and re-raised here:
        # pickle rebuilds an exception from its args, which hold the joined text, not (field, message).
        return type(self), (self.field, self.message)


class UnsupportedModelError(ValueError):
    """A model directory whose architecture or configuration the engine cannot run."""


class StartupError(RuntimeError):
    """A cluster that could not start (a worker failed to load, no node fits it); the message is
    one line saying which part failed and why."""
