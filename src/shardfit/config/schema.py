"""The config tree. Every key has a type, a default and a help line; `shardfit train --help` prints them all.

Sections map one to one onto TOML tables (`[train]`) and onto CLI overrides (`--train.lr=3e-4`). [parallel] places
the work on ranks and devices, [compute] says how each rank computes; config/spellings.py maps the keys that moved
from [parallel] to [compute] for one release.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def opt(default: Any, help: str, *, choices: tuple | None = None, or_file: str | None = None, ge: float | None = None,
        gt: float | None = None, le: float | None = None, lt: float | None = None):
    """A config field: default, one-line help, and the checks the loader applies: its choices (or_file: what file a
    value outside them names instead, read by the loader), or its range (ge/gt: lower bound, le/lt: upper bound).
    Every float must also be finite, every int fit 64 bits."""
    return field(default=default, metadata={"help": help, "choices": choices, "or_file": or_file, "ge": ge, "gt": gt,
                                            "le": le, "lt": lt})


# Ceilings of the model's shape, far above any real model (Llama-3-405B: width 16384, 126 layers, 128 heads): they
# catch a typo'd size before the loader builds the model on the meta device to count its parameters (a billion
# layers would take hours to build there, a width of 2**62 overflows int64).
MAX_WIDTH = 1 << 20  # hidden and inner sizes
MAX_HEADS = 1 << 12  # attention heads, per-head size, experts
MAX_LAYERS = 1 << 10
MAX_TOKENS = 1 << 24  # vocabulary and context lengths


@dataclass
class ModelConfig:
    name: str = opt("tiny", "architecture preset whose sizes fill every model key you do not set (see PRESETS)")
    path: str = opt("", "a Hugging Face model directory (config.json, safetensors): its architecture and weights")
    init_from: str = opt("", "start from the weights of a shardfit checkpoint: a step_XXXXXXXX directory, or a run "
                             "directory (its newest complete checkpoint); its architecture and tokenizer too, a fresh "
                             "optimizer, schedule and step 0, on any parallel layout (docs/checkpoints.md)")
    vocab_size: int = opt(264, "vocabulary size (must cover the tokenizer's ids)", gt=0,
                          le=MAX_TOKENS)
    dim: int = opt(256, "hidden size", gt=0, le=MAX_WIDTH)
    n_layers: int = opt(4, "decoder blocks", gt=0, le=MAX_LAYERS)
    n_heads: int = opt(8, "attention heads", gt=0, le=MAX_HEADS)
    n_kv_heads: int = opt(4, "key/value heads (grouped-query attention); must divide n_heads", gt=0,
                          le=MAX_HEADS)
    head_dim: int = opt(0, "per-head size (even: RoPE rotates pairs); 0 means dim // n_heads", ge=0,
                        le=MAX_HEADS)
    ffn_dim: int = opt(704, "SwiGLU inner size", gt=0, le=MAX_WIDTH)
    max_seq_len: int = opt(1024, "longest sequence the model accepts (RoPE table size)", gt=0,
                           le=MAX_TOKENS)
    rope_theta: float = opt(10000.0, "RoPE base frequency", gt=0)
    rope_scaling: str = opt("none", "RoPE frequency scaling", choices=("none", "llama3"))
    rope_factor: float = opt(8.0, "llama3 scaling: factor", ge=1)
    rope_low_freq_factor: float = opt(1.0, "llama3 scaling: low-frequency factor", gt=0)
    rope_high_freq_factor: float = opt(4.0, "llama3 scaling: high-frequency factor", gt=0)
    rope_original_max_seq_len: int = opt(8192, "llama3 scaling: original context length", gt=0,
                                        le=MAX_TOKENS)
    norm_eps: float = opt(1e-5, "RMSNorm epsilon", gt=0, lt=1)
    tie_embeddings: bool = opt(True, "share the input embedding with the output projection")
    qkv_bias: bool = opt(False, "bias on the q/k/v projections (Qwen2)")
    qk_norm: bool = opt(False, "RMSNorm on queries and keys per head (Qwen3)")
    init_std: float = opt(0.02, "std of the normal initialisation of weights", gt=0, le=1)
    sliding_window: int = opt(0, "attention window of Mistral-style models; sequences must fit in it (0: none)", ge=0,
                            le=MAX_TOKENS)
    n_experts: int = opt(0, "experts per MoE layer (Qwen3-MoE); 0: dense model", ge=0, le=MAX_HEADS)
    experts_per_token: int = opt(0, "experts each token is routed to (top-k)", ge=0, le=MAX_HEADS)
    moe_ffn_dim: int = opt(0, "inner size of each expert", ge=0, le=MAX_WIDTH)
    norm_topk_prob: bool = opt(True, "renormalise the top-k routing weights to sum to 1")
    router_aux_coef: float = opt(0.0, "weight of the routers' load-balancing loss (router_aux_loss_coef, used when "
                                      "output_router_logits is on); 0: none", ge=0)
    router_bias_rate: float = opt(0.0, "auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias added to "
                                       "the routing scores for the top-k choice only, moved by this rate towards "
                                       "even load after every step (their gamma: 0.001); 0: off", ge=0)
    moe_every: int = opt(1, "every k-th layer is MoE (decoder_sparse_step)", gt=0, le=MAX_LAYERS)
    dense_layers: str = opt("", "comma-separated layer indices that stay dense (mlp_only_layers)")
    quantize: str = opt("none", "how the frozen base of the LoRA-adapted linear layers is stored: nf4 (QLoRA: 4-bit "
                                "NormalFloat with double-quantised scales, ~0.52 bytes a weight, dequantised one "
                                "layer at a time), fp8 (float8 e4m3 with a scale per row, ~1 byte a weight, "
                                "multiplied in FP8 on GPUs with FP8 tensor cores), both needing lora.rank; or none "
                                "(the compute dtype)",
                        choices=("none", "nf4", "fp8"))


def dense_layer_ids(cfg: ModelConfig) -> list[int]:
    """model.dense_layers ("1,5") as layer indices: the layers of an MoE model that keep a dense MLP."""
    return [int(x) for x in cfg.dense_layers.split(",") if x.strip()]


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    return cfg.n_experts > 0 and i not in dense_layer_ids(cfg) and (i + 1) % cfg.moe_every == 0


# LoRA's default targets: every linear layer of a dense block (attention and MLP), as Hugging Face names them.
LORA_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_OPTIONAL = ("embed_tokens", "lm_head")
# MoE experts' stacked weights (adapters/expert_lora.py): both, or one, by PEFT's target_parameters names. Not a
# default: on Qwen3-30B-A3B at r=16 they are ~630M adapter parameters (10 GB of states) against ~13M for attention.
LORA_EXPERTS = ("experts", "experts.gate_up_proj", "experts.down_proj")


@dataclass
class LoraConfig:
    """LoRA: low-rank adapters trained on a frozen base (shardfit/adapters/, docs/lora.md). A section of its own,
    not [model]: model.* is the architecture (config.json fills it and refuses a conflicting override), LoRA is how
    it is trained."""

    rank: int = opt(0, "LoRA rank r: train adapters B A (fp32, AdamW) on a frozen base (no optimizer state, gradients "
                       "or fp32 master for it; bf16 on CUDA); 0: off, every weight trains", ge=0, le=MAX_HEADS)
    alpha: float = opt(16.0, "LoRA alpha: each adapter adds (alpha / rank) x B A x to its layer's output", gt=0,
                       le=MAX_WIDTH)
    dropout: float = opt(0.0, "dropout on the adapters' input (the base layer sees the whole input)", ge=0, lt=1)
    targets: str = opt(",".join(LORA_LINEAR), "comma-separated module names that get adapters: "
                       + ", ".join(LORA_LINEAR + LORA_OPTIONAL) + "; or all-linear (every linear layer of the "
                       "blocks but MoE routers); experts (MoE experts' gate_up_proj and down_proj, grouped "
                       "per-expert adapters; not a default), or experts.gate_up_proj / experts.down_proj alone")
    adapter: str = opt("", "a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to start the "
                           "adapters from (continue training it); its r, lora_alpha, lora_dropout and target_modules "
                           "fill the lora.* keys you leave unset")


CHAT_TEMPLATES = ("auto", "tokenizer", "plain", "none")  # data.chat_template's names; any other value is a file


@dataclass
class DataConfig:
    path: str = opt("", "text (.txt), JSON lines (.jsonl) or Parquet files, a directory or a glob; "
                        "empty: the embedded corpus")
    format: str = opt("auto", "record layout: messages (OpenAI chat), sharegpt (conversations of from/value), alpaca "
                              "(instruction, input, output), prompt_completion, or text (documents in "
                              "data.text_field, for pretraining); auto: the layout of data.path's first record",
                      choices=("auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text"))
    file_format: str = opt("auto", "file format; auto picks by extension (named data.format before 0.2)",
                           choices=("auto", "text", "jsonl", "parquet"))
    mode: str = opt("auto", "pretrain: pack documents; sft: one example per sequence (data.format), loss on "
                            "completions and assistant turns only; auto: sft when data.path holds fine-tuning records",
                    choices=("auto", "pretrain", "sft"))
    text_field: str = opt("text", "JSON key or Parquet column that holds the text")
    tokenizer: str = opt("byte", "'byte' for the built-in byte tokenizer, or a path to a tokenizer.json")
    chat_template: str = opt("auto", "how chats (messages, sharegpt, alpaca) become text: tokenizer (its "
                                     "chat_template), plain (shardfit's <|role|> template), auto (the tokenizer's when "
                                     "it has one, else plain), none (chats refused), or the path of a Jinja template "
                                     "file (rendered with the tokenizer's special tokens); the run's config.toml "
                                     "records the one applied (none: no chat in the data), which shardfit generate "
                                     "applies and an export holds as its tokenizer's template",
                             choices=CHAT_TEMPLATES, or_file="a Jinja chat template")
    seq_len: int = opt(256, "tokens per training sequence (at least 2)", ge=2)
    seed: int = opt(1234, "seed of the sample order", ge=0)
    document_mask: bool = opt(True, "packed rows: a token attends only to earlier tokens of its own document and RoPE "
                                    "positions restart at each document start; false: attention crosses document "
                                    "boundaries inside a row (shardfit 0.1's behaviour); token-budget rows "
                                    "(train.micro_batch_tokens) are always masked")
    pack: bool = opt(True, "fine-tuning: pack examples into rows of data.seq_len tokens as separate documents (no "
                           "padding beyond a row's tail); false: one example per row, padded")
    val_path: str = opt("", "held-out data for the validation loss (same formats as data.path); empty: none, or "
                            "data.val_fraction")
    val_fraction: float = opt(0.0, "with no data.val_path: hold out this fraction of the training items (windows or "
                                   "examples) for the validation loss", ge=0,
                                lt=1)


@dataclass
class TrainConfig:
    steps: int = opt(150, "optimizer steps (or train.epochs)", gt=0)
    epochs: float = opt(0.0, "passes over the training data instead of train.steps: steps = ceil(epochs x rows / "
                             "global_batch), warm-up a fraction of them unless set; fractions allowed; 0: "
                             "train.steps", ge=0)
    global_batch: int = opt(16, "sequences per optimizer step, over all ranks and micro-batches", gt=0)
    micro_batch: int = opt(8, "sequences per rank per forward/backward; 0: on CUDA the largest that divides the "
                              "per-rank batch and fits the GPU by shardfit plan's estimate (no accumulation on CPU)",
                           ge=0)
    micro_batch_tokens: int = opt(0, "token-budget micro-batches: each forward/backward is one row of exactly this "
                                     "many tokens, filled with whole examples (document-masked, padding only at the "
                                     "end), and train.global_batch counts examples; 0: micro-batches of "
                                     "train.micro_batch sequences", ge=0)
    eval_every: int = opt(0, "steps between validation-loss evaluations (also after the last step); 0: never", ge=0)
    eval_batches: int = opt(0, "micro-batches per rank per evaluation; 0: the whole validation set", ge=0)
    lr: float = opt(3e-3, "peak learning rate (AdamW: typically 1e-5 to 3e-3)", gt=0, le=1)
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak (cosine decay)", ge=0,
                              le=1)
    warmup_steps: int = opt(15, "linear warm-up steps", ge=0)
    weight_decay: float = opt(0.1, "AdamW weight decay (not applied to norms and biases)", ge=0)
    beta1: float = opt(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = opt(0.95, "AdamW beta2", ge=0, lt=1)
    eps: float = opt(1e-8, "AdamW epsilon", gt=0, lt=1)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0 disables", ge=0)
    seed: int = opt(0, "seed of the weight initialisation", ge=0)
    max_skipped_steps: int = opt(10, "non-finite steps skipped before saving and stopping", ge=0)
    watchdog_s: float = opt(900.0, "a rank with no progress for this long dumps its stacks and exits (hang "
                                   "report); 0 disables", ge=0)
    device: str = opt("auto", "where to train; auto uses CUDA when present", choices=("auto", "cpu", "cuda"))
    # Not a key: with train.epochs and no train.warmup_steps, the fraction of the derived steps that warms up (set by
    # the loader, applied by train/schedule.py)
    warmup_fraction = None


@dataclass
class ParallelConfig:
    """Where the work goes: degrees of sharding, replication, sequence and expert parallelism, offload to the host,
    and when the collectives and the optimizer step run."""

    reshard_after_forward: bool = opt(True, "free gathered parameters after each block's forward (ZeRO-3)")
    prefetch: int = opt(0, "explicit FSDP prefetch depth in blocks; 0 lets FSDP prefetch implicitly", ge=0)
    reduce_every_micro_batch: bool = opt(True, "reduce-scatter gradients after every micro-batch; false reduces once "
                                               "per step, but every GPU then holds the whole model's gradients "
                                               "unsharded in fp32 between micro-batches (32 GB for 8B params): "
                                               "only for slow links")
    replicate: int = opt(1, "HSDP: parameters sharded within groups of world/replicate ranks and replicated across "
                            "the replicate groups (gradients all-reduced across them); 1: shard over every rank",
                         gt=0)
    offload: str = opt("none", "CPU offload: all (FSDP2's CPU offload: sharded fp32 parameters and gradients in pinned "
                               "host memory, Adam moments in host memory, fused AdamW on the CPU; the GPU holds only "
                               "gathered groups and activations; 16 bytes per parameter of host memory per node, "
                               "plus the pinned allocator's rounding: shardfit plan counts it)",
                       choices=("none", "all"))
    offload_gpu_blocks: int = opt(0, "with offload=all: the first N blocks keep their fp32 shards, gradients and Adam "
                                     "states on the GPU (stepped there), the rest go to host memory; for a model "
                                     "whose states exceed the host's memory but whose GPUs have room left "
                                     "(shardfit plan proposes N)", ge=0)
    offload_overlap: bool = opt(True, "with offload=all: run the CPU step group by group on a worker thread under "
                                      "the next forward; false steps in place (the same results, bit for bit)")
    overlap_optimizer: bool = opt(False, "CUDA: run the optimizer step on a side stream, FSDP group by group, each "
                                         "group's next forward waiting only for its own (parallel/step_overlap.py); "
                                         "for steps whose forward leaves the GPU idle (MoE with expert parallelism: "
                                         "benchmarks/README.md has its figures); same results as the plain step")
    expert_parallel: int = opt(1, "MoE expert parallelism: groups of E neighbouring ranks split each layer's experts "
                                  "(each holds n_experts/E, tokens exchanged by all-to-all); expert weights are "
                                  "FSDP-sharded over the world/E ranks holding the same experts (E = world: kept "
                                  "out of FSDP); 1: every rank gathers every expert", gt=0)
    expert_overlap: str = opt("none", "with expert_parallel = world size: each MoE layer runs this rank's own rows "
                                      "through its experts while the other rows are in flight: dispatch hides the "
                                      "dispatch all-to-all (and its reverse in backward), both also the combine's "
                                      "(the own rows in two halves); parallel/expert_overlap.py; same results",
                              choices=("none", "dispatch", "both"))
    sequence_parallel: int = opt(1, "Ulysses sequence parallelism: ranks that split each sequence (all-to-all over "
                                    "heads); must divide the world size, data.seq_len and model.n_heads", gt=0)


@dataclass
class ComputeConfig:
    """How each rank computes its share: activation checkpointing, compilation, dtypes, attention and loss kernels,
    FP8 matmuls, NUMA binding."""

    activation_checkpoint: str = opt("none", "recompute activations in backward; auto: at start-up, the fewest "
                                     "blocks checkpointed (the first N) that shardfit plan predicts to fit this GPU "
                                     "at the configured micro-batch, none when every block fits",
                                     choices=("none", "full", "selective", "auto"))
    ac_every: int = opt(1, "checkpoint every k-th block only (full mode)", gt=0)
    ac_blocks: int = opt(0, "full mode: checkpoint only the first N blocks (0: every block); the later blocks keep "
                            "their activations and skip the recompute; with ac_every, every k-th of the first N. "
                            "shardfit plan proposes the smallest N that fits", ge=0)
    compile: bool = opt(False, "torch.compile each block")
    compile_loss: bool = opt(True, "with compile: also compile the loss's per-chunk softmax and gradient (one fused "
                                   "kernel instead of ~8 passes over an fp32 [loss_chunk, vocab] buffer)")
    param_dtype: str = opt("auto", "compute dtype of gathered parameters; auto: bf16 on CUDA, fp32 on CPU",
                           choices=("auto", "float32", "bfloat16"))
    reduce_dtype: str = opt("float32", "dtype of gradient reduce-scatter", choices=("float32", "bfloat16"))
    attention: str = opt("auto", "SDPA kernel on CUDA: flash, cudnn, efficient; auto lets PyTorch pick per call",
                         choices=("auto", "flash", "cudnn", "efficient"))
    doc_attention: str = opt("auto", "kernel of document-masked attention on CUDA: varlen (FlashAttention over "
                                     "cumulative sequence lengths), flex (FlexAttention with a document block mask), "
                                     "sdpa (SDPA with a dense boolean mask: the CPU reference), cudnn_docs (SDPA, "
                                     "cuDNN backend, once per document; passes without gradients only, training "
                                     "takes auto's choice); auto: flex (varlen for rows under 128 tokens or without "
                                     "FlexAttention), for passes with and without gradients alike (Engine.forward's "
                                     "log-probs are forward_backward's)",
                             choices=("auto", "varlen", "flex", "sdpa", "cudnn_docs"))
    share_prefix: bool = opt(True, "preference pairs (and RL rollouts of one prompt): packed as one prefix tree, "
                                   "their common prompt computed once, where the step then needs fewer rows (the "
                                   "same gradients; needs doc_attention flex or sdpa: with varlen or cudnn_docs "
                                   "they are packed apart)")
    kernels: str = opt("torch", "fused linear cross-entropy kernel: torch (chunked pure PyTorch, any device; the "
                                "default), liger (Liger-Kernel's "
                                "Triton kernel, CUDA, optional extra); auto: liger when installed and on CUDA",
                       choices=("auto", "liger", "torch"))
    loss_chunk: int = opt(1024, "tokens per chunk of the fused linear cross-entropy (never full fp32 logits)", gt=0)
    fp8: str = opt("none", "FP8 matmuls in the blocks' linear layers through torchao (optional extra; CUDA compute "
                           "capability >= 8.9): tensorwise (fastest; weights all-gathered in FP8) or rowwise (finer "
                           "scales); changes numerics slightly, see parallel/fp8.py",
                   choices=("none", "tensorwise", "rowwise"))
    fp8_all_gather: bool = opt(True, "with fp8=tensorwise: FSDP all-gathers the converted weights in FP8 (half the "
                                     "bytes), their scales refreshed by one all-reduce after each optimizer step")
    numa_bind: bool = opt(True, "bind each rank's CPU threads to its GPU's NUMA node (CUDA runs)")


@dataclass
class CheckpointConfig:
    every: int = opt(0, "save a distributed checkpoint every N steps; 0: only at the end", ge=0)
    dir: str = opt("", "checkpoint directory; empty: <run_dir>/checkpoints")
    resume: str = opt("auto", "'auto': latest complete checkpoint if any, 'none', or a checkpoint directory")
    keep: int = opt(3, "complete checkpoints to keep (older ones are deleted); 0 keeps all", ge=0)
    final: bool = opt(True, "save a checkpoint when training ends")
    export_hf: str = opt("", "at the end, write a Hugging Face model directory here (safetensors shards, config, "
                             "tokenizer); LoRA runs: the PEFT adapter (adapter_config.json, "
                             "adapter_model.safetensors); empty: none")
    export_dtype: str = opt("bfloat16", "dtype of the exported weights", choices=("bfloat16", "float32", "float16"))
    export_merged: str = opt("", "LoRA runs (checkpoint.export_hf then holds the PEFT adapter): at the end, also write "
                                 "the base with the adapters merged in, a plain Hugging Face model, here; empty: none")
    allow_changes: str = opt("", "comma-separated keys (e.g. train.steps,data.path) that may differ from the config of "
                                 "the checkpoint being resumed; any other difference in the model, data or schedule "
                                 "keys is refused (train/run_config.py lists the keys compared)")
    on_signal: bool = opt(True, "on SIGINT (Ctrl-C) or SIGTERM, finish the step and save a checkpoint every rank "
                                "agrees on, then exit 130 / 143; false: exit without saving")


@dataclass
class LoggingConfig:
    run_dir: str = opt("", "where metrics, the resolved config and checkpoints go; empty: runs/<model.name>-<hash>, "
                           "the hash of the keys that define the experiment (model, data, schedule), so that the same "
                           "command resumes its own run and another experiment gets its own directory")
    plot: bool = opt(True, "at the end of the run, draw <run_dir>/metrics.png (loss, validation loss, learning rate, "
                           "tokens/s, memory; needs matplotlib: pip install 'shardfit[plot]')")
    log_every: int = opt(10, "steps between metric lines (memory and throughput are reduced across ranks then)", gt=0)
    progress: str = opt("auto", "rank-0 progress display", choices=("auto", "bar", "lines", "none"))
    tensorboard: bool = opt(False, "also write every metrics.jsonl record's numbers as TensorBoard scalars into "
                                   "<run_dir>/tensorboard (rank 0; pip install 'shardfit[tensorboard]')")
    wandb: bool = opt(False, "also send every metrics.jsonl record's numbers to Weights & Biases, with the resolved "
                             "config (rank 0; pip install 'shardfit[wandb]')")
    wandb_project: str = opt("shardfit", "Weights & Biases project")
    wandb_name: str = opt("", "Weights & Biases run name; empty: the run directory's name (a resumed run continues "
                              "the same W&B run)")
    wandb_mode: str = opt("online", "online, or offline: written under <run_dir>/wandb with no network, uploaded "
                                    "later with `wandb sync`", choices=("online", "offline"))
    level: str = opt("info", "debug adds a rank-0 line per micro-batch with its ETA", choices=("info", "debug"))
    step_timing: bool = opt(True, "time forward, backward, optimizer and exposed FSDP communication per step "
                                  "(CUDA events read after the step's existing sync: no extra host syncs)")
    peak_tflops: float = opt(0.0, "peak TFLOP/s per GPU for MFU; 0 looks the GPU up in a table", ge=0)
    profile_step: int = opt(0, "profile this step (1-based; 0: none): a Perfetto trace and a summary of GPU time by "
                               "kernel kind and compute-stream idle time in <run_dir>/profile", ge=0)


@dataclass
class MemoryConfig:
    alloc_conf: str = opt("expandable_segments:True",
                          "PYTORCH_CUDA_ALLOC_CONF used when the environment sets none (fragmentation guard)")
    warn_growth_mib: float = opt(64.0, "warn when reserved memory grows by more than this between log steps", ge=0)
    snapshot_steps: str = opt("", "record CUDA memory snapshots of these steps on every rank (e.g. 3,4 or 10-12) "
                                  "into <run_dir>/snapshots and run the doctor on them at the end")
    snapshot_max_entries: int = opt(200000, "allocator events kept while recording (a ring buffer)", gt=0)
    keep_grads: bool = opt(True, "keep gradient buffers allocated between steps (zeroed, not freed): FSDP2 allocates "
                                 "the sharded gradients in its reduce-scatter stream's pool, and once freed that "
                                 "memory is idle cache the compute stream cannot use (benchmarks/README.md"
                                 "#doctor-keep-grads)")
    max_fraction: float = opt(0.0, "cap this process's CUDA memory at this fraction of the GPU (headroom for other "
                                   "processes); 0: no cap", ge=0, le=1)
    versions_gib: float = opt(1.0, "GiB per rank of the device's memory for frozen weight versions (samplers' "
                                   "weights: LoRA adapters, or without LoRA copies of every weight, "
                                   "engine/registry.py); past it versions are kept in host memory", ge=0)


@dataclass
class PreferenceConfig:
    objective: str = opt("none", "train on preference data ({prompt?, chosen, rejected} pairs; kto: {prompt, "
                                 "completion, label} too; docs/preference.md): dpo (Rafailov et al.), ipo (Azar et "
                                 "al.), simpo (reference-free, length-normalised), orpo (reference-free: SFT on "
                                 "chosen + an odds ratio term), kto (labelled examples, unpaired); none: fine-tuning "
                                 "or pretraining as data.path says",
                         choices=("none", "dpo", "ipo", "simpo", "orpo", "kto"))
    beta: float = opt(0.1, "the objective's beta: DPO/IPO/KTO's strength of the reference (TRL's default 0.1), SimPO's "
                           "reward scale (its paper uses 2 to 2.5), ORPO's lambda (the odds-ratio term's weight)",
                      gt=0)
    label_smoothing: float = opt(0.0, "dpo and simpo: the assumed fraction of flipped labels (conservative DPO)",
                                 ge=0, lt=0.5)
    simpo_gamma: float = opt(0.5, "simpo: the target reward margin gamma", ge=0)
    desirable_weight: float = opt(1.0, "kto: the weight of a desirable example's loss (TRL's; raise the rarer kind's "
                                       "so that weight x count is about even)", gt=0)
    undesirable_weight: float = opt(1.0, "kto: the weight of an undesirable example's loss", gt=0)


@dataclass
class ServeConfig:
    """`shardfit serve` only (docs/rl.md): what it holds beside its training model."""

    models: str = opt("", "more frozen models to sample and score, comma-separated Hugging Face directories (each "
                          "sharded like the trained model, loaded at start): sampling clients name one as "
                          "base_model (a distillation teacher, another family's reference)")
    versions: int = opt(0, "frozen weight versions (samplers' weights) held at most; past it a new one is refused "
                           "(400) until a sampling session finishes or its ttl_seconds pass. 0: no limit with LoRA "
                           "(a version is its adapters), 2 without (each a copy of every weight)", ge=0)
    max_models: int = opt(0, "LoRA training models held at most (create_model past it is refused, 400); 0: no "
                             "limit (shardfit plan --models says how many fit)", ge=0)
    seq_gap_s: float = opt(300.0, "seconds a training model's request waits for an earlier seq_id that never "
                                  "arrives (numbered by its client, never sent: a request that failed in the client) "
                                  "before the missing numbers are skipped, with a line in the log; 0: wait for ever",
                           ge=0)
    join: bool = opt(True, "sample requests join the running decode batch between chunks of steps, each answered "
                           "when its rows end (serve/sample_joining.py; on N ranks with sampling.logprobs=decode); "
                           "false: the samples ready together run as one batch, all answered at its end")


@dataclass
class SamplingConfig:
    """Engine.sample's Sampler (engine/sampling.py): its paged KV pool and what keeps it between calls."""

    kv_fraction: float = opt(0.9, "share of the device memory free after the weights that the sampler's paged KV cache "
                                  "takes (sampling/kv.py); the rest stays free", gt=0, le=1)
    keep_kv: bool = opt(False, "keep the sampler (its KV pool and CUDA graphs) across training commands too, not only "
                               "between consecutive sample calls: no pool allocation or graph capture per sampling "
                               "phase, but the pool's memory is then not the training step's: lower "
                               "sampling.kv_fraction so that both fit")
    prefill_chunk: int = opt(2048, "prompt tokens a prefill forward of the sampler takes at most (several prompts "
                                  "per forward; a longer one in chunks), each followed by a decode step of the rows "
                                  "running: larger chunks read the weights fewer times per prompt token and delay "
                                  "the running rows' next token longer (sampling/runner.py)", gt=0)
    logprobs: str = opt("decode", "the sampled tokens' log-probs Engine.sample (and serve's /asample) returns: decode "
                                  "(the decode model's, as it samples) or trainer (one Engine.forward over the "
                                  "samples as datums after the call: equal to the trainer's, bit for bit, on those "
                                  "datums, in any order under compute.doc_attention=auto, which then takes varlen; "
                                  "top-k stays decode's; rl/trainer_logprobs.py)",
                        choices=("decode", "trainer"))


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


