# A small MoE model's flags, shared by the trace and the MoE-term tests: 8 experts, top-2, inner size 64.
MOE = ["--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=64", "--data.seq_len=128"]
