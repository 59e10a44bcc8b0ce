"""The dependency rules of design.md section 1, enforced by parsing every module (ast), not by convention.

Per file, every import is checked: module level, inside functions, relative (`from ..engine import x`)
and literal `importlib.import_module("...")` / `__import__("...")` calls.

- `splitserve.<folder>` imports follow the "may import" column of the design's table (a folder may
  always import itself); this holds under `if TYPE_CHECKING:` too, since it is about the design's layering.
- `router/` never imports torch or transformers, neither directly nor through any splitserve module
  it reaches (checked statically here, and at runtime in a fresh interpreter for third-party chains).
- `common/` imports only the standard library and numpy; imports under `if TYPE_CHECKING:` are exempt.
- Only `kv_transfer/nixl_backend.py` imports NIXL (`nixl`, `nixl_cu12`, ...), in any folder.
- Only `engine/attention/flashinfer.py` imports flashinfer (an optional extra, CUDA only), and not at module
  level, so every module imports on a CPU install (tests/ may import it, to skip without it).
- Only the router's metrics server (`router/metrics_server.py`) imports prometheus_client; cores return
  stats dataclasses (tests and benchmarks, which observe servers from outside, are not held to this).
- Only `tests/` imports its own modules (`tests.factories`, `conftest`, ...): what bench/ or the
  product shares with the tests lives in `testing/` (`splitserve.testing`), one import path.

A failure names the file, the line, the statement and the rule it breaks.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DIST = "splitserve"

PRODUCT_FOLDERS = ("common", "engine", "kv_transfer", "prefill_worker", "decode_worker", "router", "planner",
                   "proto", "eval", "deploy", "testing")
FOLDERS = (*PRODUCT_FOLDERS, "bench", "tests")
_EVERYTHING = frozenset(PRODUCT_FOLDERS)

# design.md section 1, the "may import" column: the splitserve packages each folder may import besides itself.
ALLOWED: Mapping[str, frozenset[str]] = {
    "common": frozenset(),
    "engine": frozenset({"common"}),
    "kv_transfer": frozenset({"common", "proto"}),
    "prefill_worker": frozenset({"engine", "kv_transfer", "common"}),
    "decode_worker": frozenset({"engine", "kv_transfer", "common"}),
    "router": frozenset({"common", "proto"}),
    "planner": frozenset({"common"}),
    "eval": frozenset({"engine", "common"}),  # model quality through the engine (docs/models.md)
    "proto": frozenset(),
    "deploy": _EVERYTHING,
    "testing": _EVERYTHING,  # test infrastructure shipped with the product, shared by tests/ and bench/
    "bench": _EVERYTHING,
    "tests": _EVERYTHING,
}

ROUTER_FORBIDDEN = frozenset({"torch", "transformers"})
COMMON_THIRD_PARTY = frozenset({"numpy"})
NIXL_MODULE = "kv_transfer/nixl_backend.py"
FLASHINFER_MODULE = "engine/attention/flashinfer.py"
PROMETHEUS = "prometheus_client"
PROMETHEUS_MODULE = "router/metrics_server.py"
PROMETHEUS_OBSERVERS = frozenset({"bench", "tests"})
"""Folders that scrape or parse metrics from outside the product."""
TESTS_MODULES = frozenset({"tests", *(file.stem for file in (REPO / "tests").glob("*.py"))})
"""Top-level names that reach tests/: the package, or one of its modules on a sys.path entry."""
ROUTER_ENTRY_MODULES = ("splitserve.router.server", "splitserve.router.orchestrator", "splitserve.router.tokenizer",
                        "splitserve.router.metrics_server", "splitserve.router.openai_server")
# Top-level folders that are not source: build outputs and the like.
NON_SOURCE_DIRS = frozenset({"build", "dist", "docs"})

# "folder/file.py" -> why its (reported) violation is tolerated for now. Strict: fixing it fails the
# xfail, so the entry is removed together with the violation.
KNOWN_VIOLATIONS: Mapping[str, str] = {}


@dataclass(frozen=True)
class Import:
    """One imported module, as found in `path` (a repo-relative file) at `line`."""

    path: str
    line: int
    statement: str
    """The source text of the import (one line), for messages."""
    module: str
    """Absolute dotted name; relative imports are resolved against the file's package."""
    names: tuple[str, ...]
    """For `from m import a, b`: ("a", "b"), which may be submodules of `module`; else ()."""
    typing_only: bool
    """Inside `if TYPE_CHECKING:`: never executed at runtime."""

    @property
    def top_level(self) -> str:
        return self.module.split(".")[0]

    def splitserve_folders(self) -> set[str]:
        """The splitserve subpackages (folders) this import reaches."""
        parts = self.module.split(".")
        if parts[0] != DIST:
            return set()
        if len(parts) > 1:
            return {parts[1]}
        return {name for name in self.names if name != "*"}  # `from splitserve import engine`

    def where(self) -> str:
        return f"{self.path}:{self.line}: `{self.statement}`"


