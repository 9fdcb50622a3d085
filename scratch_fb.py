import statistics, time, torch
import flashflow
from flashflow.ops import attention as A
from torch.nn.attention import sdpa_kernel, SDPBackend
q = torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn_like(q, requires_grad=True); v = torch.randn_like(q, requires_grad=True)
g = torch.randn_like(q)
qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)); gt = g.transpose(1, 2).contiguous()
def ff():
    flashflow.flash_attn_func(q, k, v).backward(g)
def sd():
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(qt, kt, vt).backward(gt)
new_grad_entry = A._grad_entry
def side(name):
    A._ENTRIES.clear()
    A._grad_entry = new_grad_entry if name == "new" else (lambda *a, **kw: None)
res = {"old": [], "new": [], "sdpa-flash": []}
for r in range(15):
    order = ["old", "new", "sdpa-flash"]
    order = order[r % 3:] + order[:r % 3]
    for name in order:
        fn = sd if name == "sdpa-flash" else ff
        if name != "sdpa-flash": side(name)
        for _ in range(20): fn()
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(200): fn()
        torch.cuda.synchronize(); res[name].append((time.perf_counter() - t) / 200 * 1e6)
for name, xs in res.items(): print(name, "median us", round(statistics.median(xs), 1), "min", round(min(xs), 1))
for a in ("old", "new"):
    print(a, "/ sdpa-flash per round, median", round(statistics.median([x / y for x, y in zip(res[a], res["sdpa-flash"])]), 3))
print("old/new per round, median", round(statistics.median([x / y for x, y in zip(res["old"], res["new"])]), 3))
