"""How the model runs on a device: CPU weight layouts, quantized weights, kvchat's C kernels and the
one-call decode step, CUDA graphs. The loader picks and swaps these in; the model knows none of them."""
