"""CPU script (session 39): the mixture-of-experts quantization path on real weights. The embedded SmolLM2-135M is
"upcycled" into a Mixtral of the same shapes whose experts are E copies of each layer's dense MLP (router random,
Mixtral's top-k weights sum to 1): its float function is the dense model's, so its float perplexity must equal the
dense one's, and each recipe's perplexity on it should match the recipe on the dense model (CAS / PTS follow the
same rules; the routed copies are identical). A gap would be an error of the MoE path (routing, the experts'
quantization, CAS over the router, the schedules). Writes JSON with the corpus slice and the recipes' perplexities.

    python3 benchmarks/cpu_moe_upcycled_ppl.py --out benchmarks/results/cpu/s39_moe_upcycled_ppl.json
"""
import argparse
import copy
import json
import platform
import sys
import time

import torch

sys.path.insert(0, ".")
import lowbit  # noqa: E402
from lowbit.eval import pipeline  # noqa: E402
from lowbit.eval.corpus import calibration_batches, describe_source, load_text, tokenize  # noqa: E402
from lowbit.eval.perplexity import perplexity  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", required=True)
ap.add_argument("--recipes", default="fireq,qserve,flute-nf4")
ap.add_argument("--experts", type=int, default=4)
ap.add_argument("--max-tokens", type=int, default=2048)
a = ap.parse_args()


def upcycle(dense, experts: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    c = dense.config
    mc = MixtralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                       num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                       num_key_value_heads=c.num_key_value_heads, head_dim=getattr(c, "head_dim", None),
                       max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                       rope_parameters=copy.deepcopy(getattr(c, "rope_parameters", None)),
                       tie_word_embeddings=c.tie_word_embeddings, num_local_experts=experts, num_experts_per_tok=2,
                       sliding_window=None, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
    torch.manual_seed(0)
    moe = MixtralForCausalLM(mc).to(next(dense.parameters()).dtype).eval()
    sd = {k: v for k, v in dense.state_dict().items() if ".mlp." not in k}
    missing, unexpected = moe.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert all(".mlp." in k for k in missing), [k for k in missing if ".mlp." not in k]
    with torch.no_grad():
        for ld, lm in zip(dense.model.layers, moe.model.layers):
            gu = torch.cat([ld.mlp.gate_proj.weight, ld.mlp.up_proj.weight], 0)
            lm.mlp.experts.gate_up_proj.copy_(gu[None].expand(experts, -1, -1))
            lm.mlp.experts.down_proj.copy_(ld.mlp.down_proj.weight[None].expand(experts, -1, -1))
            lm.mlp.gate.weight.normal_(0, 0.02)
    return moe


t0 = time.time()
loaded = pipeline.load(None, device="cpu", dtype=torch.float32)
dense, tok = loaded.model, loaded.tokenizer
ids = tokenize(tok, load_text())
calib = calibration_batches(tok, n_samples=8, seq_len=256, seed=0)
rows = []


def ppl(m):
    return perplexity(m, ids, max_tokens=a.max_tokens, window=1024).perplexity


moe = upcycle(dense, a.experts)
rows.append(dict(recipe="float", dense=ppl(dense), moe=ppl(moe)))
print(rows[-1], flush=True)
for r in a.recipes.split(","):
    d = lowbit.quantize_model(copy.deepcopy(dense), r, calibration=calib, progress=False)
    m = lowbit.quantize_model(copy.deepcopy(moe), r, calibration=calib, progress=False)
    rows.append(dict(recipe=r, dense=ppl(d), moe=ppl(m)))
    print(rows[-1], flush=True)
    del d, m
json.dump(dict(meta=dict(torch=torch.__version__, transformers=__import__("transformers").__version__,
                         python=platform.python_version(), corpus=describe_source(), max_tokens=a.max_tokens,
                         window=1024, experts=a.experts, top_k=2, seconds=round(time.time() - t0, 1),
                         command="python3 benchmarks/cpu_moe_upcycled_ppl.py " + " ".join(sys.argv[1:])),
               rows=rows), open(a.out, "w"), indent=1)
