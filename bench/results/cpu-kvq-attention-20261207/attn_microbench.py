import time, torch
from roofline.kernels import cpu_paged_attention as cpa
torch.manual_seed(0)
H, Hkv, D, bs = 9, 3, 64, 16
ctx = 512; nb = ctx // bs + 1
kc = torch.randn(nb * 4, bs, Hkv, D); vc = torch.randn_like(kc)
n = 32
q = torch.randn(n, H, D); out = torch.empty_like(q)
tables = torch.arange(nb).repeat(n, 1).contiguous()
lens = torch.full((n,), ctx, dtype=torch.int64); rows = torch.arange(n)
k8 = (kc / 0.05).round().clamp(-127, 127).to(torch.int8); v8 = (vc / 0.05).round().clamp(-127, 127).to(torch.int8)
ks = torch.full(kc.shape[:3], 0.05); vs = ks.clone()
kf8 = kc.to(torch.float8_e4m3fn); vf8 = vc.to(torch.float8_e4m3fn); hs = torch.ones(Hkv)
for name, args, kw in (("fp32", (kc, vc), {}), ("int8", (k8, v8), dict(k_scale=ks, v_scale=vs)), ("fp8", (kf8, vf8), dict(k_scale=hs, v_scale=hs))):
    for _ in range(3): cpa.paged_decode_attention(q, *args, tables, lens, rows, 0.125, out, **kw)
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10): cpa.paged_decode_attention(q, *args, tables, lens, rows, 0.125, out, **kw)
        ts.append((time.perf_counter() - t0) * 100)
    print(f"{name}: 32 rows x {ctx} keys, one layer {min(ts):.3f} ms")
