"""Pipeline parallelism on CPU (gloo): stages hold consecutive layers and pass (hidden, residual) with send/recv.

- PP=2 worker processes on the default model in fp32 give the single-process engine's greedy tokens (also
  under preemption, seeded sampling and logprobs), each stage holding half the layers' KV;
- TP=3 x PP=2 (six processes) with ``int8`` weights gives the single-process int8 engine's tokens up to near ties (row-parallel
  shards quantize weights and, W8A8 on CPU, activations with the whole row's scales), and serves the OpenAI API until a worker is killed (503);
- two ``torchrun`` "nodes" on loopback (``external_launcher``, one stage each) give the same tokens;
- the stage split, its checkpoint routing and the micro-batch split are checked in-process.

The default model has 30 layers, 9 attention heads and 3 KV heads: TP=2 is refused (TP=3 is its smallest
tensor-parallel size). Two engines serve the module: PP=2 (~18 s to start on 2 cores) and TP=3 x PP=2 (~40 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from roofline import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
# A pool of 14 blocks of 16 tokens: six 60-token sequences do not fit at once, so some are preempted.
COMMON = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=14, block_size=16,
              max_num_batched_tokens=512)
PREEMPT = [{"prompt_token_ids": list(range(100 + 7 * i, 120 + 7 * i))} for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
LOGPROB_TOL = 1e-4  # fp32; micro-batches change GEMM row counts, so rounding (not the math) may differ
# int8 on CPU is W8A8 dynamic (roofline.kernels.cpu_int8): activations are rounded to INT8 per token, so the last
# bit of an fp32 all-reduce (TP's partial sums, in gloo's order) can move a code by one step, which a 135M model
# carries into its logprobs (measured 0.31 at most over these prompts, tokens identical; PP alone: bit-identical).
LOGPROB_TOL_W8A8_TP = 0.5


def _assert_same_up_to_near_ties(got_outs, ref_outs, tol: float) -> None:
    """Greedy tokens identical, except that a sequence may leave the reference at a near tie: a position where
    the other engine took a token within ``tol`` nats of the reference's choice among the reference's top-2
    logprobs. Comparing stops there (the continuations differ). Up to that point the chosen tokens' logprobs agree
    within ``tol``. At least half of all positions must be compared, so a run that diverges early fails.

    Why: W8A8 under TP rounds the fp32 all-reduce's last bit into an INT8 code step (see LOGPROB_TOL_W8A8_TP);
    which near tie that flips depends on the CPU's kernels (AMD EPYC: none of these prompts; an AMX Xeon,
    2026-12-04: two of the three prompts, 21 of 36 positions compared)."""
    compared = total = 0
    for g, r in zip(got_outs, ref_outs, strict=True):
        gi, ri = list(g.outputs[0].token_ids), list(r.outputs[0].token_ids)
        total += len(ri)
        for pos, (a, b) in enumerate(zip(gi, ri, strict=True)):
            ref_lp = r.outputs[0].logprobs[pos]
            if a != b:
                assert a in ref_lp, f"position {pos}: token {a} is not among the reference's top-2 {list(ref_lp)}"
                assert ref_lp[b].logprob - ref_lp[a].logprob < tol, (pos, a, b, ref_lp)
                break
            assert abs(g.outputs[0].logprobs[pos][a].logprob - ref_lp[a].logprob) < tol, (pos, a)
            compared += 1
    assert compared >= 0.5 * total, f"only {compared} of {total} positions agree before a divergence"


def _ids(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def _max_logprob_diff(a_outs, b_outs) -> float:
    return max(abs(x[t].logprob - y[t].logprob)
               for a, b in zip(a_outs, b_outs, strict=True)
               for x, y, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids, strict=True))


@pytest.fixture(scope="module")
def single():
    return LLM(**COMMON)


@pytest.fixture(scope="module")
def pp2():
    llm = LLM(pipeline_parallel_size=2, **COMMON)
    yield llm
    llm.engine.executor.shutdown()


def test_pp2_greedy_and_logprobs_match_one_process(single, pp2):
    from roofline.worker.multiproc_executor import MultiprocExecutor

    assert isinstance(pp2.engine.executor, MultiprocExecutor) and len(pp2.engine.executor.procs) == 2
    got, ref = pp2.generate(PROMPTS, GREEDY, use_tqdm=False), single.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _ids(got) == _ids(ref)
    assert _max_logprob_diff(got, ref) < LOGPROB_TOL
    # Rank 0 is stage 0: 15 of the 30 layers, so half the single engine's KV bytes per token; a decode step
    # reads both stages, so the floor counts both (the embedding on stage 0, the norm and head on stage 1).
    infos = pp2.engine.executor.rank_infos
    assert [i.kv_bytes_per_token * 2 for i in infos] == [single.engine.worker.kv_bytes_per_token] * 2
    assert pp2.engine.worker.kv_bytes_per_token == single.engine.worker.kv_bytes_per_token
    assert pp2.engine.worker.weight_bytes_per_step == single.engine.worker.weight_bytes_per_step
    sp = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1)
    a, b = pp2.generate(PROMPTS[:2], sp, use_tqdm=False), single.generate(PROMPTS[:2], sp, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert x.prompt_logprobs[0] is None and len(x.prompt_logprobs) == len(y.prompt_logprobs)
        for p, q, t in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], x.prompt_token_ids[1:], strict=True):
            assert abs(p[t].logprob - q[t].logprob) < LOGPROB_TOL


def test_pp2_under_preemption_and_seeded_sampling(single, pp2):
    greedy = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)  # 6 x 48 tokens > the 224-token pool
    before = pp2.engine.scheduler.num_preemptions
    assert _ids(pp2.generate(PREEMPT, greedy, use_tqdm=False)) == _ids(single.generate(PREEMPT, greedy,
                                                                                      use_tqdm=False))
    assert pp2.engine.scheduler.num_preemptions > before
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=8, n=2)
    assert ([[list(c.token_ids) for c in o.outputs] for o in pp2.generate(PROMPTS, seeded, use_tqdm=False)]
            == [[list(c.token_ids) for c in o.outputs] for o in single.generate(PROMPTS, seeded, use_tqdm=False)])


def test_a_killed_last_stage_is_reported_by_rank(pp2):
    """Runs after the other pp2 tests: killing the last stage (the one that samples) leaves stage 0 waiting in
    a collective; the driver still reports rank 1 within seconds and refuses further steps."""
    from roofline.worker.executor import ExecutorDeadError

    proc = pp2.engine.executor.procs[1]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=10)
    t0 = time.monotonic()
    with pytest.raises(ExecutorDeadError, match=r"worker rank 1 \(pid \d+\) died with exit code -9"):
        pp2.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert time.monotonic() - t0 < 30


@pytest.fixture(scope="module")
def tp3pp2_int8():
    llm = LLM(tensor_parallel_size=3, pipeline_parallel_size=2, quantization="int8", **COMMON)
    yield llm
    llm.engine.executor.shutdown()


def test_tp3_x_pp2_int8_matches_one_process(tp3pp2_int8):
    assert len(tp3pp2_int8.engine.executor.procs) == 6
    single = LLM(quantization="int8", **COMMON)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)  # six processes on 2 cores
    got, ref = tp3pp2_int8.generate(PROMPTS, sp, use_tqdm=False), single.generate(PROMPTS, sp, use_tqdm=False)
    _assert_same_up_to_near_ties(got, ref, LOGPROB_TOL_W8A8_TP)
    # Rank 0 holds stage 0 (15 layers) and one of the 3 KV heads: a sixth of the single engine's KV bytes.
    assert tp3pp2_int8.engine.executor.rank_infos[0].kv_bytes_per_token * 6 == single.engine.worker.kv_bytes_per_token
    assert tp3pp2_int8.engine.worker.kv_bytes_per_token == single.engine.worker.kv_bytes_per_token


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's exit
def test_server_on_tp3_x_pp2_then_503_after_a_worker_dies(tp3pp2_int8):
    """The OpenAI server on the TP=3 x PP=2 engine answers as the offline API does; after a worker is killed,
    the engine thread stops and /health and new requests answer 503 (``engine_dead``), never a hang."""
    import urllib.error
    import urllib.request

    from roofline.server.app import BackgroundServer, build_app
    from roofline.server.async_engine import AsyncLLMEngine

    want = tp3pp2_int8.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8),
                                use_tqdm=False)[0].outputs[0].text
    engine = AsyncLLMEngine(tp3pp2_int8.engine)
    engine.start()
    try:
        with BackgroundServer(build_app(engine)) as srv:
            def post(timeout=60):
                body = json.dumps({"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}).encode()
                req = urllib.request.Request(srv.url + "/v1/completions", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    return json.loads(r.read())

            assert post()["choices"][0]["text"] == want
            proc = tp3pp2_int8.engine.executor.procs[4]  # stage 1, tensor-parallel rank 1
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(timeout=10)
            codes = []
            for _ in range(2):  # the request that meets the dead worker, then one after the engine stopped
                try:
                    post()
                    codes.append(200)
                except urllib.error.HTTPError as e:
                    codes.append(e.code)
            assert codes == [503, 503], codes  # engine_dead, for the request in flight too
            with pytest.raises(urllib.error.HTTPError) as health:
                urllib.request.urlopen(srv.url + "/health", timeout=10)
            assert health.value.code == 503 and b"rank 4" in health.value.read()
    finally:
        engine.stop()


_TORCHRUN_SCRIPT = """
import json, os, sys
from roofline import LLM, SamplingParams
llm = LLM(pipeline_parallel_size=2, distributed_executor_backend="external_launcher", **json.loads(sys.argv[1]))
sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
out = [list(o.outputs[0].token_ids) for o in llm.generate(json.loads(sys.argv[2]), sp, use_tqdm=False)]
with open(os.path.join(sys.argv[3], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(out, f)
llm.engine.executor.shutdown()
"""


def test_two_torchrun_nodes_on_loopback(single, tmp_path: Path):
    """Two torchrun launches, each a "node" of one process (--nnodes 2 --node-rank r, env:// on 127.0.0.1,
    gloo): the ``external_launcher`` backend runs the engine on both, one pipeline stage each. Both ranks
    produce the single-process engine's greedy tokens."""
    import socket

    script = tmp_path / "run.py"
    script.write_text(_TORCHRUN_SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([str(torchrun), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r),
                               "--master-addr", "127.0.0.1", "--master-port", str(port), str(script),
                               json.dumps(COMMON), json.dumps(PROMPTS), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref = _ids(single.generate(PROMPTS, sp, use_tqdm=False))
    for r in range(2):
        assert json.loads((tmp_path / f"rank{r}.json").read_text()) == ref


def test_startup_errors_name_the_values():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size 31 exceeds the model's 30 layers \(allowed: 1 "
                                         r"to 30\)"):
        LLM(pipeline_parallel_size=31, **COMMON)
    with pytest.raises(ValueError, match=r"partition \[15, 15\] has 2 stages' counts, but pipeline_parallel_size "
                                         r"is 1"):
        LLM(pipeline_layer_partition="15,15", **COMMON)
    with pytest.raises(ValueError, match=r"pipeline layer partition \[20, 20\] must give each of the 2 stages >= 1 "
                                         r"layer and sum to the model's 30 layers \(it sums to 40\)"):
        LLM(pipeline_parallel_size=2, pipeline_layer_partition="20,20", **COMMON)
    with pytest.raises(ValueError, match=r"pipeline_layer_partition must be comma-separated layer counts .*'a,b'"):
        LLM(pipeline_parallel_size=2, pipeline_layer_partition="a,b", **COMMON)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size must be an integer >= 1, got 0"):
        LLM(pipeline_parallel_size=0, **COMMON)
    with pytest.raises(ValueError, match=r"async_scheduling with pipeline_parallel_size > 1 is not built"):
        LLM(pipeline_parallel_size=2, async_scheduling=True, **COMMON)
    with pytest.raises(ValueError, match=r"kv_cache_dtype fp8_e4m3 .* pipeline_parallel_size > 1"):
        LLM(pipeline_parallel_size=2, kv_cache_dtype="fp8_e4m3", **COMMON)
    with pytest.raises(ValueError, match=r"speculative decoding with tensor_parallel_size or pipeline_parallel_size"):
        LLM(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **COMMON)
    with pytest.raises(ValueError, match=r"'uni' runs one worker; tensor_parallel_size 1 x pipeline_parallel_size 2"):
        LLM(pipeline_parallel_size=2, distributed_executor_backend="uni", **COMMON)
    with pytest.raises(RuntimeError, match=r"'external_launcher' runs under torchrun, which sets RANK"):
        LLM(pipeline_parallel_size=2, distributed_executor_backend="external_launcher", **COMMON)


def test_server_refuses_external_launcher():
    from roofline.args import EngineArgs
    from roofline.server.app import build_app

    with pytest.raises(ValueError, match=r"'external_launcher' is for offline runs under torchrun"):
        build_app(EngineArgs(distributed_executor_backend="external_launcher", **COMMON))


def test_stage_layer_ranges():
    from roofline.distributed.parallel_state import stage_layer_ranges

    assert stage_layer_ranges(30, 2) == [(0, 15), (15, 30)]
    assert stage_layer_ranges(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]  # the remainder goes first
    assert stage_layer_ranges(30, 2, [20, 10]) == [(0, 20), (20, 30)]
    assert stage_layer_ranges(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match=r"partition \[0, 30\] must give each of the 2 stages >= 1 layer"):
        stage_layer_ranges(30, 2, [0, 30])


def test_micro_batches_split_consecutive_requests_by_tokens():
    from roofline.worker.pipeline import micro_batches

    decodes = [(i, 1) for i in range(6)]
    assert micro_batches(decodes, 2) == [decodes[:3], decodes[3:]]
    assert micro_batches(decodes, 4) == [decodes[:2], decodes[2:3], decodes[3:5], decodes[5:]]
    mixed = [(0, 100), (1, 1), (2, 1), (3, 1)]  # a prefill chunk, then decodes
    assert micro_batches(mixed, 2) == [mixed[:1], mixed[1:]]
    assert micro_batches([(0, 5), (1, 5)], 4) == [[(0, 5)], [(1, 5)]]  # at most one group per request
    assert micro_batches([(0, 7)], 3) == [[(0, 7)]]
    for n in range(1, 7):  # every request once, in order, no empty group
        groups = micro_batches(mixed + decodes, n)
        assert [x for g in groups for x in g] == mixed + decodes and all(groups) and len(groups) == n


@pytest.mark.parametrize("partition", [[2, 1], [1, 2]])
def test_stages_chained_by_hand_equal_the_whole_model(partition):
    """A tiny tied-embedding model split into two stages in one process: each stage builds only its layers
    (the last one its own LM head, loaded from the embedding), takes only its checkpoint tensors, and stage 0's
    (hidden, residual) fed to stage 1 gives the whole model's logits (fp32, within 1e-5)."""
    from roofline.attention import AttentionMetadata
    from roofline.attention.backend import get_attention_backend
    from roofline.config import ModelConfig
    from roofline.distributed.parallel_state import ParallelState, parallel_state, stage_layer_ranges
    from roofline.layers.rotary import RotaryEmbedding
    from roofline.models.llama import PPMissingLayer
    from roofline.models.loader import load_weights
    from roofline.models.registry import build_model

    cfg = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True)
    gen = torch.Generator().manual_seed(5)
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    state = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=gen) * 0.2,
             "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=gen)}
    for n in range(cfg.num_hidden_layers):
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, q)), ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
                            ("mlp.down_proj", (h, i)), ("input_layernorm", (h,)), ("post_attention_layernorm", (h,))):
            w = torch.randn(*shape, generator=gen) * 0.2
            state[f"model.layers.{n}.{name}.weight"] = w + 1 if len(shape) == 1 else w

    def build(ps: ParallelState, num_layers: int):
        with parallel_state(ps):
            rotary = RotaryEmbedding.from_config(cfg)
            backend = get_attention_backend("torch")(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                                     rotary)
            backend.allocate_kv_cache(num_layers, 4, 16, torch.float32, torch.device("cpu"))
            model = build_model(cfg, backend).eval()
            load_weights(model, iter(state.items()))
        return model, backend

    ranges = stage_layer_ranges(3, 2, partition)
    whole, wb = build(ParallelState(), 3)
    s0, b0 = build(ParallelState(pp_rank=0, pp_size=2, layer_range=ranges[0]), partition[0])
    s1, b1 = build(ParallelState(pp_rank=1, pp_size=2, layer_range=ranges[1]), partition[1])
    assert isinstance(s0.lm_head, PPMissingLayer) and isinstance(s1.model.embed_tokens, PPMissingLayer)
    assert sum(isinstance(m, PPMissingLayer) for m in s0.model.layers) == 3 - partition[0]
    assert s1.lm_head.weight.data_ptr() != 0 and torch.equal(s1.lm_head.weight, state["model.embed_tokens.weight"])

    t = 10
    meta = AttentionMetadata(
        slot_mapping=torch.arange(t, dtype=torch.int64), query_start_loc=torch.tensor([0, t], dtype=torch.int32),
        seq_lens=torch.tensor([t], dtype=torch.int32), block_tables=torch.zeros(1, 1, dtype=torch.int32),
        max_query_len=t, query_lens_cpu=[t], seq_lens_cpu=[t])
    ids, pos = torch.randint(0, cfg.vocab_size, (t,), generator=gen), torch.arange(t)
    with torch.inference_mode():
        want = whole.compute_logits(whole(ids, pos, wb.build_metadata(meta)))
        inter = s0(ids, pos, b0.build_metadata(meta))
        assert isinstance(inter, tuple) and inter[0].shape == inter[1].shape == (t, h)
        got = s1.compute_logits(s1(None, pos, b1.build_metadata(meta), inter))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
