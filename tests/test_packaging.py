"""The distribution: compatible dependency ranges with the exact tested set in constraints.txt,
and a wheel that carries the configs, Prometheus rules, Grafana dashboards and .proto files, so
`splitserve serve --config local` works outside the repository."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from splitserve.deploy.cluster_config import default_cluster_config, load_cluster_config, parse_cluster_config
from splitserve.deploy.cli import main as cli_main
from splitserve.deploy.packaged import packaged_configs, resolve_config

REPO = Path(__file__).parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def constraint_pins() -> dict[str, str]:
    lines = (REPO / "constraints.txt").read_text(encoding="utf-8").splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def requirements(*groups: str) -> list[Requirement]:
    project = PYPROJECT["project"]
    listed = [*project["dependencies"], *(d for g in groups for d in project["optional-dependencies"][g])]
    return [Requirement(text) for text in listed]


def test_every_source_package_is_in_the_distribution():
    """Each folder with an __init__.py under a mapped folder is a listed package mapped to that folder
    (an unlisted one is importable from the repository but missing from the wheel)."""
    package_dir = PYPROJECT["tool"]["setuptools"]["package-dir"]
    top_level = {d.split("/")[0] for d in package_dir.values()}
    folders = {str(init.parent.relative_to(REPO)) for top in top_level for init in (REPO / top).rglob("__init__.py")}
    assert folders == set(package_dir.values())
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]) == set(package_dir)


def test_runtime_dependencies_are_ranges_that_admit_the_tested_pins():
    pins = constraint_pins()
    for requirement in requirements():
        assert not any(spec.operator == "==" for spec in requirement.specifier), requirement
        assert requirement.specifier.contains(pins[requirement.name]), (requirement, pins[requirement.name])


def test_constraints_pin_exactly_every_declared_dependency():
    declared = {r.name: r for r in requirements("dev", "bench", "gpu")}
    pins = constraint_pins()
    assert set(pins) == set(declared)
    assert all(declared[name].specifier.contains(version) for name, version in pins.items())


def test_make_installs_the_constraints():
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert "$(STAMP): pyproject.toml constraints.txt" in makefile
    assert "pip install --quiet -c constraints.txt -e '.[dev,bench]'" in makefile


def test_the_gpu_extra_is_optional_and_the_cpu_install_stays_lean():
    """flashinfer only in `splitserve[gpu]`, which make never installs; the CPU torch pin is what it resolves."""
    project = PYPROJECT["project"]
    assert [Requirement(d).name for d in project["optional-dependencies"]["gpu"]] == ["flashinfer-python", "nixl-cu12"]
    assert not any(Requirement(d).name.startswith("flashinfer") for d in project["dependencies"])
    assert "[gpu" not in (REPO / "Makefile").read_text(encoding="utf-8")
    assert constraint_pins()["torch"] == "2.13.0"


def test_packaged_config_by_name_or_path(tmp_path):
    assert packaged_configs() == {"local": REPO / "deploy" / "configs" / "local.yaml"}
    assert resolve_config("local") == resolve_config("local.yaml") == packaged_configs()["local"]
    own = tmp_path / "local"
    own.write_text("model: /mine\n")
    assert resolve_config(own) == own  # a file wins over the packaged name
    with pytest.raises(FileNotFoundError, match=r"--config 'nope': no such file, and not a packaged config "
                                                r"\(packaged: local\)"):
        resolve_config("nope")


def test_config_print_writes_the_defaults_or_a_packaged_config(capsys):
    assert cli_main(["config", "--print"]) == 0
    assert parse_cluster_config(capsys.readouterr().out) == default_cluster_config("default")
    assert cli_main(["config", "--print", "local"]) == 0
    assert capsys.readouterr().out == (REPO / "deploy" / "configs" / "local.yaml").read_text(encoding="utf-8")
    assert load_cluster_config(resolve_config("local")).model == "default"


def test_config_print_of_an_unknown_name_names_its_own_flag(capsys):
    assert cli_main(["config", "--print", "nope"]) == 2
    assert capsys.readouterr().err == ("splitserve: error: config --print 'nope': no such file, and not a packaged "
                                       "config (packaged: local)\n")


PACKAGE_DATA = ("splitserve/deploy/configs/local.yaml", "splitserve/deploy/prometheus/rules/splitserve-alerts.yml",
                "splitserve/deploy/prometheus/rules/splitserve-recording.yml",
                "splitserve/deploy/grafana/dashboards/splitserve-slo.json",
                "splitserve/deploy/grafana/provisioning/datasources/splitserve.yml",
                "splitserve/deploy/kuberay/raycluster.yaml", "splitserve/deploy/kuberay-several-routers/routers.yaml",
                "splitserve/proto/splitserve/v1/generation.proto", "splitserve/proto/inference/grpc_service.proto",
                "splitserve/engine/csrc/paged_attention.cpp")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the sources (the build leaves nothing in the repository)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    top_level = {d.split("/")[0] for d in PYPROJECT["tool"]["setuptools"]["package-dir"].values()}
    for folder in top_level:
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(source)], check=True, capture_output=True, timeout=300)
    return next(out.glob("splitserve-*.whl"))


@pytest.mark.slow
def test_wheel_carries_configs_rules_dashboards_and_protos(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert [name for name in PACKAGE_DATA if name not in names] == []
    dashboards = {n for n in names if n.startswith("splitserve/deploy/grafana/dashboards/")}
    assert dashboards == {f"splitserve/deploy/grafana/dashboards/{p.name}"
                          for p in (REPO / "deploy/grafana/dashboards").glob("*.json")}


@pytest.mark.slow
def test_installed_wheel_serves_its_packaged_config_outside_the_repository(wheel, tmp_path):
    """The wheel installed into a folder of its own, run from outside the repository: `--config
    local` is found inside the installed package (it reaches the port check, so it was parsed)."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    code = ("import sys; sys.path.insert(0, sys.argv.pop(1)); from splitserve.deploy.packaged import deploy_dir; "
            "from splitserve.deploy.cli import main; print(deploy_dir(), flush=True); sys.exit(main())")
    listed = subprocess.run([sys.executable, "-c", code, str(site), "config", "--list"], capture_output=True,
                            text=True, cwd=tmp_path, timeout=60)
    deploy = site / "splitserve" / "deploy"
    assert listed.stdout.splitlines() == [str(deploy), f"local\t{deploy}/configs/local.yaml"]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        served = subprocess.run([sys.executable, "-c", code, str(site), "serve", "--config", "local", "--port",
                                 str(port)], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert served.returncode == 2
    assert served.stderr == (f"splitserve: error: router.http_port (--port): cannot listen on 127.0.0.1:{port}: "
                             "Address already in use\n")


# ---- the wheel in a fresh environment -----------------------------------------------------------

WHEEL_SERVE_TIMEOUT_S = 240
"""Cluster start in the fresh environment (Ray, two workers loading the embedded model)."""
FRESH_VENV_OPT_IN = "SPLITSERVE_WHEEL_TEST"
"""The fresh-venv test runs only with this variable set to 1 (`make wheel-check` sets it): its pip
install alone took 3 min 21 s on the 2-core development machine (torch from the machine's wheel
store, the rest from the registry), so it is not part of `make test`."""


def _pip_works_offline_or_online(python: Path) -> bool:
    """pip can resolve the pinned torch (the machine's wheel store or a registry); the test is
    skipped only when it cannot."""
    done = subprocess.run([str(python), "-m", "pip", "download", "--quiet", "--no-deps", "-c",
                           str(REPO / "constraints.txt"), "--dest", str(python.parents[2] / "probe"), "torch"],
                          capture_output=True, timeout=300)
    return done.returncode == 0


def _fresh_venv(root: Path, wheel: Path) -> Path:
    """A venv outside the repository with the wheel and its dependencies at constraints.txt's pins
    (torch first, pinned, so no CUDA build is resolved); returns its bin folder."""
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    if not _pip_works_offline_or_online(python):
        pytest.skip("pip cannot fetch the pinned torch here (no wheel store, no registry)")
    for target in ("torch", str(wheel)):
        done = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-c", str(REPO / "constraints.txt"),
                               target], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr
    return root / "bin"