# Architecture presets: the sizes of real model families, used by `model.name`. "tiny" is the embedded default
# (about 3.0M parameters with the byte tokenizer) that trains on two CPU cores in minutes.
_LLAMA3 = dict(vocab_size=128256, max_seq_len=131072, rope_theta=500000.0, rope_scaling="llama3", norm_eps=1e-5,
               n_kv_heads=8)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "llama3-1b": {**_LLAMA3, "dim": 2048, "n_layers": 16, "n_heads": 32, "ffn_dim": 8192, "rope_factor": 32.0,
                  "tie_embeddings": True},
    "llama3-3b": {**_LLAMA3, "dim": 3072, "n_layers": 28, "n_heads": 24, "ffn_dim": 8192, "rope_factor": 32.0,
                  "tie_embeddings": True},
    "llama3-8b": {**_LLAMA3, "dim": 4096, "n_layers": 32, "n_heads": 32, "ffn_dim": 14336, "rope_factor": 8.0,
                  "tie_embeddings": False},
    "llama3-70b": {**_LLAMA3, "dim": 8192, "n_layers": 80, "n_heads": 64, "ffn_dim": 28672, "rope_factor": 8.0,
                   "tie_embeddings": False},
    # Qwen3-30B-A3B's config.json: 128 experts, 8 routed per token (3.3B of its 30.5B parameters active)
    "qwen3-30b-a3b": {"vocab_size": 151936, "dim": 2048, "n_layers": 48, "n_heads": 32, "n_kv_heads": 4,
                      "head_dim": 128, "ffn_dim": 6144, "max_seq_len": 40960, "rope_theta": 1000000.0,
                      "norm_eps": 1e-6, "tie_embeddings": False, "qk_norm": True, "n_experts": 128,
                      "experts_per_token": 8, "moe_ffn_dim": 768, "norm_topk_prob": True},
}

