"""Which FP8 choices cost SmolLM2-135M its zero-shot accuracy: transformers' LlamaForCausalLM in bf16, the 7 linears
per layer (q, k, v, o, gate, up, down) fake-quantized to e4m3 in fp32, greedy on the 200 held-out prompts (the
recipe's prompt tokens), exact match. One JSON line per call.

    python rl_fp8_smollm2_cpu_hf_variants.py --name all                           # the recipe's format
    python rl_fp8_smollm2_cpu_hf_variants.py --name fl1 --first-bf16 1 --last-bf16 1
    python rl_fp8_smollm2_cpu_hf_variants.py --name wonly --activations none      # weights only
    python rl_fp8_smollm2_cpu_hf_variants.py --name nodown --kinds q_proj k_proj v_proj o_proj gate_proj up_proj
    python rl_fp8_smollm2_cpu_hf_variants.py --name b128_g128 --weights b128 --activations g128   # DeepSeek-V3's

--weights: ``row`` (one scale per output row, the recipe's) or ``b128`` (128 x 128 blocks); --activations:
``token`` (one scale per token, the recipe's), ``g128`` (per token and 128 features) or ``none`` (bf16)."""
import argparse
import json
import time
import types

import torch
from transformers import AutoModelForCausalLM

from megatron_hybrid.rl.rewards import decode_response, exact_match
from megatron_hybrid.rl.tokenizers import HuggingFaceTokenizer

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--name", required=True)
ap.add_argument("--weights", choices=["row", "b128"], default="row")
ap.add_argument("--activations", choices=["token", "g128", "none"], default="token")
ap.add_argument("--first-bf16", type=int, default=0, help="layers at the start left in bf16")
ap.add_argument("--last-bf16", type=int, default=0, help="layers at the end left in bf16")
ap.add_argument("--kinds", nargs="+", default=ALL, choices=ALL)
ap.add_argument("--model", default="/tmp/models/smollm2-hf")
ap.add_argument("--prompts", default="/tmp/rl/arith20s/test.jsonl")
a = ap.parse_args()
torch.set_num_threads(1)
E4M3 = torch.float8_e4m3fn


def qdq_rows(t):  # one scale per row of the last dim
    t = t.float()
    s = t.abs().amax(-1, keepdim=True) / 448.0
    s[s == 0] = 1.0
    return (t / s).to(E4M3).float() * s


def qdq_groups(t, g=128):  # one scale per 1 x g group along the last dim
    K, pad = t.shape[-1], (-t.shape[-1]) % g
    x = torch.nn.functional.pad(t.float(), (0, pad)).reshape(*t.shape[:-1], -1, g)
    return qdq_rows(x).reshape(*t.shape[:-1], K + pad)[..., :K]


def qdq_blocks(w, g=128):  # g x g blocks of a 2-D weight
    N, K = w.shape
    pn, pk = (-N) % g, (-K) % g
    x = torch.nn.functional.pad(w.float(), (0, pk, 0, pn)).reshape((N + pn) // g, g, (K + pk) // g, g)
    s = x.abs().amax(dim=(1, 3), keepdim=True) / 448.0
    s[s == 0] = 1.0
    return ((x / s).to(E4M3).float() * s).reshape(N + pn, K + pk)[:N, :K]


act = {"token": qdq_rows, "g128": qdq_groups, "none": lambda v: v.float()}[a.activations]


def forward(self, x):
    return torch.nn.functional.linear(act(x), self._wdq).to(x.dtype)


tok = HuggingFaceTokenizer(a.model)
rows = [json.loads(line) for line in open(a.prompts)]
prompts = [tok.apply_chat_template(r["prompt"]) for r in rows]
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).eval()
L, n = model.config.num_hidden_layers, 0
for name, m in model.named_modules():
    if isinstance(m, torch.nn.Linear) and name.split(".")[-1] in a.kinds:
        layer = int(name.split(".layers.")[1].split(".")[0])
        if a.first_bf16 <= layer < L - a.last_bf16:
            m._wdq = qdq_rows(m.weight) if a.weights == "row" else qdq_blocks(m.weight)
            m.forward = types.MethodType(forward, m)
            n += 1
correct, t0 = 0, time.time()
for i in range(0, len(prompts), 25):
    batch = prompts[i:i + 25]
    P = max(map(len, batch))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in batch])
    mask = (torch.arange(P)[None] >= torch.tensor([P - len(p) for p in batch])[:, None]).long()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32, do_sample=False,
                             eos_token_id=tok.eod, pad_token_id=0)
    for j, r in enumerate(out[:, P:].tolist()):
        correct += exact_match(decode_response(tok, r), rows[i + j]["answer"])
print(json.dumps({"name": a.name, "weights": a.weights, "activations": a.activations, "first_bf16": a.first_bf16,
                  "last_bf16": a.last_bf16, "kinds": a.kinds, "fp8_linears": n, "accuracy": correct / len(prompts),
                  "seconds": round(time.time() - t0)}))
