"""A build from a module object, as `torch.export.export(model, args)` takes
one:

    flashrt_build.build(model, example_inputs=(x,), dynamic_shapes={"x": {0: Dim("batch", min=1, max=64)}},
                        weights="external")

The object becomes the config's module: its inputs from the examples (an
integer input's values from `input_ranges`, as the config's low/high), its
dynamic dimensions from `dynamic_shapes`, its `_target_` this module's
`given`, which hands the build a copy (the caller's object is never cast,
rewritten by a pass or put in eval mode). The rest is the config's, composed
by Hydra as the command line composes it (`overrides`), and the build is the
config's: exported, compiled, verified against the object as given, with a
manifest that records the object's class and source file.

What the object is keys the build: a digest of its pickle (class,
attributes and tensors), so an unchanged object's rebuild is up to date. An
object that does not pickle (a hook that is a local function) is built every
time, and the log says why. `release=true` refuses it: a release must be
rebuilt from its manifest, and no manifest can make an object again."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch

from .errors import BuildError, ConfigError
from .object_inputs import as_argument, inputs_as_arguments, module_inputs
from .runtime.dtypes import dtype_name
from .stages.objects import GIVEN, graph_code, handing, object_digest

log = logging.getLogger("flashrt_build")


def build_module(
    module: torch.nn.Module,
    example_inputs: Sequence[Any] | None,
    *,
    dynamic_shapes: Mapping[str, Any] | Sequence[Any] | None = None,
    input_ranges: Mapping[str, tuple[int, int]] | None = None,
    name: str | None = None,
    weights: str = "baked",
    target: str = "cpu",
    dtype: str | None = None,
    output_root: str | Path | None = None,
    output_dir: str | Path | None = None,
    overrides: Sequence[str] = (),
    config_dir: str | Path | None = None,
    cwd: Path | None = None,
) -> Any:
    """Build `module` as a config of it would build: `example_inputs` its
    forward's positional inputs, `dynamic_shapes` torch.export's (by input
    name or position: {axis: Dim(name, min=, max=)}), `input_ranges` the
    values an integer input takes ({"ids": (0, vocab)}: verified over, and
    every call checked against), `weights` and `target` the config groups'
    values, `dtype` the target's (default: the module's floating dtype),
    `output_root` and `output_dir` where it goes (the keys'), `overrides` any
    other keys as the command line gives them (`["verify.rtol=1e-3"]`).
    Returns the BuildResult."""
    from .config.compose import compose
    from .pipeline import build
    from .stages.preflight import real_name

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(module).__name__}")
    module = _checked(module, overrides)
    inputs = module_inputs(module, example_inputs, dynamic_shapes, input_ranges)
    label = name if name is not None else _name_of(module)
    dtype = dtype or _floating_dtype(module)
    chosen = [f"weights={weights}", f"target={target}", *([f"target.dtype={dtype}"] if dtype else [])]
    chosen += _places(overrides, name=name, output_root=output_root, output_dir=output_dir)
    cfg = _not_a_release(compose([*chosen, *overrides], config_dir=config_dir))
    examples = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs or ())
    digest, why = object_digest(module, graph_code(module, examples, dynamic_shapes))
    if why is not None:
        log.warning("%s: built every time: the object cannot be keyed by what it is (%s)", label, why)
    from omegaconf import OmegaConf, open_dict

    from .config.schema import ModuleConfig

    with open_dict(cfg):
        model = {"_target_": GIVEN, "digest": digest}
        cfg.module = OmegaConf.merge(
            OmegaConf.structured(ModuleConfig), {"name": label, "model": model, "inputs": inputs}
        )
    _check_namesake(cfg, cwd, module, name is None)
    with handing(digest, module):
        try:
            return build(cfg, cwd)
        except ConfigError as exc:  # a key the config of the object has, as the argument the caller gave
            raise as_argument(exc, list(inputs), real_name(type(module)) or type(module).__name__) from None
        except BuildError as exc:  # an example the stages name by its config key
            exc.args = (inputs_as_arguments(str(exc), list(inputs)),)
            raise


def _places(overrides: Sequence[str], **given: str | Path | None) -> list[str]:
    """The overrides for the keywords that say where the build goes (`name`
    checked only), each a non-empty path or text, and not also an override."""
    for key, value in given.items():
        if value is not None and (not isinstance(value, (str, Path)) or not str(value)):
            raise TypeError(f"{key}: expected a non-empty path or text, got {value!r}")
    places = {key: value for key, value in given.items() if key != "name" and value}
    for key in places:
        if twice := [o for o in overrides if o.lstrip("+~").split("=")[0] == key]:
            raise ConfigError("overrides", twice, f"{key} is given as a keyword too: give it once", "argument")
    return [f"{key}={value}" for key, value in places.items()]


def _checked(module: torch.nn.Module, overrides: Sequence[str]) -> torch.nn.Module:
    """The module to build, its `overrides` checked: a list of texts, none of
    them the `module` the object is; torch.compile's wrapper gives its module."""
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        expected = "expected a list of key=value texts, as the command line gives them"
        raise TypeError(f"overrides: {expected}, got {overrides!r}")
    if taken := [o for o in overrides if o.lstrip("+~").split("=")[0].split(".")[0] == "module"]:
        expected = "the module is the object given (name=... names it; its inputs are the examples)"
        raise ConfigError("overrides", taken, expected, "argument")
    wrapped = getattr(module, "_orig_mod", None)
    if isinstance(wrapped, torch.nn.Module):
        log.info("building the module torch.compile wraps (%s): AOTInductor compiles it", type(wrapped).__name__)
        return wrapped
    return module


def _not_a_release(cfg: Any) -> Any:
    if cfg.get("release"):
        raise ConfigError(
            "release",
            True,
            "a module object cannot be a release: repro rebuilds a release from its manifest, which cannot make "
            "the object again; give its class as module.model._target_ in a config",
        )
    return cfg


def _check_namesake(cfg: Any, cwd: Path | None, module: torch.nn.Module, named_by_class: bool) -> None:
    """The folder named after the object's class holds no build of another
    class of that name (`pkga.net.Net` and `pkgb.net.Net`): its artifact
    would be replaced by another model's."""
    import json

    from .config.paths import derive_output_dir
    from .stages.preflight import real_name

    if not named_by_class or cfg.get("output_dir"):
        return
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # the folder as the build derives it
    manifest = derive_output_dir(cast(dict[str, Any], config), cwd or Path.cwd()) / "manifest.json"
    try:
        built = (json.loads(manifest.read_text()).get("module") or {}).get("object") or {}
    except (OSError, ValueError, AttributeError):
        return
    if built.get("class") not in (None, real_name(type(module))):
        raise ConfigError(
            "name", None, f"{manifest.parent} holds the build of {built['class']}, another class than "
            f"{real_name(type(module))}: name=... gives this one a folder of its own", "argument",
        )  # fmt: skip


def _name_of(module: torch.nn.Module) -> str:
    """The output folder's name for an object: its class's, lowercased."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", type(module).__name__).lower() or "module"


def _floating_dtype(module: torch.nn.Module) -> str | None:
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point():
            return dtype_name(tensor.dtype)
    return None
