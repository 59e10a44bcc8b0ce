"""The C++ CPU kernels in csrc/ (paged decode and prefill attention, fused RMSNorm / SiLU-and-mul / RoPE):
built with the system compiler on first use, cached on disk, loaded as torch ops
(`torch.ops.splitserve_cpu.*`).

One source serves two instruction sets (csrc/vec16.h): the build targets the CPU's, AVX-512 (with the
AVX512_BF16 dot instruction when the CPU has it) or AVX2 + FMA, with the matching ATen CPU_CAPABILITY
so ATen's Vectorized (its exp) is the one torch's own ops run on this CPU. A CPU with neither logs one
line and keeps the pure-torch path. `cpu_kernel_isa()` says which build is loaded.

The build takes about 15 s once per machine; the library is cached under
`<cache dir>/kernels/<key>/` where the key hashes the source, torch's version, the compiler, the
compile flags (the ISA's among them) and the CPU's feature flags (it is compiled with -march=native), so
a machine never loads a library built for another CPU. Concurrent first users (several workers starting
together) build it once: the others wait on a file lock. Without a compiler, or if the build fails,
`load_cpu_kernels()` returns False and says why once in the log; callers fall back to their pure-torch path.
"""

from __future__ import annotations

import dataclasses
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
SOURCES = (CSRC / "paged_attention.cpp", CSRC / "prefill_attention.cpp", CSRC / "fused_ops.cpp",
           CSRC / "panel_linear.cpp")
HEADERS = (CSRC / "vec16.h",)
LIBRARY_NAME = "splitserve_cpu.so"
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes the attention and fused-op kernels are built for (each raises "dtype Half is not supported" on
float16): a float16 engine on CPU runs the pure-torch ops."""


@dataclasses.dataclass(frozen=True)
class CpuKernelIsa:
    """An instruction set the CPU kernels build for."""

    name: str
    """'avx512_bf16', 'avx512' or 'avx2': what logs and benches report."""
    capability: str
    """ATen's CPU_CAPABILITY of the build ('AVX512' or 'AVX2'): selects vec16.h's Vec16 and ATen's Vectorized."""
    machine_flags: tuple[str, ...]
    """The -m flags that guarantee the instructions (on top of -march, which may name an older CPU)."""
    bf16_dot: bool
    """Whether bf16 dot products run on vdpbf16ps; otherwise on two float FMAs with the same sums."""


_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
AVX512_BF16 = CpuKernelIsa("avx512_bf16", "AVX512", (*_AVX512_FLAGS, "-mavx512bf16"), bf16_dot=True)
AVX512 = CpuKernelIsa("avx512", "AVX512", _AVX512_FLAGS, bf16_dot=False)
AVX2 = CpuKernelIsa("avx2", "AVX2", ("-mavx2", "-mfma", "-mf16c"), bf16_dot=False)


def detect_isa(capability: str, cpu_flags: frozenset[str]) -> CpuKernelIsa | None:
    """The kernels' ISA for ATen's CPU capability (torch.backends.cpu.get_cpu_capability(): 'AVX512' means
    AVX-512 F/BW/VL/DQ, 'AVX2' means AVX2 + FMA, and ATEN_CPU_CAPABILITY can lower it) and the CPU's
    /proc/cpuinfo flags (for avx512_bf16, which ATen does not report); None when the kernels cannot run."""
    if capability == "AVX512":
        return AVX512_BF16 if "avx512_bf16" in cpu_flags else AVX512
    if capability == "AVX2":
        return AVX2
    return None


def compile_flags(isa: CpuKernelIsa, march: str = "native") -> tuple[str, ...]:
    """Flags that compile SOURCES for `isa` (without -shared: tests compile single objects with them; without
    include_flags(), which name this installation's paths and stay out of the build key).
    -ffp-contract=off: a multiply then an add stay two roundings, as in torch's separate ops."""
    return ("-O3", f"-march={march}", *isa.machine_flags, "-ffp-contract=off", "-fopenmp", "-fPIC", "-std=c++20",
            f"-DCPU_CAPABILITY={isa.capability}", f"-DCPU_CAPABILITY_{isa.capability}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")


def include_flags() -> tuple[str, ...]:
    """-I flags for torch's headers."""
    return tuple(f"-I{path}" for path in cpp_extension.include_paths())


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (what -march=native compiles for); empty where /proc/cpuinfo is missing."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _build_key(compiler: str, isa: CpuKernelIsa) -> str:
    digest = hashlib.sha256()
    for source in SOURCES + HEADERS:
        digest.update(source.read_bytes())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    for part in (torch.__version__, version, " ".join(compile_flags(isa)), platform.machine(), platform.processor(),
                 " ".join(sorted(cpu_flags()))):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _compile(compiler: str, isa: CpuKernelIsa, target: Path) -> None:
    """Compile SOURCES into `target` atomically (a partial library is never visible)."""
    torch_lib = Path(torch.__file__).parent / "lib"
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as staging:
        command = [compiler, *compile_flags(isa), *include_flags(), "-shared", *map(str, SOURCES), "-o", staging.name,
                   f"-L{torch_lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{torch_lib}"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            os.unlink(staging.name)
            raise RuntimeError(f"{' '.join(command[:3])} ... failed:\n{done.stderr[-2000:]}")
        os.replace(staging.name, target)


def _library_path(isa: CpuKernelIsa) -> Path:
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH)")
    directory = default_cache_dir() / "kernels" / _build_key(compiler, isa)
    target = directory / LIBRARY_NAME
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            logger.info("building the CPU kernels for %s into %s (once per machine, about 15 s)", isa.name, directory)
            _compile(compiler, isa, target)
    return target


@functools.cache
def cpu_kernel_isa() -> CpuKernelIsa | None:
    """The ISA of the loaded `torch.ops.splitserve_cpu` (built and loaded by the first call); None, said
    once in the log, when this CPU or machine cannot run them."""
    capability = torch.backends.cpu.get_cpu_capability()
    isa = detect_isa(capability, cpu_flags()) if platform.machine() in ("x86_64", "AMD64") else None
    if isa is None:
        logger.warning("the CPU kernels need AVX2+FMA or AVX-512; this CPU has neither (ATen capability %s): "
                       "using the pure-torch path", capability)
        return None
    try:
        torch.ops.load_library(str(_library_path(isa)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("CPU kernels unavailable, using the pure-torch path: %s", error)
        return None
    logger.info("CPU kernels loaded (%s)", isa.name)
    return isa


def load_cpu_kernels() -> bool:
    """True once `torch.ops.splitserve_cpu` is loaded; False (logged once) when it cannot be built."""
    return cpu_kernel_isa() is not None
