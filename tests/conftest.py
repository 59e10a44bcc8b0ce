"""Session fixtures: tiny models built once per test session (splitserve.testing.tiny_models' specs,
same builder as `make-tiny-model`),
and the Prometheus server and promtool (installed when missing)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import NamedTuple

import pytest

from splitserve.engine.tiny_model import build_tiny_model
from splitserve.testing.tiny_models import TINY_SPECS


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {name: build_tiny_model(root / name, spec) for name, spec in TINY_SPECS.items()}


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs["qwen2"]


POLICY_RC_D = Path("/usr/sbin/policy-rc.d")
"""Debian's switch for maintainer scripts starting services: exit 101 forbids it."""


def _apt_get(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["apt-get", *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def _install_prometheus() -> str | None:
    """Install the Debian package `prometheus` (2.42 on Debian 12: the server and promtool);
    returns why it could not be, or None.

    The package's postinst starts its own service (listening on 0.0.0.0:9090) unless policy-rc.d
    forbids it, and enables it at boot; the tests run their own server on 127.0.0.1 only, so
    neither may happen."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "not root with apt-get: run `apt-get install --no-install-recommends prometheus`"
    added_policy = not POLICY_RC_D.exists()
    if added_policy:
        POLICY_RC_D.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC_D.chmod(0o755)
    try:
        install = ("install", "-y", "--no-install-recommends", "prometheus")
        done = _apt_get(*install)
        if done.returncode != 0:  # missing or stale package lists
            _apt_get("update")
            done = _apt_get(*install)
    finally:
        if added_policy:
            POLICY_RC_D.unlink()
    if done.returncode != 0:
        return f"apt-get install prometheus failed: {done.stderr.strip()[-500:]}"
    subprocess.run(["update-rc.d", "prometheus", "disable"], capture_output=True, check=True)
    return None


class PrometheusBin(NamedTuple):
    server: str
    promtool: str


@pytest.fixture(scope="session")
def prometheus_bin() -> PrometheusBin:
    """The Prometheus executables; installs the package when missing, skips with the reason when
    it cannot."""
    if shutil.which("promtool") is None or shutil.which("prometheus") is None:
        problem = _install_prometheus()
        if problem is not None:
            pytest.skip(f"Prometheus is not installed and cannot be: {problem}")
    return PrometheusBin(shutil.which("prometheus"), shutil.which("promtool"))
