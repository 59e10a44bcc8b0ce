"""Files that ship inside the splitserve package (pyproject.toml's package-data) and how the CLI
finds them: `--config local` is deploy/configs/local.yaml wherever splitserve is installed, so
a packaged config works outside the repository as well as in it."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

CONFIG_SUFFIX = ".yaml"


def deploy_dir() -> Path:
    """The installed deploy/ folder (the source folder itself in an editable install)."""
    return Path(str(resources.files("splitserve.deploy")))


def packaged_configs() -> dict[str, Path]:
    """The cluster configs that ship with splitserve, by name (the file name without .yaml)."""
    folder = deploy_dir() / "configs"
    return {path.name.removesuffix(CONFIG_SUFFIX): path for path in sorted(folder.glob(f"*{CONFIG_SUFFIX}"))}


def resolve_config(value: str | Path, flag: str = "--config") -> Path:
    """A --config value as a file: an existing path as given, else a packaged config's name
    (`local` or `local.yaml`). FileNotFoundError naming `flag` and both readings when it is neither."""
    path = Path(value).expanduser()
    if path.is_file():
        return path
    packaged = packaged_configs()
    name = str(value).removesuffix(CONFIG_SUFFIX)
    if name in packaged:
        return packaged[name]
    raise FileNotFoundError(f"{flag} {str(value)!r}: no such file, and not a packaged config (packaged: "
                            f"{', '.join(packaged) or 'none'})")