class _Output:
    """Drains a process's output on a thread (a full pipe would block the server) and says when a
    line containing `marker` arrives."""

    def __init__(self, process: subprocess.Popen, marker: str) -> None:
        self.lines: list[str] = []
        self.found: str | None = None
        self._marker = marker
        self._seen = threading.Event()
        self._thread = threading.Thread(target=self._drain, args=(process,), daemon=True)
        self._thread.start()

    def _drain(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self.lines.append(line)
            if self.found is None and self._marker in line:
                self.found = line
                self._seen.set()
        self._seen.set()  # the process ended

    def wait(self, timeout_s: float) -> str:
        self._seen.wait(timeout_s)
        assert self.found is not None, f"no {self._marker!r} within {timeout_s} s:\n{self.text()}"
        return self.found

    def text(self) -> str:
        return "".join(self.lines)

    def close(self) -> None:
        self._thread.join(30)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get(FRESH_VENV_OPT_IN) != "1",
                    reason=f"about 4.5 minutes: run `make wheel-check` (sets {FRESH_VENV_OPT_IN}=1)")
def test_the_wheel_in_a_fresh_venv_serves_a_request_with_its_packaged_config(wheel, tmp_path):
    """`pip install` of the wheel into a new venv outside the repository, then `splitserve serve
    --config local` (the packaged config, the embedded model) answers one OpenAI request, and
    SIGTERM stops it with status 0."""
    bin_dir = _fresh_venv(tmp_path / "venv", wheel)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    process = subprocess.Popen([str(bin_dir / "splitserve"), "serve", "--config", "local", "--port", "0",
                                "--grpc-port", "0", "--metrics-port", "0"], cwd=tmp_path, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = _Output(process, "OpenAI API: http://")
    try:
        base = output.wait(WHEEL_SERVE_TIMEOUT_S).split("OpenAI API: ", 1)[1].strip()
        body = json.dumps({"prompt": "def ", "max_tokens": 8, "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"{base}/completions", body, {"Content-Type": "application/json"})
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=120) as response:
            reply = json.load(response)
        assert (response.status, reply["model"], reply["usage"]["completion_tokens"]) == (200, "default", 8)
        assert reply["choices"][0]["text"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(120) == 0, output.text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        output.close()
