"""The torch device that `--device` names, resolved where torch is imported anyway (the core side).

The configs keep the string (`EngineConfig.device`) so that the front end, which builds them, never imports torch.
"""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """'auto' is the first CUDA GPU when PyTorch sees one, else the CPU; 'cuda...' without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but no CUDA GPU is available to PyTorch")
    return torch.device(name)
