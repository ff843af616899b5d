"""Every weight format shardfit reads and writes, in and out, in one package (above adapters/ and parallel/, whose
modules and layout it fills; below sampling/, train/, serve/ and cli/, which call it). Nothing is imported here, so
that the torch-free reader of PEFT's config (peft_config.py) stays torch-free for the CLI.

Hugging Face safetensors
  safetensors.py       a safetensors file's header and the byte range of any rows of its tensors
  hf_load.py           a model directory into a (sharded) model: each rank reads only its own rows, no collective
                       (Engine start from model.path; `generate`; the PEFT and quantised readers below go through it)
  hf_export.py         a (sharded) model as a model directory, one parameter gathered at a time, written atomically
                       (Engine.export_hf, Engine.weights' buckets, `shardfit export`)
  tokenizer_files.py   the tokenizer's files beside an export (the byte tokenizer's written as tokenizer.json);
                       a model directory's EOS ids (`generate`, `serve`'s stop tokens)
PEFT adapters
  peft_config.py       adapter_config.json read into lora.* values (torch-free: `train`, `plan`, `serve` and
                       Engine.start hand its adapter_lora_fields to the config loader) and written for an export
  peft.py              adapter_model.safetensors in (lora.adapter, `generate --adapter`) and out (a LoRA run's
                       export), the merged model's stream, PEFT's layout of MoE expert adapters
  peft_per_expert.py   a transformers-4 MoE adapter (one pair a module and expert) read exactly into expert adapters
A quantised frozen base (model.quantize: NF4 for QLoRA, FP8)
  quantized_io.py      the base quantised as it is read from model.path; dequantised whole for a merge
shardfit checkpoints (torch.distributed.checkpoint)
  checkpoint.py        save (atomic; the optimizer's state optional), choose (resume, agreed by every rank), load
                       (Engine.save / save_state / load_state, the Trainer's resume)
  checkpoint_verify.py every file checked before a loader reads it; the only path to DCP's reader (no unpickling)
  init_from.py         model.init_from: a new run's weights (or a LoRA run's frozen base) from a checkpoint
One device
  local.py             a model built whole on one device from a model directory or a checkpoint (`generate`,
                       `shardfit export`), and written out as a model directory
"""
