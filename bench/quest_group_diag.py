"""How Quest's page choice behaves on the default model, outside kvc: transformers' SmolLM2-135M with
a custom decode attention that reads only the chosen pages (prefill dense, the first `dense` layers
dense, pages of `page` tokens, the newest page always), on kvc eval's cases. Modes:
- `full`: dense decode;
- `head`: the paper's per-query-head bound;
- `group`: kvc's quest.kvm, the max of the bound over the GQA group, one page set per KV head;
- `soft`: the group's per-head softmax of the bound, summed;
- `union`: each head's own top pages, read together;
- `split`: each query head's own top budget/group pages, read together (the shared set's bytes);
- `centroid_group`: q . the page's mean key, max over the group;
- `oracle_group`: the true attention mass per page, max over the group;
- `stats`: dense decode; prints, per rule, page size and layer, the true attention mass that the
  rule's pages hold (`--bands` adds the bound over RoPE's slow / fast channels alone).
Knobs: `--dense=2,4` (dense layers), `--page=16,8` (page size in tokens), each a comma list run in
turn; `-v` prints every answer. Each case's dense prefill is kept in $QUEST_DIAG_PREFILLS
(/tmp/quest_diag_prefills) between runs.
Usage: python bench/quest_group_diag.py passkey 4096 10 full,group,head 512 --page=16,8   (docs/accuracy.md)"""
import hashlib
import os
import sys
import torch
import time
from transformers import AutoModelForCausalLM, AutoTokenizer, AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from kvc.runtime.default_model import ensure_default_model
from kvc.runtime.eval.tasks import make_cases, TASKS

torch.set_num_threads(1)
d = ensure_default_model("/tmp/kvccache")
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
CFG = {"mode": "full", "budget": 512, "page": 16, "dense": 2}

STATS = {}  # (estimator, layer) -> [mass the chosen pages hold, per decode step and query head]


