"""Native CPU kernels for decode: int4/int8 weight-only GEMV on float32 activations and paged decode
attention, compiled from csrc/ (kernels.c and its families) at install (or first use) and cached; see ops.py."""
