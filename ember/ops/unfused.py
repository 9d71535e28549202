"""The registry's answer where no fused kernel applies to a layer: the layer's own modules run."""

from __future__ import annotations

from typing import Any


class Unfused:
    @staticmethod
    def can_implement(*facts: Any) -> bool:
        return True

    def __init__(self, *facts: Any) -> None:
        pass

    def __call__(self, *args: Any) -> None:
        """None: not computed here."""
        return None
