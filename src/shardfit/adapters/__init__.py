"""Parameter-efficient fine-tuning: LoRA adapters on a frozen base (lora.py), PEFT's adapter format in and out
(peft_config.py, peft.py). parallel/parallelize.py applies the adapters as step 0 of its build order; nothing here
imports torch.distributed at import time (the config loader reads peft_config.py before any model exists)."""
