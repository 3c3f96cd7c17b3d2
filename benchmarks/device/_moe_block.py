"""The Mixtral-8x7B-shaped MoE block of the session-39 device scripts: H = 4096, I = 14336, ``experts`` experts,
top-``top_k`` (session 41: ``hidden`` / ``inter`` for other shapes, e.g. Qwen3-30B-A3B's 2048 / 768 with 128
experts top-8); random N(0, 0.02) bf16 weights (router too), on CUDA; its experts use transformers' graph-capturable
``grouped_mm`` (session 38's ``s38_moe.py`` built the same block inline)."""
import torch

H, I = 4096, 14336


def mixtral_block(experts: int = 8, top_k: int = 2, hidden: int = H, inter: int = I):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                        num_experts_per_tok=top_k)
    with torch.device("cuda"):
        block = MixtralSparseMoeBlock(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        block.experts.gate_up_proj.normal_(0, 0.02)
        block.experts.down_proj.normal_(0, 0.02)
        block.gate.weight.normal_(0, 0.02)
    block.experts.config._experts_implementation = "grouped_mm"
    return block


def token_sets(block, T: int, n: int = 8):
    """``n`` (x, top_k_index, top_k_weights) sets of ``T`` random tokens routed by the block's router."""
    sets = []
    for _ in range(n):
        x = torch.randn(T, block.gate.weight.shape[1], device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            _, w, idx = block.gate(x)
        sets.append((x, idx, w))
    return sets
