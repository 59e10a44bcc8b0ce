"""What a pool's weights run as: the engine config's `quantization` against the checkpoint's own
`quantization_config` (config.json), resolved once at load, and checked by `splitserve serve` before
Ray starts (deploy/preflight.py): torch-free for that."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.config import QUANTIZATION_GROUP_SIZES
from splitserve.common.errors import UnsupportedModelError

PACKED_METHODS = ("gptq", "awq")
"""Methods whose checkpoints store packed 4-bit weights."""
GPTQ_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}
"""checkpoint_format -> what to add to a stored zero point (v1 stores zero - 1)."""


@dataclass(frozen=True)
class QuantizationSpec:
    method: str
    """none, int8, int4 (quantized at load), gptq or awq (read from the checkpoint)."""
    bits: int | None
    """Bits per weight; None when not quantized."""
    group_size: int | None
    """Input channels per scale; None for none and int8 (one scale per output channel)."""
    gptq_zero_offset: int = 1
    """GPTQ only: added to the stored zero points (1 for the v1 `gptq` format, 0 for `gptq_v2`)."""

    @property
    def quantized(self) -> bool:
        return self.method != "none"


NONE = QuantizationSpec("none", None, None)


def resolve_quantization(requested: str, group_size: int, checkpoint_config: dict | None) -> QuantizationSpec:
    """The spec for EngineConfig.quantization / quantization_group_size and the checkpoint's
    quantization_config (None when the checkpoint holds float weights)."""
    if checkpoint_config is None:
        if requested in PACKED_METHODS:
            raise UnsupportedModelError(f"quantization={requested!r} needs a {requested.upper()} checkpoint (a "
                                        f"quantization_config in config.json); make one with `splitserve quantize "
                                        f"MODEL_DIR OUT_DIR --method {requested}`")
        return {"int8": QuantizationSpec("int8", 8, None),
                "int4": QuantizationSpec("int4", 4, group_size)}.get(requested, NONE)
    method = str(checkpoint_config.get("quant_method", "?")).lower()
    if method == "mxfp4":
        raise UnsupportedModelError("checkpoint quantization 'mxfp4' (GPT-OSS's released MXFP4 expert weights) is "
                                    "not supported: serve a bfloat16 checkpoint of the model (its experts "
                                    "dequantized, without quantization_config in config.json)")
    if method not in PACKED_METHODS:
        raise UnsupportedModelError(f"checkpoint quantization {method!r} is not supported (gptq and awq are)")
    if requested not in ("auto", method):
        raise UnsupportedModelError(f"the checkpoint is {method.upper()}-quantized; quantization must be auto or "
                                    f"{method}, got {requested!r}")
    return _packed_spec(method, checkpoint_config)


def checkpoint_quantization(checkpoint_config: dict | None) -> QuantizationSpec:
    """What a checkpoint's own quantization_config says (a GPTQ / AWQ checkpoint, refused as
    resolve_quantization refuses it), NONE for float weights: a model loaded without a setting of
    its own (a draft model)."""
    # `auto` never reads the group size argument: a packed checkpoint brings its own.
    return resolve_quantization("auto", QUANTIZATION_GROUP_SIZES[-1], checkpoint_config)


def _packed_spec(method: str, config: dict) -> QuantizationSpec:
    bits, group_size = config.get("bits"), config.get("group_size")
    if bits != 4:
        raise UnsupportedModelError(f"{method} checkpoints with {bits} bits are not supported (4 bits are)")
    if group_size not in QUANTIZATION_GROUP_SIZES:
        raise UnsupportedModelError(f"{method} group_size {group_size} is not supported "
                                    f"(one of {QUANTIZATION_GROUP_SIZES})")
    if method == "awq":
        if str(config.get("version", "gemm")).lower() != "gemm" or not config.get("zero_point", True):
            raise UnsupportedModelError("AWQ checkpoints must use the GEMM packing with zero points")
        return QuantizationSpec("awq", 4, group_size)
    checkpoint_format = config.get("checkpoint_format", "gptq")
    if checkpoint_format not in GPTQ_ZERO_OFFSETS:
        raise UnsupportedModelError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported "
                                    f"({tuple(GPTQ_ZERO_OFFSETS)} are)")
    return QuantizationSpec("gptq", 4, group_size, GPTQ_ZERO_OFFSETS[checkpoint_format])
