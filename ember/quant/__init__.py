"""Quantized weights: formats, quantizers, GGUF block mapping and the linear layer that reads them."""
