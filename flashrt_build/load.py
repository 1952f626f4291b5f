"""Load a built package as a drop-in `torch.nn.Module`, after checking it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .errors import ArtifactError
from .manifest import PACKAGE, file_sha256, read_manifest
from .package import load_package


class LoadedModule(torch.nn.Module):
    """A compiled package behind the `nn.Module` call interface.

    Inputs may be passed by position or by name, like the eager module;
    constant keyword arguments fixed at build time (`use_cache`) are filled in,
    and passing a different value is an error, not a silent no-op.
    """

    def __init__(self, runner: Any, manifest: dict[str, Any], output_dir: Path) -> None:
        super().__init__()
        self._runner = runner
        self.manifest = manifest
        self.output_dir = output_dir
        self._constant_kwargs = dict(manifest["config"]["module"].get("kwargs") or {})
        inputs = manifest["inputs"]
        self._positional = [i["name"] for i in inputs if i["positional"]]
        self._keyword = [i["name"] for i in inputs if not i["positional"]]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        for key, value in list(kwargs.items()):
            if key in self._constant_kwargs:
                if value != self._constant_kwargs[key]:
                    raise ValueError(
                        f"{key}={value!r} differs from the value the package was built with "
                        f"({self._constant_kwargs[key]!r}, module.kwargs.{key})"
                    )
                del kwargs[key]
        order = self._positional + self._keyword
        if len(args) > len(order):
            raise TypeError(f"the package takes {len(order)} inputs ({', '.join(order)}), got {len(args)} positional")
        bound = dict(zip(order, args, strict=False))
        for key, value in kwargs.items():
            if key in bound or key not in order:
                problem = "given twice" if key in bound else "not an input of the package"
                raise TypeError(f"input '{key}' is {problem}; inputs: {', '.join(order)}")
            bound[key] = value
        missing = [name for name in order if name not in bound]
        if missing:
            raise TypeError(f"missing inputs: {', '.join(missing)}")
        return self._runner(
            *(bound[n] for n in self._positional), **{n: bound[n] for n in self._keyword}, **self._constant_kwargs
        )

    def constant_fqns(self) -> list[str]:
        return list(self._runner.get_constant_fqns())


def check_package(output_dir: Path, manifest: dict[str, Any]) -> Path:
    """The package path, once its sha256 matches the manifest."""
    path = output_dir / manifest["package"]["file"]
    if not path.is_file():
        raise ArtifactError(f"{path} is missing")
    digest = file_sha256(path)
    if digest != manifest["package"]["sha256"]:
        raise ArtifactError(
            f"{path} was altered after its build: sha256 {digest} differs from the manifest's "
            f"{manifest['package']['sha256']}; refusing to load it"
        )
    return path


def load(output_dir: str | Path, weights: Any = None, device: str | torch.device | None = None) -> LoadedModule:
    """Load the package in `output_dir` after checking it against its manifest."""
    output_dir = Path(output_dir)
    manifest = read_manifest(output_dir)
    if weights is not None or manifest["weights"]["mode"] != "baked":
        raise ArtifactError("only baked-weights packages can be loaded by this version")
    path = check_package(output_dir, manifest)
    device_index = -1
    if device is not None and torch.device(device).type == "cuda":
        device_index = torch.device(device).index or 0
    return LoadedModule(load_package(path, device_index), manifest, output_dir)


__all__ = ["PACKAGE", "LoadedModule", "load"]
