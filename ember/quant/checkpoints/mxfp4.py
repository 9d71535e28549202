"""OpenAI's MXFP4 checkpoints (`quant_method: mxfp4`): gpt-oss with its experts' weights in MXFP4.

Only mixture-of-experts weights are stored so (`*_blocks` and `*_scales` pairs, two per layer), and
they become QuantizedExperts rather than one QuantizedWeight per linear module, so this format claims
no tensor here: ember.model.gpt_oss pairs and decodes them as the checkpoint is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ember.quant.checkpoints.base import CheckpointFormat


@dataclass(frozen=True)
class MXFP4Format(CheckpointFormat):
    def claims(self, suffix: str, is_fp8: bool) -> bool:
        return False


def read(qcfg: dict[str, Any], source: str) -> CheckpointFormat:
    return MXFP4Format("mxfp4", source, fp8=False)