def folder_of(path: str) -> str:
    return path.split("/", 1)[0]


def module_name(path: str) -> str:
    """Dotted module name of a repo-relative file: engine/models/llama.py -> splitserve.engine.models.llama.

    bench/ and tests/ are not packages; their files get names under the folder anyway (never imported)."""
    parts = path[:-len(".py")].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([DIST, *parts])


def _package_of(path: str) -> str:
    name = module_name(path)
    return name if path.endswith("/__init__.py") else name.rsplit(".", 1)[0]


def _resolve_relative(path: str, level: int, module: str | None, line: int) -> str:
    package = _package_of(path).split(".")
    if level - 1 >= len(package):
        raise ValueError(f"{path}:{line}: relative import goes above the top-level package")
    base = package[:len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _literal_import_call(node: ast.Call) -> str | None:
    """The module of `importlib.import_module("m")` / `import_module("m")` / `__import__("m")`, if literal."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and not arg.value.startswith("."):
        return arg.value
    return None


class _ImportCollector(ast.NodeVisitor):
    def __init__(self, path: str, source: str) -> None:
        self.path, self.source = path, source
        self.imports: list[Import] = []
        self._typing_depth = 0

    def _add(self, node: ast.AST, module: str, names: tuple[str, ...] = ()) -> None:
        statement = " ".join((ast.get_source_segment(self.source, node) or "").split())
        self.imports.append(Import(self.path, node.lineno, statement, module, names, self._typing_depth > 0))

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self.visit(node.test)
        self._typing_depth += 1
        for child in node.body:
            self.visit(child)
        self._typing_depth -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        names = tuple(alias.name for alias in node.names)
        module = node.module or ""
        if node.level:
            module = _resolve_relative(self.path, node.level, node.module, node.lineno)
        self._add(node, module, names)

    def visit_Call(self, node: ast.Call) -> None:
        module = _literal_import_call(node)
        if module is not None:
            self._add(node, module)
        self.generic_visit(node)


def imports_in_source(path: str, source: str) -> list[Import]:
    """Every import in `source` (the text of repo-relative `path`), at any depth."""
    collector = _ImportCollector(path, source)
    collector.visit(ast.parse(source, filename=path))
    return collector.imports


@lru_cache(maxsize=None)
def imports_in_file(path: str) -> tuple[Import, ...]:
    return tuple(imports_in_source(path, (REPO / path).read_text(encoding="utf-8")))


def _is_nixl(top_level: str) -> bool:
    return top_level == "nixl" or top_level.startswith("nixl_")


def direct_violations(path: str, imports: Iterable[Import]) -> list[str]:
    """The rules one file's own imports break, one message each."""
    folder = folder_of(path)
    messages = []
    for imp in imports:
        for target in sorted(imp.splitserve_folders()):
            if target not in ALLOWED:
                messages.append(f"{imp.where()} imports splitserve.{target}, which is not a folder of the design")
            elif target != folder and target not in ALLOWED[folder]:
                allowed = ", ".join(sorted(ALLOWED[folder]))
                scope = f"only {allowed}" if allowed else "no other splitserve package"
                messages.append(f"{imp.where()} imports splitserve.{target}: {folder}/ may import {scope}")
        top = imp.top_level
        if folder == "router" and top in ROUTER_FORBIDDEN:
            messages.append(f"{imp.where()} imports {top}: router/ must never import torch or transformers")
        if (folder == "common" and not imp.typing_only and top != DIST and top not in COMMON_THIRD_PARTY
                and top not in sys.stdlib_module_names):
            messages.append(f"{imp.where()} imports {top}: common/ imports only the standard library and numpy "
                            "(third-party imports for annotations belong under `if TYPE_CHECKING:`)")
        if _is_nixl(top) and path != NIXL_MODULE:
            messages.append(f"{imp.where()} imports {top}: only {NIXL_MODULE} imports NIXL")
        if top == "flashinfer" and path != FLASHINFER_MODULE and folder != "tests":
            messages.append(f"{imp.where()} imports flashinfer: only {FLASHINFER_MODULE} does (the optional `gpu` "
                            "extra)")
        if top == PROMETHEUS and path != PROMETHEUS_MODULE and folder not in PROMETHEUS_OBSERVERS:
            messages.append(f"{imp.where()} imports {PROMETHEUS}: only {PROMETHEUS_MODULE} (the router's metrics "
                            "server) does; cores return stats dataclasses")
        if top in TESTS_MODULES and folder != "tests":
            messages.append(f"{imp.where()} imports {top} from tests/: only tests/ does; what {folder}/ shares "
                            "with the tests lives in splitserve.testing")
    return messages


def _with_parents(module: str) -> Iterator[str]:
    """Importing a.b.c runs a/__init__, a/b/__init__ and a/b/c."""
    parts = module.split(".")
    for end in range(2, len(parts) + 1):
        yield ".".join(parts[:end])


def splitserve_edges(imports: Iterable[Import], known: Mapping[str, str]) -> set[str]:
    """The splitserve modules (keys of `known`: module name -> path) these imports execute."""
    reached = set()
    for imp in imports:
        if imp.top_level != DIST or imp.typing_only:
            continue
        candidates = [imp.module, *(f"{imp.module}.{name}" for name in imp.names)]
        for candidate in candidates:
            reached.update(module for module in _with_parents(candidate) if module in known)
    return reached


def forbidden_reach(start: str, graph: Mapping[str, set[str]], imports_of: Mapping[str, Iterable[Import]],
                    forbidden: frozenset[str]) -> list[str]:
    """A message for each `forbidden` module that a module reachable from `start` imports at runtime: its
    first import on a shortest chain (breadth-first), with the chain."""
    parent: dict[str, str | None] = {start: None}
    queue = deque([start])
    messages, reported = [], set()
    while queue:
        module = queue.popleft()
        for imp in imports_of[module]:
            if imp.top_level in forbidden - reported and not imp.typing_only and module != start:
                reported.add(imp.top_level)
                chain, step = [], module
                while step is not None:
                    chain.append(step)
                    step = parent[step]
                messages.append(f"{imp.where()} imports {imp.top_level}, reached from {start} via "
                                f"{' -> '.join(reversed(chain))}: router/ must never import it, even indirectly")
        for nxt in sorted(graph[module]):
            if nxt not in parent:
                parent[nxt] = module
                queue.append(nxt)
    return messages


def source_files() -> list[str]:
    """Repo-relative paths of every .py file in the design's folders (planner/ may not exist yet)."""
    found = []
    for folder in FOLDERS:
        for file in sorted((REPO / folder).rglob("*.py")):
            rel = file.relative_to(REPO)
            if not any(part == "__pycache__" or part.startswith(".") for part in rel.parts):
                found.append(rel.as_posix())
    return found


@lru_cache(maxsize=1)
def package_graph() -> tuple[dict[str, str], dict[str, set[str]]]:
    """(module -> path, module -> splitserve modules it imports) over the product packages."""
    known = {module_name(path): path for path in source_files() if folder_of(path) in PRODUCT_FOLDERS}
    graph = {module: splitserve_edges(imports_in_file(path), known) for module, path in known.items()}
    return known, graph


def file_violations(path: str) -> list[str]:
    messages = direct_violations(path, imports_in_file(path))
    if folder_of(path) == "router":
        known, graph = package_graph()
        imports_of = {module: imports_in_file(file) for module, file in known.items()}
        messages += forbidden_reach(module_name(path), graph, imports_of, ROUTER_FORBIDDEN)
    return messages


def _file_params() -> list:
    return [pytest.param(path, id=path, marks=[pytest.mark.xfail(strict=True, reason=KNOWN_VIOLATIONS[path])]
                         if path in KNOWN_VIOLATIONS else []) for path in source_files()]


# ---- the rules, on the real tree ------------------------------------------------------------

@pytest.mark.parametrize("path", _file_params())
def test_imports_follow_the_design(path):
    messages = file_violations(path)
    assert not messages, "\n".join(messages)


def test_the_scan_covers_the_packages():
    files = set(source_files())
    for expected in ("common/block_hash.py", "engine/engine_core.py", "engine/models/llama.py", NIXL_MODULE,
                     "prefill_worker/worker.py", "decode_worker/worker.py", "router/server.py",
                     "proto/splitserve/v1/generation_pb2.py", "deploy/cli.py", "testing/fault_scenarios.py",
                     "tests/test_import_graph.py"):
        assert expected in files, expected
    assert set(KNOWN_VIOLATIONS) <= files, "KNOWN_VIOLATIONS names a file that no longer exists"


def test_every_source_folder_is_in_the_design():
    undeclared = sorted(
        entry.name for entry in REPO.iterdir()
        if entry.is_dir() and not entry.name.startswith(".") and entry.name not in ALLOWED
        and entry.name not in NON_SOURCE_DIRS and not entry.name.endswith(".egg-info")
        and any("__pycache__" not in file.parts for file in entry.rglob("*.py")))
    assert not undeclared, (f"top-level folders with Python code that design.md section 1 does not list: "
                            f"{undeclared}; add them to the design's table (and ALLOWED here) first")


def test_importing_the_router_leaves_torch_and_transformers_out():
    # A finder that only watches: it records who imported a forbidden module, then lets the real finders run.
    code = f"""
import json, sys, traceback
FORBIDDEN = {sorted(ROUTER_FORBIDDEN)!r}
culprits = {{}}

class Watch:
    def find_spec(self, name, path=None, target=None):
        if name in FORBIDDEN and name not in culprits:
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "importlib._bootstrap" not in f.filename and f.filename != "<string>"]
            culprits[name] = [f"{{f.filename}}:{{f.lineno}}: {{f.line}}" for f in frames[-6:]]
        return None

sys.meta_path.insert(0, Watch())
report, seen = {{}}, set()
for module in {list(ROUTER_ENTRY_MODULES)!r}:
    __import__(module)
    new = [name for name in FORBIDDEN if name in sys.modules and name not in seen]
    seen.update(new)
    report[module] = {{name: culprits.get(name) for name in new}}
print(json.dumps(report))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(report) == list(ROUTER_ENTRY_MODULES)
    leaks = {module: found for module, found in report.items() if found}
    assert not leaks, "importing the router loaded " + "\n".join(
        f"{name} (after importing {module}), imported at:\n  " + "\n  ".join(stack or ["<unknown>"])
        for module, found in leaks.items() for name, stack in found.items())


# ---- the checker itself: each rule can fail, with file and line ------------------------------

def _violations(path: str, source: str) -> list[str]:
    return direct_violations(path, imports_in_source(path, source))


def test_relative_and_function_level_imports_are_resolved():
    source = ("from . import policy\n"
              "from ..engine import engine_core\n"
              "def f():\n"
              "    from ..kv_transfer.connector import ProducerConnector\n"
              "    import importlib; importlib.import_module('splitserve.planner.core')\n")
    imports = imports_in_source("router/orchestrator.py", source)
    assert [(imp.line, imp.module, imp.names) for imp in imports] == [
        (1, "splitserve.router", ("policy",)), (2, "splitserve.engine", ("engine_core",)),
        (4, "splitserve.kv_transfer.connector", ("ProducerConnector",)), (5, "importlib", ()),
        (5, "splitserve.planner.core", ())]
    assert _violations("router/orchestrator.py", source) == [
        "router/orchestrator.py:2: `from ..engine import engine_core` imports splitserve.engine: "
        "router/ may import only common, proto",
        "router/orchestrator.py:4: `from ..kv_transfer.connector import ProducerConnector` imports "
        "splitserve.kv_transfer: router/ may import only common, proto",
        "router/orchestrator.py:5: `importlib.import_module('splitserve.planner.core')` imports "
        "splitserve.planner: router/ may import only common, proto"]


def test_relative_imports_resolve_against_subpackages_and_init_files():
    assert imports_in_source("engine/models/llama.py", "from ..attention import base")[0].module == \
        "splitserve.engine.attention"
    assert imports_in_source("engine/__init__.py", "from .llm import LLM")[0].module == "splitserve.engine.llm"
    assert imports_in_source("common/x.py", "from .. import engine")[0].splitserve_folders() == {"engine"}
    with pytest.raises(ValueError, match="common/x.py:1"):
        imports_in_source("common/x.py", "from ... import engine")


def test_the_table_is_applied_per_folder():
    assert _violations("prefill_worker/w.py", "from splitserve.engine import EngineCore\n"
                                              "import splitserve.kv_transfer.connector\n") == []
    assert _violations("engine/x.py", "import splitserve.kv_transfer") == [
        "engine/x.py:1: `import splitserve.kv_transfer` imports splitserve.kv_transfer: engine/ may import only common"]
    assert _violations("common/x.py", "from splitserve import engine, common") == [
        "common/x.py:1: `from splitserve import engine, common` imports splitserve.engine: "
        "common/ may import no other splitserve package"]
    assert _violations("kv_transfer/x.py", "from splitserve.proto.splitserve.v1 import generation_pb2") == []
    assert _violations("proto/x.py", "import splitserve.common")[0].endswith(
        "proto/ may import no other splitserve package")
    assert _violations("deploy/x.py", "import splitserve.engine, splitserve.router, splitserve.planner") == []
    assert _violations("testing/x.py", "import splitserve.engine, splitserve.router, splitserve.deploy") == []
    assert _violations("bench/x.py", "from splitserve.testing.in_process_cluster import InProcessCluster") == []
    assert _violations("bench/x.py", "from splitserve.nowhere import y") == [
        "bench/x.py:1: `from splitserve.nowhere import y` imports splitserve.nowhere, which is not a folder of "
        "the design"]


def test_only_tests_import_from_tests():
    assert _violations("tests/test_x.py", "from tests.factories import make_request\nimport conftest\n") == []
    assert _violations("bench/x.py", "from tests.factories import running_cluster\n"
                                     "def f():\n    import conftest\n") == [
        "bench/x.py:1: `from tests.factories import running_cluster` imports tests from tests/: only tests/ does; "
        "what bench/ shares with the tests lives in splitserve.testing",
        "bench/x.py:3: `import conftest` imports conftest from tests/: only tests/ does; what bench/ shares "
        "with the tests lives in splitserve.testing"]
    assert _violations("testing/x.py", "from factories import GreedyCase")[0].startswith(
        "testing/x.py:1: `from factories import GreedyCase` imports factories from tests/")


def test_router_torch_rule_has_no_type_checking_exemption():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\ndef f():\n    import transformers\n"
    assert _violations("router/tokenizer.py", source) == [
        "router/tokenizer.py:3: `import torch` imports torch: router/ must never import torch or transformers",
        "router/tokenizer.py:5: `import transformers` imports transformers: router/ must never import torch or "
        "transformers"]


def test_common_allows_stdlib_numpy_and_typing_only_imports():
    source = ("from __future__ import annotations\nimport json\nimport numpy as np\nimport typing\n"
              "if typing.TYPE_CHECKING:\n    import torch\nelse:\n    import yaml\n"
              "def f():\n    from tokenizers import Tokenizer\n")
    assert _violations("common/x.py", source) == [
        "common/x.py:8: `import yaml` imports yaml: common/ imports only the standard library and numpy "
        "(third-party imports for annotations belong under `if TYPE_CHECKING:`)",
        "common/x.py:10: `from tokenizers import Tokenizer` imports tokenizers: common/ imports only the standard "
        "library and numpy (third-party imports for annotations belong under `if TYPE_CHECKING:`)"]


def test_flashinfer_has_one_home_and_is_imported_lazily():
    assert _violations(FLASHINFER_MODULE, "def f():\n    import flashinfer\n") == []
    assert _violations("engine/model_runner.py", "import flashinfer") == [
        "engine/model_runner.py:1: `import flashinfer` imports flashinfer: only engine/attention/flashinfer.py does "
        "(the optional `gpu` extra)"]
    module_level = [node for node in ast.parse((REPO / FLASHINFER_MODULE).read_text(encoding="utf-8")).body
                    if isinstance(node, (ast.Import, ast.ImportFrom))
                    and any(name.startswith("flashinfer") for name in _imported_names(node))]
    assert module_level == []


def _imported_names(node: ast.Import | ast.ImportFrom) -> list[str]:
    return [node.module or ""] if isinstance(node, ast.ImportFrom) else [alias.name for alias in node.names]


def test_nixl_and_prometheus_have_one_home():
    nixl = "try:\n    from nixl._api import nixl_agent\nexcept ImportError:\n    import nixl_cu12\n"
    assert _violations(NIXL_MODULE, nixl) == []
    assert _violations("kv_transfer/connector.py", nixl) == [
        "kv_transfer/connector.py:2: `from nixl._api import nixl_agent` imports nixl: only "
        "kv_transfer/nixl_backend.py imports NIXL",
        "kv_transfer/connector.py:4: `import nixl_cu12` imports nixl_cu12: only kv_transfer/nixl_backend.py "
        "imports NIXL"]
    assert _violations("tests/test_x.py", "import nixl")[0].startswith("tests/test_x.py:1: `import nixl`")
    prometheus = "from prometheus_client import Counter"
    assert _violations(PROMETHEUS_MODULE, prometheus) == _violations("tests/test_x.py", prometheus) == []
    assert _violations("bench/x.py", prometheus) == []
    assert _violations("engine/scheduler.py", prometheus) == [
        "engine/scheduler.py:1: `from prometheus_client import Counter` imports prometheus_client: only "
        "router/metrics_server.py (the router's metrics server) does; cores return stats dataclasses"]
    assert _violations("router/orchestrator.py", prometheus)[0].startswith(
        "router/orchestrator.py:1: `from prometheus_client import Counter` imports prometheus_client: only")
    assert _violations("deploy/local.py", prometheus)[0].startswith(
        "deploy/local.py:1: `from prometheus_client import Counter` imports prometheus_client: only")
    assert _violations("planner/core.py", "def f():\n    import prometheus_client.core\n")[0].startswith(
        "planner/core.py:2: `import prometheus_client.core` imports prometheus_client")


def test_the_router_cannot_reach_torch_through_another_package():
    files = {
        "router/server.py": "from splitserve.common import helpers\nimport grpc\n",
        "common/__init__.py": "",
        "common/helpers.py": "def f():\n    from splitserve.common.heavy import x\n",
        "common/heavy.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import transformers\nimport torch\n",
    }
    imports_of = {module_name(path): imports_in_source(path, text) for path, text in files.items()}
    known = {module_name(path): path for path in files}
    graph = {module: splitserve_edges(imports, known) for module, imports in imports_of.items()}
    assert graph["splitserve.router.server"] == {"splitserve.common", "splitserve.common.helpers"}
    assert forbidden_reach("splitserve.router.server", graph, imports_of, ROUTER_FORBIDDEN) == [
        "common/heavy.py:4: `import torch` imports torch, reached from splitserve.router.server via "
        "splitserve.router.server -> splitserve.common.helpers -> splitserve.common.heavy: router/ must never "
        "import it, even indirectly"]
