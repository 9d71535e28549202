"""LoRA adapters: the request type and PEFT adapter files, read without torch so the front end can check an
adapter before its request reaches the core (the tensors are read by ember/model/lora.py in the core)."""
