import sys, torch
sys.path.insert(0, "tests/kernels")
import test_decode_attention_variants as t
for fmt in ("int8", "fp8_e4m3", None):
    for kw in ({}, {"block_n": 16}, {"block_n": 32}, {"rescale_log2": 0.0}, {"block_n": 8, "num_splits": 1}):
        try:
            t._check("fma", fmt, torch.bfloat16, 4, [4, 4097, 9000, 300, 2048], 32, 8, 128, 64, seed=192, **kw)
            print(fmt, kw, "OK")
        except AssertionError as e:
            print(fmt, kw, "FAIL", str(e).splitlines()[0])
        except Exception as e:
            print(fmt, kw, "ERROR", type(e).__name__, str(e)[:120])
