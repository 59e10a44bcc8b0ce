"""The distribution: compatible dependency ranges with the exact tested set in constraints.txt,
and a wheel that carries the configs, Prometheus rules, Grafana dashboards and .proto files, so
`splitserve serve --config local` works outside the repository."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tomllib
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


PACKAGE_DATA = ("splitserve/deploy/configs/local.yaml", "splitserve/deploy/prometheus/rules/splitserve-alerts.yml",
                "splitserve/deploy/prometheus/rules/splitserve-recording.yml",
                "splitserve/deploy/grafana/dashboards/splitserve-slo.json",
                "splitserve/deploy/grafana/provisioning/datasources/splitserve.yml",
                "splitserve/deploy/kuberay/raycluster.yaml",
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
