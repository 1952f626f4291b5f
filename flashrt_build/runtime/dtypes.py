"""Dtype names, written once: the names configs may use, the manifest's
(torch's), safetensors' codes and element sizes. No torch: the config checks
and the manifest reader use them too."""

from __future__ import annotations

from typing import Any

# torch dtype names accepted in configs, with the usual short aliases.
ALIASES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float64": "float64",
    "double": "float64",
    "int64": "int64",
    "long": "int64",
    "int32": "int32",
    "int": "int32",
    "int16": "int16",
    "int8": "int8",
    "uint8": "uint8",
    "bool": "bool",
}
FLOATING = frozenset({"float32", "float16", "bfloat16", "float64"})
# (atol, rtol) a package's outputs are judged by against eager's, by output
# dtype (`verify.atol`/`rtol` null): a leaf passes when its max absolute error
# is within atol or ||out - ref|| / ||ref|| within rtol. A float32 CUDA target
# with TF32 gets float16's, the mantissa TF32 keeps.
DEFAULT_TOLERANCES = {
    "float64": (1e-8, 1e-8),
    "float32": (1e-4, 1e-4),
    "float16": (1e-2, 1e-2),
    # bf16 keeps 8 mantissa bits: a deep model's logits drift from eager by a few
    # percent once Inductor fuses its kernels (BENCHMARKS.md has a 1.1B Llama's).
    "bfloat16": (5e-2, 5e-2),
}
INTEGER = frozenset({"int64", "int32", "int16", "int8", "uint8"})

# safetensors' dtype codes -> the manifest's names, and each one's bytes per element.
SAFETENSORS = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
}
ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


def dtype_name(dtype: Any) -> str:
    """The manifest's name of a torch dtype (`torch.float32` -> "float32")."""
    return str(dtype).removeprefix("torch.")
