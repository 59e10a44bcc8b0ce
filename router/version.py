"""The version the router reports to clients (/version, ServerMetadata, the system fingerprint)."""

from __future__ import annotations

import importlib.metadata

UNINSTALLED_VERSION = "0+unknown"


def installed_version() -> str:
    """The installed distribution's version; UNINSTALLED_VERSION for a source tree put on the path
    without installing it (which has no distribution metadata)."""
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:
        return UNINSTALLED_VERSION


SERVER_VERSION = installed_version()
"""Read once at import: the installed distribution's version."""
