"""Weight-only quantization of the decoder's linear layers (docs/quantization.md).

formats: the typed QuantizedWeight and the GPTQ / AWQ checkpoint packings; rtn: round-to-nearest
int8 / int4; linear: the quantized layers and their CPU kernels; spec: what a pool runs; loader:
putting the layers into a model at load.
"""
