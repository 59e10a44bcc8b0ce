"""Weight-only quantization of the decoder's linear layers (docs/quantization.md).

formats: the typed QuantizedWeight and the GPTQ / AWQ checkpoint packings; rtn: round-to-nearest
int8 / int4; linear: the quantized layers and their CPU kernels; loader: putting the layers into a model at
load. What a pool runs (the setting against the checkpoint's quantization_config) is
common/quantization_spec.py, torch-free so `serve` checks it before any worker loads.
"""
