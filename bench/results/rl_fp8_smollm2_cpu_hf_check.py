"""Independent check of the FP8 rollout's zero-shot accuracy: transformers' SmolLM2 (bf16), greedy on the 200
held-out prompts (the recipe's prompt tokens), with and without FP8 fake quantization of the 7 linears per layer
(q, k, v, o, gate, up, down; per output row e4m3 weights, per token e4m3 activations, fp32 product, cast to bf16)."""
import json, sys, time, torch
from transformers import AutoModelForCausalLM
from megatron_hybrid.rl.tokenizers import HuggingFaceTokenizer
from megatron_hybrid.rl.rewards import exact_match, decode_response
torch.set_num_threads(1)
tok = HuggingFaceTokenizer("/tmp/models/smollm2-hf")
rows = [json.loads(l) for l in open("/tmp/rl/arith20s/test.jsonl")]
prompts = [tok.apply_chat_template(r["prompt"]) for r in rows]
model = AutoModelForCausalLM.from_pretrained("/tmp/models/smollm2-hf", dtype=torch.bfloat16).eval()
E4M3 = torch.float8_e4m3fn
def qdq(t):  # per row (last dim), e4m3, fp32
    t = t.float(); s = t.abs().amax(-1, keepdim=True) / 448.0; s[s == 0] = 1.0
    return (t / s).to(E4M3).float() * s
def fp8_forward(self, x):
    return torch.nn.functional.linear(qdq(x), self._wdq).to(x.dtype) + (0 if self.bias is None else self.bias)
mode = sys.argv[1]
if mode == "fp8":
    import types
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.split(".")[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            m._wdq = qdq(m.weight); m.forward = types.MethodType(fp8_forward, m); n += 1
    print("fp8 linears", n)
eos = tok.eod
correct, t0 = 0, time.time()
for i in range(0, len(prompts), 25):
    batch = prompts[i:i + 25]; L = max(map(len, batch))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in batch]); att = (torch.arange(L)[None] >= torch.tensor([L - len(p) for p in batch])[:, None]).long()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=32, do_sample=False, eos_token_id=eos, pad_token_id=0)
    for j, r in enumerate(out[:, L:].tolist()):
        correct += exact_match(decode_response(tok, r), rows[i + j]["answer"])
print(mode, "accuracy", correct / len(prompts), "seconds", round(time.time() - t0))
