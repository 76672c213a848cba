"""How Quest's page choice behaves on the default model, outside kvc: transformers' SmolLM2-135M with
a custom decode attention that reads only the chosen pages (prefill dense, the first 2 layers dense,
pages of 16, the newest page always), on kvc eval's cases. Modes: `full`
`head` (the paper's
per-query-head bound)
`group` (kvc's quest.kvm: the max of the bound over the GQA group, one page
set per KV head)
`soft` (the group's per-head softmax of the bound, summed)
`union` (each head's own
top pages, read together)
`split` (each query head's own top budget/group pages, read together: the shared set's bytes)
`centroid_group` (q . the page's mean key, max over the group)
`oracle_group` (the true attention mass per page, max over the group).
Usage: python bench/quest_group_diag.py passkey 4096 10 full,group,head 512   (docs/accuracy.md)"""
import sys
import torch
import time
from transformers import AutoModelForCausalLM, AutoTokenizer, AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from kvc.runtime.default_model import ensure_default_model
from kvc.runtime.eval.tasks import make_cases, TASKS

torch.set_num_threads(1)
d = ensure_default_model("/tmp/kvccache")
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
CFG = {"mode": "full", "budget": 512, "page": 16, "dense": 2}

def quest_attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    B, H, qn, D = query.shape
    Hkv, n = key.shape[1], key.shape[2]
    g = H // Hkv
    if qn != 1 or CFG["mode"] == "full" or module.layer_idx < CFG["dense"]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw)
    P = CFG["page"]
    pages = -(-n // P)
    kk = key.repeat_interleave(g, 1)  # [B,H,n,D]
    vv = value.repeat_interleave(g, 1)
    logits = (query @ kk.transpose(-1, -2))[:, :, 0] * scaling  # [B,H,n]
    pad = pages * P - n
    kmax = torch.nn.functional.pad(kk, (0, 0, 0, pad), value=-1e30).view(B, H, pages, P, D).amax(3)
    kmin = torch.nn.functional.pad(kk, (0, 0, 0, pad), value=1e30).view(B, H, pages, P, D).amin(3)
    qv = query[:, :, 0, None, :]
    bound = torch.maximum(qv * kmax, qv * kmin).sum(-1)  # [B,H,pages]
    mode = CFG["mode"]
    if mode.startswith("centroid"):  # an estimate, not a bound: q . (mean key of the page)
        kmean = torch.nn.functional.pad(kk, (0, 0, 0, pad)).view(B, H, pages, P, D).sum(3)
        counts = torch.full((pages,), float(P))
        counts[-1] = n - (pages - 1) * P
        bound = (qv * (kmean / counts[:, None])).sum(-1)
    if mode.startswith("oracle"):
        prob = torch.softmax(logits, -1)
        bound = torch.nn.functional.pad(prob, (0, pad)).view(B, H, pages, P).sum(-1)
    if mode.endswith("group"):
        bound = bound.view(B, Hkv, g, pages).amax(2).repeat_interleave(g, 1)
    if mode.endswith("soft"):
        b = bound.masked_fill(torch.arange(pages) == pages - 1, -float("inf"))
        bound = torch.softmax(b * scaling, -1).view(B, Hkv, g, pages).sum(2).repeat_interleave(g, 1)
    if mode.endswith("union") or mode == "split":
        ntop = CFG["budget"] // P - 1
        if mode == "split":  # each query head's share of one KV head's budget
            ntop = max(1, ntop // g)
        b2 = bound.clone()
        b2[..., pages - 1] = -float("inf")
        idx = b2.topk(min(ntop, pages - 1), -1).indices
        s = torch.zeros(B, H, pages)
        s.scatter_(-1, idx, 1.0)
        u = s.view(B, Hkv, g, pages).amax(2).repeat_interleave(g, 1).bool()
        u[..., pages - 1] = True
        mask = u.repeat_interleave(P, -1)[..., :n]
        logits = logits.masked_fill(~mask, -float("inf"))
        out = (torch.softmax(logits, -1)[:, :, None, :] @ vv)
        return out.transpose(1, 2).contiguous(), None
    ntop = CFG["budget"] // P - 1
    b2 = bound.clone()
    b2[..., pages - 1] = -float("inf")
    top = b2.topk(min(ntop, pages - 1), -1).indices
    sel = torch.zeros(B, H, pages, dtype=torch.bool)
    sel.scatter_(-1, top, True)
    sel[..., pages - 1] = True
    mask = sel.repeat_interleave(P, -1)[..., :n]
    logits = logits.masked_fill(~mask, -float("inf"))
    p = torch.softmax(logits, -1)
    out = (p[:, :, None, :] @ vv)  # [B,H,1,D]
    return out.transpose(1, 2).contiguous(), None

AttentionInterface.register("quest_diag", quest_attn)
model.config._attn_implementation = "quest_diag"
for layer in model.model.layers:
    layer.self_attn.config._attn_implementation = "quest_diag"

task, length, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
modes = sys.argv[4].split(",")
budgets = [int(b) for b in sys.argv[5].split(",")]
cases = make_cases(task, tok, length, count, 0)
T = TASKS[task] if isinstance(TASKS, dict) else None
for mode in modes:
    for budget in (budgets if mode != "full" else [0]):
        CFG.update(mode=mode, budget=budget)
        ok = 0
        t = time.time()
        for c in cases:
            ids = torch.tensor([c.prompt])
            out = model.generate(ids, max_new_tokens=c.max_tokens, do_sample=False,
                                 eos_token_id=list(c.stop_token_ids) or None)
            text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            good = T.correct(c.answer, text) if T else c.answer in text
            ok += good
        print(f"{task} {length} {mode}@{budget}: {ok}/{len(cases)}  ({time.time()-t:.0f}s)", flush=True)
