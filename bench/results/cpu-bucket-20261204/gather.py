import os, time, torch
torch.set_num_threads(int(os.environ.get("NT", "1")))
NB, W = 2912, 16 * 3 * 64
src = torch.randn(NB, W)
blocks = torch.randperm(NB)[:64 * 5]
def bench(f, reps=50):
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps): f()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    return best
out = torch.empty(blocks.numel(), W)
MB = blocks.numel() * W * 4 / 1e6
for name, f in [("index_select", lambda: src.index_select(0, blocks)),
                ("index_select out=", lambda: torch.index_select(src, 0, blocks, out=out)),
                ("src[blocks]", lambda: src[blocks]),
                ("clone contiguous slice", lambda: src[:blocks.numel()].clone()),
                ("copy_ slice", lambda: out.copy_(src[:blocks.numel()])),
                ("index_select 3d", lambda: src.view(NB, 16, 192).index_select(0, blocks)),
                ]:
    t = bench(f)
    print(f"{name}: {t:.0f} us for {MB:.1f} MB = {MB / t * 1e3:.1f} GB/s")
