"""Structured-config schema: one dataclass per config group.

Registered in Hydra's ConfigStore as the base of `conf/config.yaml`, so every
group file is merged into a typed node: a wrong type, an unknown key or a
missing required key fails at composition (compose.py says it in one line).
Keys added on the command line with `+` escape that check; keys.py walks a
composed config against the schema to catch them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from .quant import QuantConfig


class WeightsMode(str, Enum):
    """Where the weights live: inside the package or in a safetensors sidecar."""

    baked = "baked"
    external = "external"


class StateMode(str, Enum):
    """How a package keeps the buffers its methods write (a KV cache)."""

    # The compiled code writes the bound tensors themselves: nothing is copied.
    in_place = "in_place"
    # State in, state out: each call copies every buffer twice (into the graph, back).
    threaded = "threaded"


@dataclass
class DimConfig:
    """A dynamic range for one axis of an input, turned into `torch.export.Dim`."""

    min: int = MISSING
    max: int = MISSING
    # Axes that must always be equal (input_ids and attention_mask on the
    # sequence axis) share one name; unnamed axes get `<input>_<axis>`.
    name: str | None = None


@dataclass
class InputConfig:
    """One example input of the module's forward."""

    shape: list[int] = MISSING
    dtype: str = "float32"
    # Keys are axis numbers, as YAML gives them (`0:` is an int; `Any` takes
    # it). A dotted override cannot reach one (Hydra reads `dynamic.0` as the
    # text '0'): the command line merges `++...dynamic={0: {max: 8}}` instead.
    dynamic: dict[Any, DimConfig] = field(default_factory=dict)
    # Value range for integer inputs (token ids): low inclusive, high exclusive.
    low: int | None = None
    high: int | None = None
    # Passed positionally, in the order listed, instead of by keyword.
    positional: bool = False


@dataclass
class MethodConfig:
    """One entry point of a package with several (`module.methods.NAME`)."""

    # The module method it calls; null: the method named like the entry point.
    method: str | None = None
    inputs: dict[str, InputConfig] = MISSING
    # Constant keyword arguments baked into this entry point's graph.
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RenameRule:
    """One rule of `module.checkpoint_rename`: a checkpoint name that `pattern`
    (a regular expression) matches becomes `re.sub(pattern, replace, name)`."""

    pattern: str = MISSING
    replace: str = ""


@dataclass
class ModuleConfig:
    """The module to build: what to instantiate and how to call it."""

    name: str = MISSING
    # The node given to hydra.utils.instantiate: `_target_` plus its arguments.
    model: Any = MISSING
    # The inputs of its forward. A module with several entry points lists
    # `methods` instead: one package, one weight set, each method by name.
    inputs: dict[str, InputConfig] = field(default_factory=dict)
    # Constant keyword arguments baked into the graph (use_cache: false).
    kwargs: dict[str, Any] = field(default_factory=dict)
    methods: dict[str, MethodConfig] = field(default_factory=dict)
    # The weights to build with, loaded strictly before export: a safetensors
    # file, a torch state dict, or a directory as save_pretrained writes it.
    checkpoint: str | None = None
    # Ordered renames of checkpoint names to the module's (strip a `model.`
    # prefix); the first rule that matches a name applies.
    checkpoint_rename: list[RenameRule] = field(default_factory=list)
    # Files copied beside the package (a tokenizer, a generation config): listed
    # in the manifest with their digests, inputs of the build key.
    files: list[str] = field(default_factory=list)
    # causal_lm (conf/module/causal_lm.yaml): the save_pretrained directory, the
    # static KV cache's positions and the longest prompt (null: from the
    # model's config), and the sequences decoded at once.
    pretrained: str | None = None
    max_cache_len: int | None = None
    max_prompt: int | None = None
    batch: int | None = None


@dataclass
class TargetConfig:
    """The device and dtype the module is cast to and compiled for."""

    name: str = "cpu"
    device: str = "cpu"
    dtype: str = "float32"
    # CPU instruction set level for -march (x86-64-v3, ...); null: Inductor's
    # default, -march=native, which ties a package to this CPU. release=true
    # uses x86-64-v3 when null.
    march: str | None = None
    # CUDA float32 only: TensorFloat-32 matmuls and convolutions (faster, about
    # 1e-3 relative error) in the build, its verification and every call of
    # the loaded package; false keeps full float32 precision.
    tf32: bool = False


@dataclass
class InductorConfig:
    """Inductor options passed through to AOTInductor, validated against torch's."""

    name: str = "default"
    options: dict[str, Any] = field(default_factory=dict)
    # Per method, options over `options` for that method's compile alone:
    # what suits a one-token decode step can ruin a 512-token prefill.
    methods: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class VerifyConfig:
    """Parity of the package against the eager module before publishing."""

    enabled: bool = True
    # null: the per-dtype default (flashrt_build.runtime.dtypes.DEFAULT_TOLERANCES).
    atol: float | None = None
    rtol: float | None = None
    # Calls on the example shape after the probes, so state updates are checked over time.
    repeat: int = 3
    # Seconds the fresh verification process may take before it counts as hung.
    timeout: float = 600.0
    # Time the package against eager and torch.compile in the verification process.
    bench: bool = False
    # An output eager gives as all NaN or Inf has nothing to compare: it fails
    # verification unless this says that is expected (and the package agrees).
    allow_nonfinite: bool = False


