"""Regenerate the Python code for every `.proto` under proto/splitserve (the one way to do it).

Usage: `.venv/bin/python proto/regenerate.py [--out DIR]`

Runs grpc_tools.protoc with `-I proto`, so a source `proto/splitserve/v1/x.proto` is known to
protobuf as `splitserve/v1/x.proto` (the name reflection and other languages see) and yields
`x_pb2.py`, `x_pb2.pyi` and `x_pb2_grpc.py` in `DIR/splitserve/v1/` (DIR defaults to proto/,
i.e. next to the sources, where they are checked in). protoc writes cross-file imports as
`from splitserve.v1 import ...`; the installed package is `splitserve.proto.splitserve.v1`,
so those imports are rewritten. The output is a pure function of the sources and the pinned
grpcio-tools version: tests/test_proto.py regenerates into a temporary directory and
requires byte-identical files.
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

GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
"""The files protoc writes for each source, in the source's directory."""

PACKAGE_PREFIX = "splitserve.proto."
"""Prepended to `splitserve.` imports: the proto root is installed as `splitserve.proto`."""

_ABSOLUTE_IMPORT = re.compile(r"^([ \t]*)from splitserve\.", re.MULTILINE)
"""protoc writes every cross-file import as `from <package> import <module>_pb2 as <alias>`."""


def proto_sources(root: Path = PROTO_ROOT) -> list[Path]:
    """Every `.proto` under root/splitserve, sorted, relative to root."""
    return sorted(path.relative_to(root) for path in (root / "splitserve").rglob("*.proto"))


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
    path.write_text(_ABSOLUTE_IMPORT.sub(rf"\1from {PACKAGE_PREFIX}splitserve.", text), encoding="utf-8")


def regenerate(out_dir: Path = PROTO_ROOT, root: Path = PROTO_ROOT) -> list[Path]:
    """Generate code for every source under root into out_dir; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _run_protoc(out_dir, root)
    files = generated_files(out_dir, root)
    for path in files:
        _rewrite_imports(path)
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
