"""`LoRARequest`: which adapter a request runs under, vLLM's names and fields."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """A PEFT adapter directory and the names it goes by. `lora_int_id` (>= 1) identifies the adapter in the
    engine: two requests with the same id share its device slot and prefix-cache entries, so one id must
    always name the same weights."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def check(self) -> None:
        """A ValueError naming the field when the request cannot name an adapter."""
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_request.lora_name must not be empty")
        if not self.lora_path:
            raise ValueError("lora_request.lora_path must not be empty")
