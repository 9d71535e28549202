"""Which implementation the decoder's ops use: Triton kernels for CUDA tensors, PyTorch ops otherwise.

`FORCE_TRITON` runs the kernels on CPU tensors too, through Triton's interpreter
(TRITON_INTERPRET=1), so the whole GPU code path can be tested end to end without a GPU.
"""

import torch

FORCE_TRITON = False


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or FORCE_TRITON
