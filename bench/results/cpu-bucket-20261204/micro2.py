"""Attention forward (one layer) of the torch backend, bucket policies alternated in one process."""
import os, sys, time, statistics, random
from types import SimpleNamespace
import torch
import roofline.attention.torch_backend as tb
from roofline.attention.backend import AttentionMetadata

torch.set_num_threads(int(os.environ.get("NT", "2")))
H, HKV, D, BS = 9, 3, 64, 16
mix = sys.argv[1]
if mix == "mainjob":
    prompts = [36,36,37,38,39,39,40,40,42,43,43,46,47,49,49,60,65,68,74,98,107,122,131,145,208,243,357,450,596,629,770,861]
    lens = [p + 20 + 64 for p in prompts]
else:  # "lo-hi-R": R rows uniform in [lo, hi]
    lo, hi, R = map(int, mix.split("-"))
    rng = random.Random(0); lens = [rng.randint(lo, hi) for _ in range(R)]
NB = sum(-(-n // BS) for n in lens) + 2

def quarter(n, bs):
    b = 1
    while b < n:
        b = b + 1 if b < 4 else (b * 5 + 3) // 4
    return b
def capped(keys):
    def f(n, bs):
        old = tb.DECODE_BUCKET_MAX_STEP_KEYS; tb.DECODE_BUCKET_MAX_STEP_KEYS = keys
        try: return new(n, bs)
        finally: tb.DECODE_BUCKET_MAX_STEP_KEYS = old
    return f
new = tb.decode_bucket
policies = {"quarter": quarter, "pow2": capped(1 << 30), "cap512": capped(512), "cap256": capped(256), "cap128": capped(128)}
rope = SimpleNamespace(cos_sin_cache=torch.cat([torch.ones(8192, D // 2), torch.zeros(8192, D // 2)], -1))
be = tb.TorchAttentionBackend(H, HKV, D, rope)
be.kv_pool = SimpleNamespace(block_size=BS)
cache = be.allocate_kv_cache(1, NB, BS, torch.float32, torch.device("cpu"))[0]
cache.k.normal_(); cache.v.normal_()
tables, used = [], 1
for n in lens:
    nb = -(-n // BS); tables.append(list(range(used, used + nb))); used += nb
width = max(map(len, tables))
slots = [t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lens)]
meta = AttentionMetadata(slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
    seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
    max_query_len=1, seq_lens_cpu=list(lens), query_lens_cpu=[1] * len(lens))
q = torch.randn(len(lens), H, D); k = torch.randn(len(lens), HKV, D); v = torch.randn(len(lens), HKV, D)
pos = torch.tensor([n - 1 for n in lens])
metas = {}
for name, f in policies.items():
    tb.decode_bucket = f
    metas[name] = be.build_metadata(meta)
    g = metas[name].decode_groups
    keys = sum(x.pad.shape[0] * x.pad.shape[-1] for x in g)
    print(f"{name}: {len(g)} groups, {keys} padded row-keys (useful {sum(lens)})", flush=True)
tb.decode_bucket = new
times = {n: [] for n in policies}
for r in range(int(sys.argv[2])):
    for name in policies:
        m = metas[name]
        t0 = time.perf_counter()
        for _ in range(5):
            be.forward(q, k, v, pos, cache, m)
        times[name].append((time.perf_counter() - t0) / 5 * 1e3)
for name in (policies if int(sys.argv[2]) else []):
    ts = sorted(times[name])
    print(f"{name}: min {ts[0]:.3f} q25 {ts[len(ts)//4]:.3f} med {statistics.median(ts):.3f} ms/layer")