# Training defaults by model size (total parameters, as built) for the train.* keys a user leaves unset; applied by
# the loader once the preset or config.json is known, and printed by `shardfit train --help`. The weights decide the
# rate and warm-up: from scratch (no model.path) or fine-tuning (model.path weights, whatever the data); the data
# decide the batch: tokens per step for pretraining data, a number of examples for fine-tuning data.
# Rates are those of published recipes for these sizes: from scratch Llama 2/3 (3e-4 at 7-8B, 1.5e-4 at 70B),
# OLMo/TinyLlama 1B (4e-4); fine-tuning torchtune's and axolotl's full fine-tunes (2e-5; 1e-5 at 30B and up).
# The embedded tiny model keeps its own setting (3e-3, 16 sequences, micro-batch 8: the README's first command);
# 3e-3 is what sank a Llama-3-8B run (its loss climbed within 14 steps) before these defaults existed.
# Warm-up is a fraction of train.steps; the pretraining batch a number of tokens per step (in sequences: that over
# data.seq_len, rounded to a power of two, at least 8); micro_batch 0 lets shardfit plan choose it on CUDA.
WARMUP_FRACTION = {"scratch": 0.1, "pretrained": 0.03}
REAL_SEQ_LEN = 4096  # data.seq_len left unset, at 100M parameters and up (Llama 3's pretraining context)
SFT_GLOBAL_BATCH = 32  # examples (or packed rows) per step on fine-tuning data, at 100M parameters and up
SIZE_DEFAULTS: tuple[tuple[float, str, float, float, int], ...] = (
    # (below this many parameters, label, from-scratch lr, fine-tuning lr, pretraining tokens per step; 0: the
    #  tiny model's fixed 16 sequences and micro-batch 8)
    (100e6, "< 100M", 3e-3, 3e-4, 0),
    (2e9, "100M-2B", 4e-4, 2e-5, 1 << 18),
    (20e9, "2B-20B", 3e-4, 2e-5, 1 << 19),
    (float("inf"), ">= 20B", 1.5e-4, 1e-5, 1 << 20),
)