def estimates(query, key, P):
    """Each estimator's page scores [H, pages] for one decode step, and the true mass per page."""
    B, H, _, D = query.shape
    g = H // key.shape[1]
    n = key.shape[2]
    pages = -(-n // P)
    pad = pages * P - n
    kk = key.repeat_interleave(g, 1)[0]  # [H, n, D]
    q = query[0, :, 0]  # [H, D]
    kmax = torch.nn.functional.pad(kk, (0, 0, 0, pad), value=-1e30).view(H, pages, P, D).amax(2)
    kmin = torch.nn.functional.pad(kk, (0, 0, 0, pad), value=1e30).view(H, pages, P, D).amin(2)
    counts = torch.full((pages,), float(P))
    counts[-1] = n - (pages - 1) * P
    kmean = torch.nn.functional.pad(kk, (0, 0, 0, pad)).view(H, pages, P, D).sum(2) / counts[None, :, None]
    qv = q[:, None, :]
    per_channel = torch.maximum(qv * kmax, qv * kmin)  # [H, pages, D]
    est = {"bound": per_channel.sum(-1), "centroid": (qv * kmean).sum(-1)}
    if "--bands" in sys.argv:  # the bound over RoPE's slow channels only (rotate_half: i and i + D/2 pair;
        slow = (torch.arange(D) % (D // 2)) >= D // 4  # frequency base^(-2i/D) falls with i)
        est["boundslow"] = per_channel[..., slow].sum(-1)
        est["boundfast"] = per_channel[..., ~slow].sum(-1)
    logits = torch.einsum("hd,hnd->hn", q, kk) / D ** 0.5
    prob = torch.softmax(logits, -1)
    mass = torch.nn.functional.pad(prob, (0, pad)).view(H, pages, P).sum(-1)
    est["oracle"] = mass
    return est, mass, g


def choose(score, ntop, g, group):
    """The page set per query head [H, pages] (bool): top ntop by score plus the newest page;
    group: one set per KV head, ranked by the max of the score over the group."""
    H, pages = score.shape
    s = score.view(H // g, g, pages).amax(1).repeat_interleave(g, 0) if group else score.clone()
    s[:, pages - 1] = -float("inf")
    sel = torch.zeros(H, pages, dtype=torch.bool)
    sel.scatter_(-1, s.topk(min(ntop, pages - 1), -1).indices, True)
    sel[:, pages - 1] = True
    return sel


def record_stats(layer, query, key, scaling):
    P = CFG["page"]
    est, mass, g = estimates(query, key, P)
    ntop = CFG["budget"] // P - 1
    for name, score in est.items():
        for group in (True, False):
            sel = choose(score, ntop, g, group)
            got = (mass * sel).sum(-1)  # [H]
            key = f"{name}_{'group' if group else 'head'}/p{P}"
            STATS.setdefault((key, layer), []).extend(got.tolist())


def quest_attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    B, H, qn, D = query.shape
    Hkv, n = key.shape[1], key.shape[2]
    g = H // Hkv
    if qn == 1 and CFG["mode"] == "stats":
        record_stats(module.layer_idx, query, key, scaling)
    if qn != 1 or CFG["mode"] in ("full", "stats") or module.layer_idx < CFG["dense"]:
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

args = [a for a in sys.argv[1:] if not a.startswith("-")]
knobs = {}
for a in sys.argv[1:]:  # knobs: --dense=N (dense layers), --page=N (page size in tokens); a comma list runs each
    if a.startswith("--") and "=" in a:
        k, v = a[2:].split("=")
        knobs[k] = [int(x) for x in v.split(",")]
PREFILLS = os.environ.get("QUEST_DIAG_PREFILLS", "/tmp/quest_diag_prefills")


def prefill(c):
    """The dense prefill's cache and first token of case c, kept on disk between runs (same model,
    same prompt: the prefill never depends on the page choice)."""
    path = os.path.join(PREFILLS, f"{c.task}-{c.length}-{c.index}-{hashlib.sha256(str(c.prompt).encode()).hexdigest()[:12]}.pt")
    if os.path.exists(path):
        saved = torch.load(path)
    else:
        CFG.update(mode="full")
        with torch.no_grad():
            pre = model(torch.tensor([c.prompt]), use_cache=True)
        kv = pre.past_key_values
        saved = {"first": int(pre.logits[0, -1].argmax()),
                 "k": [layer.keys for layer in kv.layers], "v": [layer.values for layer in kv.layers]}
        os.makedirs(PREFILLS, exist_ok=True)
        torch.save(saved, path)
    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(saved["k"], saved["v"])):
        cache.update(k, v, i)
    return cache, saved["first"]


task, length, count = args[0], int(args[1]), int(args[2])
modes = args[3].split(",")
budgets = [int(b) for b in args[4].split(",")]
settings = []  # (mode, budget, dense, page)
for mode in modes:
    for budget in (budgets if mode != "full" else [0]):
        for dense in (knobs.get("dense", [2]) if mode != "full" else [0]):
            for page in (knobs.get("page", [16]) if mode != "full" else [16]):
                settings.append((mode, budget, dense, page))
cases = make_cases(task, tok, length, count, 0)
T = TASKS[task] if isinstance(TASKS, dict) else None
score = {st: [] for st in settings}
t0 = time.time()
for c in cases:  # one dense prefill per case; every setting decodes from a copy of its cache
    cache, first = prefill(c)
    for st in settings:
        CFG.update(mode=st[0], budget=st[1], dense=st[2], page=st[3])
        cache.crop(len(c.prompt))
        out = [first]
        with torch.no_grad():
            while len(out) < c.max_tokens and out[-1] not in c.stop_token_ids:
                o = model(torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True)
                out.append(int(o.logits[0, -1].argmax()))
        text = tok.decode(out, skip_special_tokens=True)
        good = T.correct(c.answer, text) if T else c.answer in text
        score[st].append(int(good))
        if "-v" in sys.argv:
            print(c.index, st, c.answer, repr(text), good, flush=True)
if STATS:  # the mass of the true attention (softmax over all keys) that each rule's pages hold
    names = sorted({k[0] for k in STATS})
    layers = sorted({k[1] for k in STATS})
    print("mean over steps and query heads of the true attention mass on the chosen pages / its minimum")
    print("layer " + " ".join(f"{n:>22}" for n in names))
    for layer in layers:
        print(f"{layer:5d} " + " ".join(
            f"{sum(STATS[n, layer]) / len(STATS[n, layer]):14.3f}/{min(STATS[n, layer]):7.3f}" for n in names))
    print("mean  " + " ".join(f"{sum(sum(STATS[n, l]) / len(STATS[n, l]) for l in layers) / len(layers):22.3f}"
                              for n in names))
for st in settings:
    mode, budget, dense, page = st
    print(f"{task} {length} {mode}@{budget} dense={dense} page={page}: {sum(score[st])}/{len(cases)}  "
          f"cases {''.join(map(str, score[st]))}", flush=True)
print(f"({time.time() - t0:.0f}s)")
