"""Regenerate the Python code for every `.proto` under proto/ (the one way to do it).

Usage: `.venv/bin/python proto/regenerate.py [--out DIR]`

The sources live in proto/splitserve (splitserve's own API) and proto/inference (below). Runs
grpc_tools.protoc with `-I proto`, so a source `proto/splitserve/v1/x.proto` is known to
protobuf as `splitserve/v1/x.proto` (the name reflection and other languages see) and yields
`x_pb2.py`, `x_pb2.pyi` and `x_pb2_grpc.py` in `DIR/splitserve/v1/` (DIR defaults to proto/,
i.e. next to the sources, where they are checked in). protoc writes cross-file imports as
`from splitserve.v1 import ...`; the installed package is `splitserve.proto.splitserve.v1`,
so those imports are rewritten.

proto/inference holds the router's subset of the KServe v2 / Triton protocol (package
`inference`). tritonclient registers its own full copy of that package in protobuf's default
descriptor pool, and one pool refuses a second definition of a symbol, so the code generated
for it registers into a private pool instead: both import in one process (the wire format is
the same; only the Python descriptors are separate).

The output is a pure function of the sources and the pinned grpcio-tools version:
tests/test_proto.py regenerates into a temporary directory and requires byte-identical files.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
"""The `-I` root: proto names are relative to it (`splitserve/v1/generation.proto`)."""

SOURCE_DIRS = ("splitserve", "inference")
"""The folders under the -I root that hold sources (each a proto package's top level)."""

PRIVATE_POOL_DIRS = ("inference",)
"""Source folders whose generated messages register into a private descriptor pool, because
another library registers the same proto package in the default pool."""

GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
"""The files protoc writes for each source, in the source's directory."""

PACKAGE_PREFIX = "splitserve.proto."
"""Prepended to imports of generated modules: the proto root is installed as `splitserve.proto`."""

_ABSOLUTE_IMPORT = re.compile(rf"^([ \t]*)from ({'|'.join(SOURCE_DIRS)})\b", re.MULTILINE)
"""protoc writes every cross-file import as `from <package> import <module>_pb2 as <alias>`
(`from splitserve.v1 import ...`, `from inference import ...`)."""

_DEFAULT_POOL = "_descriptor_pool.Default().AddSerializedFile("
_PRIVATE_POOL = "_descriptor_pool.DescriptorPool().AddSerializedFile("
"""How a generated `_pb2.py` registers its file: into the default pool, or a fresh one of its own."""


def proto_sources(root: Path = PROTO_ROOT) -> list[Path]:
    """Every `.proto` under the SOURCE_DIRS of root, sorted, relative to root."""
    return sorted(path.relative_to(root) for folder in SOURCE_DIRS for path in (root / folder).rglob("*.proto"))


def generated_files(out_dir: Path, root: Path = PROTO_ROOT) -> list[Path]:
    """The files a run writes into out_dir, sorted (whether or not they exist yet)."""
    stems = [source.with_suffix("") for source in proto_sources(root)]
    return sorted(out_dir / f"{stem}{suffix}" for stem in stems for suffix in GENERATED_SUFFIXES)


def _run_protoc(out_dir: Path, root: Path) -> None:
    well_known_types = resources.files("grpc_tools") / "_proto"
    args = ["grpc_tools.protoc", f"-I{root}", f"-I{well_known_types}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *map(str, proto_sources(root))]
    # protoc resolves the sources against the -I roots, so they are passed relative to root.
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")


def _rewrite_imports(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    path.write_text(_ABSOLUTE_IMPORT.sub(rf"\1from {PACKAGE_PREFIX}\2", text), encoding="utf-8")


def _use_private_pool(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    if text.count(_DEFAULT_POOL) != 1:
        raise RuntimeError(f"{path}: expected one `{_DEFAULT_POOL}` in protoc's output")
    path.write_text(text.replace(_DEFAULT_POOL, _PRIVATE_POOL), encoding="utf-8")


def regenerate(out_dir: Path = PROTO_ROOT, root: Path = PROTO_ROOT) -> list[Path]:
    """Generate code for every source under root into out_dir; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _run_protoc(out_dir, root)
    files = generated_files(out_dir, root)
    for path in files:
        _rewrite_imports(path)
        if path.name.endswith("_pb2.py") and path.relative_to(out_dir).parts[0] in PRIVATE_POOL_DIRS:
            _use_private_pool(path)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT,
                        help="output root (default: the proto/ directory, next to the sources)")
    args = parser.parse_args(argv)
    for path in regenerate(args.out.resolve()):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
