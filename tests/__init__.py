"""The test suite (a package: tests import their shared factories as `tests.factories`)."""