@dataclass
class ServeConfig:
    """How the package is served: its state, and the loader's defaults."""

    # Buffers the methods write (a KV cache): written in place in the bound
    # tensors, or threaded through each call as inputs and outputs.
    state: StateMode = StateMode.in_place
    # The default of `flashrt_build.load(cuda_graphs=None)` on a CUDA target:
    # capture each method in a CUDA graph on first use and replay it.
    cuda_graphs: bool = False
    # Graphs a method with dynamic dims captures, one per distinct shape;
    # calls of any other shape then run without one.
    max_graphs: int = 8


@dataclass
class ToolchainConfig:
    """The C++ compiler Inductor uses (its `cpp.cxx`); null: Inductor's default
    (the CXX variable, else g++). Recorded in the manifest either way."""

    cxx: str | None = None


@dataclass
class PassesConfig:
    """Graph rewrites between the module and its export (stages/passes.py),
    each verified with the build. `none`: the graph as the module writes it."""

    name: str = "none"
    # Linear layers that read the same input (attention's q/k/v, an MLP's
    # gate/up) become one matmul over their concatenated weights.
    fuse_projections: bool = False
    # Grouped-query attention over the KV cache as it is, not a copy per query head.
    grouped_attention: bool = False
    # One-row matmuls (a decode step's) as a Triton GEMV compiled into the package (CUDA).
    gemv: bool = False
    # The GEMV with its neighbours (RMSNorm, SiLU(gate) * up, the residual add) in one kernel.
    gemv_fusion: bool = False
    # A one-token step's attention as a Triton split-KV kernel over the cache as it is (CUDA).
    decode_attention: bool = False
    # The query's rotary embedding taken into that attention kernel (CUDA).
    rotary_fusion: bool = False
    # That attention in one kernel a layer: each KV head's last program merges (CUDA).
    one_kernel_attention: bool = False
    # Inductor's combo kernels (small independent kernels launched as one) for
    # the methods of static shapes (a decode step) on a CUDA device.
    combo_kernels: bool = False
    # The package's own kernels (GEMV, decode attention) start while the kernel
    # before them finishes: programmatic dependent launch (Hopper on).
    pdl: bool = False


# Each pass's switch, as the `passes` group spells it: the spec, the build key and `any_pass` read this list
PASS_SWITCHES = tuple(f.name for f in fields(PassesConfig) if f.name != "name")


@dataclass
class BuildConfig:
    """One build. `module` is added with `+module=NAME`."""

    module: ModuleConfig | None = None
    target: TargetConfig = field(default_factory=TargetConfig)
    inductor: InductorConfig = field(default_factory=InductorConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    passes: PassesConfig = field(default_factory=PassesConfig)
    weights: WeightsMode = WeightsMode.baked
    output_root: str = "outputs"
    # Exact directory for this build; null derives it from the module name and
    # the config choices (never a timestamp).
    output_dir: str | None = None
    # Suffix of the derived directory; the CLI sets it from any overrides that
    # are not group choices, so two variants of one sweep never share a dir.
    variant: str | None = None
    # Seeds the example inputs and the module's random initialisation.
    seed: int = 0
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    toolchain: ToolchainConfig = field(default_factory=ToolchainConfig)
    # fnmatch patterns every `_target_` of the module must match, checked before
    # anything is imported; empty allows any (release=true adds the shipped zoo).
    allowed_targets: list[str] = field(default_factory=list)
    # Directories a module's code imports from, besides the working directory
    # and the --config-dir's parent (both always on the path); relative to the
    # working directory. The manifest records them all, so repro finds them.
    python_path: list[str] = field(default_factory=list)
    release: bool = False
    # Rebuild even when the artifact in place has this build key.
    force: bool = False
    # CPU threads one build may use (Inductor's compile workers, the
    # verification process); null: all cores, or in a parallel sweep the cores
    # divided among the concurrent jobs. Not part of the build key: the code
    # Inductor generates does not depend on it.
    threads: int | None = None


SCHEMA_NAME = "flashrt_build_schema"


def plain(cfg: Any, resolve: bool = False, **options: Any) -> dict[str, Any]:
    """A composed config (or one node of it) as plain values, a dict."""
    from omegaconf import OmegaConf

    value = OmegaConf.to_container(cfg, resolve=resolve, **options)
    assert isinstance(value, dict), type(value)
    return value  # type: ignore[return-value]  # OmegaConf types a dict node's keys as any hashable


def register_schema() -> None:
    """Store the schema so `conf/config.yaml` can name it in its defaults, and
    the resolvers the shipped configs use (`${flashrt_llm:...}`)."""
    from .llm import register_resolvers

    ConfigStore.instance().store(name=SCHEMA_NAME, node=BuildConfig)
    register_resolvers()
