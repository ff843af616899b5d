"""Parameter-efficient fine-tuning as module transforms: LoRA adapters on a frozen base (lora.py), on MoE experts
(expert_lora.py), and QLoRA's NF4 base (nf4.py: the format; qlora.py: the module). Modules and their parameters
only, no file I/O: PEFT's and NF4's files are read and written by shardfit.weights. parallel/parallelize.py applies
the adapters as step 0 of its build order; nothing here imports torch.distributed."""
