"""The C++ CPU kernels in csrc/ (paged decode attention, fused RMSNorm / SiLU-and-mul / RoPE): built
with the system compiler on first use, cached on disk, loaded as torch ops
(`torch.ops.splitserve_cpu.*`). They need AVX-512 (the machines here have it).

The build takes about 15 s once per machine; the library is cached under
`<cache dir>/kernels/<key>/` where the key hashes the source, torch's version, the compiler and
the CPU's feature flags (it is compiled with -march=native), so a machine never loads a library
built for another CPU. Concurrent first users (several workers starting together) build it once:
the others wait on a file lock. Without a compiler, or if the build fails, `load_cpu_kernels()`
returns False and says why once in the log; callers fall back to their pure-torch path.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

from splitserve.engine.tiny_model import default_cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "paged_attention.cpp", CSRC / "prefill_attention.cpp", CSRC / "fused_ops.cpp")
HEADERS = (CSRC / "vec16.h",)
LIBRARY_NAME = "splitserve_cpu.so"
# -ffp-contract=off: a multiply then an add stay two roundings, as in torch's separate ops.
# CPU_CAPABILITY selects ATen's AVX-512 Vectorized (its exp); the sources refuse to build without AVX-512.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++20",
                 "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512",
                 f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_key(compiler: str) -> str:
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    for part in (torch.__version__, version, " ".join(COMPILE_FLAGS), platform.machine(), _cpu_flags()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _compile(compiler: str, target: Path) -> None:
    """Compile SOURCES into `target` atomically (a partial library is never visible)."""
    torch_lib = Path(torch.__file__).parent / "lib"
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as staging:
        command = [compiler, *COMPILE_FLAGS, *includes, *map(str, SOURCES), "-o", staging.name,
                   f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(staging.name)
            raise RuntimeError(f"{' '.join(command[:3])} ... failed:\n{done.stderr[-2000:]}")
        os.replace(staging.name, target)


def _library_path() -> Path:
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH)")
    directory = default_cache_dir() / "kernels" / _build_key(compiler)
    target = directory / LIBRARY_NAME
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            logger.info("building the CPU kernels into %s (once per machine, about 15 s)", directory)
            _compile(compiler, target)
    return target


@functools.cache
def load_cpu_kernels() -> bool:
    """True once `torch.ops.splitserve_cpu` is loaded; False (logged once) when it cannot be built."""
    try:
        torch.ops.load_library(str(_library_path()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("CPU kernels unavailable, using the pure-torch path: %s", error)
        return False
    return True
