"""Learned drafters (``roofline.spec_decode.{train,heads,eagle,medusa}``): training on a tiny random-weight
Llama (its loss falls), the EAGLE layer in the engine equal to the one trained, greedy identity and exact
sampling (chi-square) through the engine, and the errors. The default model's shipped head is tested in the
slow tests at the end.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.spec_config import SpeculativeConfig
from roofline.spec_decode import features, train, train_cli
from roofline.spec_decode.heads import DraftHeadConfig, EagleHead, load_head, save_head

from .tiny import CHATS, COMMON, DEFAULT, VOCAB

HEADS_DIR = Path(features.__file__).parent / "heads"  # the heads shipped for the default model


@pytest.fixture(scope="module")
def tiny_data(tiny):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, VOCAB, size=int(rng.integers(6, 14))).tolist() for _ in range(12)]
    seqs = train.regenerate(tiny, prompts, max_tokens=20)
    feats = [features.target_features(tiny, ids) for ids, _ in seqs]
    return seqs, feats


@pytest.fixture(scope="module")
def heads(tiny, tiny_data, tmp_path_factory):
    """{method: (dir, losses)}: each head trained 12 steps on the tiny model's own answers."""
    seqs, feats = tiny_data
    out = {}
    for method in ("eagle", "medusa"):
        cfg, tensors, losses, stats = train.train_head(tiny, method, seqs, feats, steps=24, batch_size=4, lr=5e-3,
                                                       num_heads=3, progress=False)
        d = tmp_path_factory.mktemp(method)
        save_head(str(d), cfg, tensors)
        out[method] = (str(d), losses, stats)
    return out


def test_regenerate_and_features(tiny, tiny_data):
    seqs, feats = tiny_data
    assert len(seqs) == 12 and all(len(ids) > plen + 1 for ids, plen in seqs)
    ids = seqs[0][0]
    assert feats[0].shape == (len(ids), 64) and feats[0].dtype == torch.float32
    # The features are the LM head's input: the head over them gives the engine's own log-probabilities.
    lp = tiny.score_logprobs(ids)
    head = tiny.engine.worker.model.lm_head.weight.detach()
    torch.testing.assert_close(torch.log_softmax(feats[0] @ head.T, -1), lp, atol=1e-4, rtol=1e-4)


def test_batched_features_equal_the_engine_path(tiny, tiny_data):
    """The plain-torch batched features (right-padded batches, longest first, several batches) equal the
    engine's one-sequence-at-a-time features within fp32 rounding; a time limit leaves None for the rest."""
    seqs, feats = tiny_data
    got = features.batched_target_features(tiny, seqs, batch_tokens=64)  # 2-4 sequences a batch: padding inside
    assert got is not None and len(got) == len(seqs)
    for g, f in zip(got, feats, strict=True):
        assert g.shape == f.shape and g.dtype == torch.float32
        torch.testing.assert_close(g, f, atol=2e-4, rtol=2e-4)
    part = features.batched_target_features(tiny, seqs, max_seconds=0.0, batch_tokens=64)
    done = [f is not None for f in part]
    assert 0 < sum(done) < len(seqs)  # the first (longest) batch only
    lens = [len(ids) for ids, _ in seqs]
    assert min(n for n, d in zip(lens, done, strict=True) if d) >= max(n for n, d in zip(lens, done, strict=True)
                                                                       if not d)  # longest first


def test_batched_features_refuse_a_target_that_is_not_plain_llama(tiny, monkeypatch):
    import dataclasses

    w = tiny.engine.worker
    monkeypatch.setattr(w, "model_config", dataclasses.replace(w.model_config, qk_norm=True))
    assert features.batched_target_features(tiny, [([1, 2, 3], 1)]) is None


@pytest.mark.parametrize(("method", "factor"), [("eagle", 0.8), ("medusa", 0.95)])
def test_training_loss_falls(heads, method, factor, tmp_path):
    """The last 4 steps' mean loss is below ``factor`` x the first 4's (Medusa's heads start as the target's
    own LM head on a random-weight model whose tokens two or more ahead are hard to guess: a smaller drop)."""
    d, losses, stats = heads[method]
    assert len(losses) == 24 and all(np.isfinite(losses))
    assert np.mean(losses[-4:]) < factor * np.mean(losses[:4]), losses
    cfg, tensors = load_head(d, method)
    assert (cfg.hidden_size, cfg.vocab_size) == (64, VOCAB)
    modes = {f: os.stat(os.path.join(d, f)).st_mode & 0o777 for f in ("config.json", "model.safetensors")}
    assert modes["model.safetensors"] == modes["config.json"], modes  # not safetensors' own 0600
    assert 0.0 <= stats["val_top1"] <= 1.0
    train.plot_losses(losses, str(tmp_path / "loss.png"), method)
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unrolled_eagle_training_loss_falls(tiny, tiny_data):
    """With ``unroll`` (a second pass on the head's own predicted features) the summed loss falls too."""
    seqs, feats = tiny_data
    _, tensors, losses, _ = train.train_head(tiny, "eagle", seqs, feats, steps=24, batch_size=4, lr=5e-3,
                                             unroll=True, progress=False)
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4]), losses
    assert tensors["fc.weight"].shape == (64, 128)


def test_feature_noise_and_the_held_out_agreements(tiny, tiny_data):
    """``feature_noise`` perturbs the inputs of training only (same seed: another first loss) and the loss still
    falls; ``val_top1`` / ``val_top1_step2`` are the held-out agreements with the target's argmax of the head's
    first step and of a second step reading its own predicted features, recomputed here from the returned head."""
    import random

    from roofline.spec_decode.features import target_parts

    seqs, feats = tiny_data
    kw = dict(steps=24, batch_size=4, lr=5e-3, progress=False)
    _, _, clean, _ = train.train_head(tiny, "eagle", seqs, feats, **kw)
    cfg, tensors, noisy, stats = train.train_head(tiny, "eagle", seqs, feats, feature_noise=0.5, **kw)
    assert noisy[0] != pytest.approx(clean[0], rel=1e-4)
    assert np.mean(noisy[-4:]) < 0.8 * np.mean(noisy[:4]), noisy
    assert stats["feature_noise"] == 0.5
    head = EagleHead(cfg)
    with torch.no_grad():
        head.fc.weight.copy_(tensors["fc.weight"])
        head.fc.bias.copy_(tensors["fc.bias"])
    head.layer.load_hf_state_dict({k[len("layer."):]: v for k, v in tensors.items() if k.startswith("layer.")})
    _, embed, lm_head, cos_sin = target_parts(tiny, torch.device("cpu"))
    order = list(range(len(seqs)))
    random.Random(0).shuffle(order)  # train_head's split (seed 0): the first 10%, at least one, held out
    agree = agree2 = rows = 0
    with torch.no_grad():
        for i in order[:max(1, len(order) // 10)]:
            ids, f = torch.tensor(seqs[i][0]), feats[i].float()
            pos, nxt = torch.arange(len(ids) - 1), embed[ids[1:]]
            want = (f[1:] @ lm_head.T).argmax(-1)
            pred = head(f[:-1], nxt, pos, cos_sin)
            pred2 = head(torch.cat([f[:1], pred[:-1]]), nxt, pos, cos_sin)
            agree += int(((pred @ lm_head.T).argmax(-1) == want).sum())
            agree2 += int(((pred2 @ lm_head.T).argmax(-1) == want).sum())
            rows += len(want)
    assert stats["val_rows"] == rows
    assert stats["val_top1"] == pytest.approx(agree / rows, abs=1e-9)
    assert stats["val_top1_step2"] == pytest.approx(agree2 / rows, abs=1e-9)
    for bad in (-0.1, float("nan"), 11.0):
        with pytest.raises(ValueError, match=r"--feature-noise must be in \[0, 10\], got"):
            train.train_head(tiny, "eagle", seqs, feats, feature_noise=bad, **kw)


def test_batched_eagle_head_equals_one_sequence_at_a_time():
    """A right-padded batch [B, T, H] (GPU training) gives each sequence's rows exactly as running it alone."""
    from roofline.layers.rotary import RotaryEmbedding

    cfg = DraftHeadConfig(method="eagle", target="t", hidden_size=64, vocab_size=VOCAB, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=128)
    torch.manual_seed(0)
    head = EagleHead(cfg)
    cos_sin = RotaryEmbedding(16, 256, 10000.0).cos_sin_cache
    lens = [11, 4, 7]
    f = [torch.randn(n, 64) for n in lens]
    e = [torch.randn(n, 64) for n in lens]
    pad = torch.nn.utils.rnn.pad_sequence
    with torch.no_grad():
        got = head(pad(f, batch_first=True), pad(e, batch_first=True), torch.arange(max(lens)), cos_sin)
        for i, n in enumerate(lens):
            want = head(f[i], e[i], torch.arange(n), cos_sin)
            torch.testing.assert_close(got[i, :n], want, atol=1e-5, rtol=1e-5)
    assert got.shape == (3, 11, 64)


def test_batched_features_with_aux_layers(tiny, tiny_data):
    """``aux_layers``: each entry is [T, (1 + n) H], the final normed features first (as without), then the
    residual stream entering each named layer, in the order named: Hugging Face transformers' ``hidden_states[i]``
    of the same weights (layer 0's: the token embedding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from roofline.spec_decode.features import layer_state_dict

    from .tiny import TINY

    seqs, feats = tiny_data
    got = features.batched_target_features(tiny, seqs[:3], batch_tokens=64, aux_layers=(1, 0))
    w = tiny.engine.worker
    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k != "architectures"})).eval()
    sd = {"model.embed_tokens.weight": w.model.model.embed_tokens.weight.detach().float(),
          "model.norm.weight": w.model.model.norm.weight.detach().float(),
          "lm_head.weight": w.model.lm_head.weight.detach().float()}
    for i, layer in enumerate(w.model.model.layers):
        sd.update({f"model.layers.{i}.{k}": v for k, v in layer_state_dict(layer).items()})
    hf.load_state_dict(sd, strict=False)
    for (ids, _), g, f in zip(seqs[:3], got, feats[:3], strict=False):
        assert g.shape == (len(ids), 3 * 64)
        torch.testing.assert_close(g[:, :64], f, atol=2e-4, rtol=2e-4)
        with torch.no_grad():
            hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(g[:, 64:128], hs[1][0], atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(g[:, 128:], hs[0][0], atol=0, rtol=0)


def test_fused_head_starts_as_its_eagle1_head_and_fuses_normed_streams():
    """A head with ``aux_layers`` loaded from an EAGLE-1 head's tensors gives that head's outputs on [T, 3H]
    features (``fuse`` starts at zero); with a fusing weight, f + W [rms(a_1) | rms(a_2)] (float64 reference);
    features of width H (its own predictions) pass unfused."""
    from roofline.layers.rotary import RotaryEmbedding
    from roofline.spec_decode.heads import fuse_features

    kw = dict(method="eagle", target="t", hidden_size=64, vocab_size=VOCAB, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, intermediate_size=128)
    torch.manual_seed(0)
    one, fused = EagleHead(DraftHeadConfig(**kw)), EagleHead(DraftHeadConfig(**kw, aux_layers=[3, 1]))
    fused.load_export(one.export())
    cos_sin = RotaryEmbedding(16, 256, 10000.0).cos_sin_cache
    f, a, e = torch.randn(9, 64), 5 * torch.randn(9, 128), torch.randn(9, 64)
    pos = torch.arange(9)
    with torch.no_grad():
        torch.testing.assert_close(fused(torch.cat([f, a], -1), e, pos, cos_sin), one(f, e, pos, cos_sin),
                                   atol=0, rtol=0)
        fused.fuse.weight.normal_()
        got = fuse_features(f, a, fused.fuse.weight, 1e-5)
        unfused = fused(f, e, pos, cos_sin)  # width H: the head's own predicted features
    a64 = a.double().view(9, 2, 64)
    want = f.double() + (a64 / (a64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()).view(9, 128) @ \
        fused.fuse.weight.double().T
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
    with torch.no_grad():
        assert torch.equal(unfused, one(f, e, pos, cos_sin))
    assert fused.export()["fuse.weight"].shape == (64, 128) and "fuse.weight" not in one.export()


def test_fused_training_loss_falls_and_its_config_round_trips(tiny, tiny_data, tmp_path):
    """Training with ``aux_layers`` (features from ``batched_target_features``) lowers the loss, learns a
    non-zero fusing weight and saves ``aux_layers`` in config.json; bad ``aux_layers`` are refused, naming them."""
    seqs, _ = tiny_data
    feats = features.batched_target_features(tiny, seqs, aux_layers=(0, 1))
    cfg, tensors, losses, _ = train.train_head(tiny, "eagle", seqs, feats, steps=24, batch_size=4, lr=5e-3,
                                               aux_layers=(0, 1), progress=False)
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4]), losses
    assert tensors["fuse.weight"].shape == (64, 128) and float(tensors["fuse.weight"].abs().max()) > 0
    save_head(str(tmp_path), cfg, tensors)
    back, t = load_head(str(tmp_path), "eagle")
    assert back.aux_layers == [0, 1] and torch.equal(t["fuse.weight"], tensors["fuse.weight"])
    kw = dict(target="t", hidden_size=64, vocab_size=VOCAB)
    for bad in ([1, 1], [-1], [True, 2], 5, "x", [2.0]):
        with pytest.raises(ValueError, match=r"aux_layers must be a list of distinct decoder layer indices >= 0"):
            DraftHeadConfig(method="eagle", aux_layers=bad, **kw)
    with pytest.raises(ValueError, match=r"aux_layers applies to eagle heads only, got \[0\] for a medusa head"):
        DraftHeadConfig(method="medusa", aux_layers=[0], num_heads=2, **kw)
    # A hand-edited head: each refused naming its directory, never a TypeError from deep inside.
    import json

    from safetensors.torch import load_file, save_file

    def edited(name, config=None, weights=None):
        d = tmp_path / name
        d.mkdir()
        raw = json.loads((tmp_path / "config.json").read_text())
        raw.update(config or {})
        (d / "config.json").write_text(json.dumps(raw))
        w = load_file(str(tmp_path / "model.safetensors"))
        save_file(weights(w) if weights else w, str(d / "model.safetensors"))
        return str(d)

    cases = [(edited("int", {"aux_layers": 5}), r"int.*config.json: aux_layers must be a list"),
             (edited("nofuse", weights=lambda w: {k: v for k, v in w.items() if k != "fuse.weight"}),
              r"aux_layers \[0, 1\] needs a floating fuse.weight of shape \[64, 128\], found none"),
             (edited("noaux", {"aux_layers": []}), r"aux_layers \[\] needs no fuse.weight, found \(64, 128\) float32"),
             (edited("intfuse", weights=lambda w: dict(w, **{"fuse.weight": w["fuse.weight"].long()})),
              r"found \(64, 128\) int64"),
             (edited("nan", weights=lambda w: dict(w, **{"fuse.weight": w["fuse.weight"] * float("nan")})),
              r"non-finite values \(NaN or inf\) in fuse.weight")]
    for d, match in cases:
        with pytest.raises(ValueError, match=match):
            load_head(d, "eagle")
    mc = tiny.engine.worker.model_config
    with pytest.raises(ValueError, match=r"reads the target's layers \[0, 5\]; .* has layers \[0, 2\)"):
        DraftHeadConfig.for_target("eagle", mc, aux_layers=[0, 5]).check_target(mc, "d")


def test_prompts_file(tmp_path):
    """``--prompts-file``: a JSON list of user messages (here .json.xz) reads back; anything else is refused
    naming the file."""
    import json
    import lzma

    texts = ["hello there, how are you today my friend?", "x", "tell me a story about a dragon and a knight"]
    path = tmp_path / "p.json.xz"
    with lzma.open(path, "wt", encoding="utf-8") as f:
        json.dump(texts, f)
    assert train.read_prompts_file(str(path)) == texts
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match="bad.json"):
        train.read_prompts_file(str(bad))


def test_engine_eagle_layer_equals_the_trained_module(tiny_dir, heads):
    """The paged one-layer draft in the engine (fused qkv / gate_up, the backend's RoPE and KV cache) gives
    the training module's outputs on the same features and tokens, over 2 packed rows."""
    d = heads["eagle"][0]
    llm = LLM(str(tiny_dir), speculative_config={"method": "eagle", "model": d, "num_speculative_tokens": 2},
              **COMMON)
    w, p = llm.engine.worker, llm.engine.worker.proposer
    cfg, tensors = load_head(d, "eagle")
    ref = EagleHead(cfg)
    ref.fc.load_state_dict({"weight": tensors["fc.weight"], "bias": tensors["fc.bias"]})
    ref.layer.load_hf_state_dict({k[len("layer."):]: v for k, v in tensors.items() if k.startswith("layer.")})
    g = torch.Generator().manual_seed(0)
    lens = [21, 9]
    feats = [torch.randn(n, 64, generator=g) for n in lens]
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]
    cos_sin = w.backend.rotary.cos_sin_cache
    embed = w.model.model.embed_tokens.weight.detach()
    with torch.no_grad():
        want = torch.cat([ref(f, embed[t], torch.arange(len(f)), cos_sin) for f, t in zip(feats, ids, strict=True)])
    table = np.array([[0, 1, 2, -1], [3, 4, -1, -1]], dtype=np.int32)
    fake = SimpleNamespace(input_batch=SimpleNamespace(block_table=table), block_size=w.block_size, device=w.device,
                           inputs=w.inputs)
    with torch.inference_mode():
        got = p._forward(fake, np.array([0, 1]), np.zeros(2, dtype=np.int64), np.array(lens), torch.cat(feats),
                         torch.cat(ids).numpy())
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_greedy_is_token_identical_on_the_tiny_model(tiny, tiny_dir, heads, method):
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(2, VOCAB, size=int(n)).tolist()} for n in (5, 17, 33)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in tiny.generate(prompts, sp, use_tqdm=False)]
    llm = LLM(str(tiny_dir), speculative_config={"method": method, "model": heads[method][0],
                                                 "num_speculative_tokens": 3, "adaptive": False}, **COMMON)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == ref
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_drafts > 0


def test_each_step_reports_how_far_the_eagle_layer_caught_up(tiny_dir, heads):
    """``StepOutput.draft_catch_up_rows``: a request's first drafting step reads every position its prompt's
    prefill computed (17 prompt tokens + the first sampled one: rows 0..16), each later one 1 + the drafts the
    step before accepted, which the policy counts as steady (at most gamma + 1 rows)."""
    llm = LLM(str(tiny_dir), speculative_config={"method": "eagle", "model": heads["eagle"][0],
                                                 "num_speculative_tokens": 3, "adaptive": False}, **COMMON)
    seen = []
    record = llm.engine.spec.record

    def spy(spec_seqs, result):
        seen.append((result.draft_catch_up_rows, sum(result.num_accepted.values())))
        return record(spec_seqs, result)

    llm.engine.spec.record = spy
    prompt = np.random.default_rng(1).integers(2, VOCAB, size=17).tolist()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                 use_tqdm=False)
    assert len(seen) > 3 and seen[0][0] == 17, seen
    assert [rows for rows, _ in seen[1:]] == [1 + acc for _, acc in seen[:-1]], seen


@pytest.fixture(scope="module")
def fused_eagle(tiny, tiny_data, tmp_path_factory):
    """The tiny EAGLE head fusing the residual streams entering layers 1 and 0 (``aux_layers``), 24 steps."""
    seqs, _ = tiny_data
    feats = features.batched_target_features(tiny, seqs, aux_layers=(1, 0))
    cfg, tensors, _, _ = train.train_head(tiny, "eagle", seqs, feats, steps=24, batch_size=4, lr=5e-3,
                                          aux_layers=(1, 0), progress=False)
    d = tmp_path_factory.mktemp("eagle-fused")
    save_head(str(d), cfg, tensors)
    return str(d)


@pytest.mark.parametrize("plan", [True, False])
def test_the_target_keeps_its_residual_streams_in_every_forward_path(tiny_dir, tiny_data, plan):
    """``LlamaModel.set_aux_layers``: after a prefill (modules) and after each decode step (the C++ decode plan,
    or the modules), ``aux_out``'s first T rows hold the residual streams entering the named layers at the step's
    tokens, as ``batched_target_features`` (plain torch) gives them for the whole sequence."""
    llm = LLM(str(tiny_dir), **COMMON)
    w = llm.engine.worker
    if plan and w.cpu_plan is None:
        pytest.skip("no CPU decode plan on this machine")
    if not plan:
        w.cpu_plan = None
    inner = w.model.model
    inner.set_aux_layers((1, 0), 64)
    seen = []
    forward = w.stage.forward

    def spy(step):
        out = forward(step)
        seen.append(inner.aux_out[:out[0].shape[0]].clone())
        return out

    w.stage.forward = spy
    prompt = np.random.default_rng(3).integers(2, VOCAB, size=17).tolist()
    (o,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    ids = prompt + list(o.outputs[0].token_ids)
    (ref,) = features.batched_target_features(llm, [(ids[:-1], 17)], aux_layers=(1, 0))
    assert [len(a) for a in seen] == [17, 1, 1, 1, 1, 1]
    torch.testing.assert_close(torch.cat(seen), ref[:, 64:], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("tree", [False, True])
def test_a_fused_eagle_head_is_greedy_identical(tiny, tiny_dir, fused_eagle, tree):
    """An EAGLE head with ``aux_layers`` drafts from the fused features (chain and tree) and the output is the
    target's, token for token; its start-up line counts the fusing weight."""
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(2, VOCAB, size=int(n)).tolist()} for n in (5, 17, 33)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in tiny.generate(prompts, sp, use_tqdm=False)]
    spec = {"method": "eagle", "model": fused_eagle, "num_speculative_tokens": 3, "adaptive": False}
    if tree:
        spec.update(tree_topk=2, tree_budget=6)
    llm = LLM(str(tiny_dir), speculative_config=spec, **COMMON)
    p = llm.engine.worker.proposer
    assert p.fuse_w is not None and tuple(p.fuse_w.shape) == (64, 128)
    inner = llm.engine.worker.model.model
    assert inner.aux_layers == (1, 0) and inner.aux_slots.tolist() == [1, 0]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == ref
    assert llm.engine.spec_stats.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def truncated_eagle(heads, tiny_data, tmp_path_factory):
    """The tiny EAGLE head with a truncated draft vocabulary: the 16 most frequent of the 48 tokens."""
    from dataclasses import replace

    cfg, tensors = load_head(heads["eagle"][0], "eagle")
    tensors["token_map"] = train.token_map_from(tiny_data[0], 16, VOCAB)
    d = tmp_path_factory.mktemp("eagle-k16")
    save_head(str(d), replace(cfg, draft_vocab_size=16), tensors, torch.float16)
    return str(d)


@pytest.mark.parametrize("tree", [False, True])
def test_truncated_draft_vocabulary_is_greedy_identical(tiny, tiny_dir, truncated_eagle, tree):
    """With ``draft_vocab_size`` 16 the draft proposes mapped tokens only (its logits are -inf elsewhere) and the
    output is the target's, token for token (chain and tree)."""
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(2, VOCAB, size=int(n)).tolist()} for n in (5, 17, 33)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in tiny.generate(prompts, sp, use_tqdm=False)]
    extra = {"tree_topk": 2, "tree_budget": 6} if tree else {}
    llm = LLM(str(tiny_dir), speculative_config={"method": "eagle", "model": truncated_eagle, "adaptive": False,
                                                 "num_speculative_tokens": 3, **extra}, **COMMON)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == ref
    assert llm.engine.spec_stats.num_drafts > 0
    p = llm.engine.worker.proposer
    tmap = load_head(truncated_eagle, "eagle")[1]["token_map"]
    assert torch.equal(p.token_map.cpu(), tmap) and len(set(tmap.tolist())) == 16
    logits = p.logits(llm.engine.worker, torch.randn(3, 64))
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[tmap] = False
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, tmap]).all()
    full = llm.engine.worker.model.compute_logits(torch.ones(2, 64))
    torch.testing.assert_close(p.logits(llm.engine.worker, torch.ones(2, 64))[:, tmap], full[:, tmap])
    # The tree's top-k over the mapped rows only: the full-vocabulary logits' top-k (tokens, log-probabilities).
    h = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    tok, lp = p._topk(llm.engine.worker, h, 4)
    top = torch.log_softmax(p.logits(llm.engine.worker, h).float(), dim=-1).topk(4, dim=-1)
    assert tok.tolist() == top.indices.tolist() and set(tok.ravel().tolist()) <= set(tmap.tolist())
    np.testing.assert_allclose(lp, top.values.numpy(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("truncated", [False, True])
def test_eagle_sampling_keeps_the_targets_distribution(tiny, tiny_dir, heads, truncated_eagle, truncated):
    """Chi-square goodness of fit of the second sampled token (the first one verified against EAGLE's drafts,
    gamma fixed at 3) to the target's exact marginal sum_t1 p(t1) p(t2 | t1), from 1200 seeded samples at
    temperature 1. Cells with expected count < 5 are pooled; p-value threshold 1e-3. ``truncated``: the head
    drafts over 16 of the 48 tokens (q = 0 elsewhere), which rejection sampling must still correct exactly."""
    prompt = [5, 9, 17, 3, 22, 40, 11]
    lp1 = tiny.score_logprobs(prompt)[-1].exp().double()  # p(t1)
    p2 = torch.zeros(VOCAB, dtype=torch.float64)
    for t1 in range(VOCAB):
        p2 += lp1[t1] * tiny.score_logprobs(prompt + [t1])[-1].exp().double()
    # Every sample in one batch, prefilled in one step, so the step that samples t2 drafts for all of them.
    big = {**COMMON, "max_num_seqs": 1024, "max_num_batched_tokens": 8192}
    llm = LLM(str(tiny_dir), speculative_config={"method": "eagle", "num_speculative_tokens": 3, "adaptive": False,
                                                 "model": truncated_eagle if truncated else heads["eagle"][0]},
              **big)
    n = 1200
    sps = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=1234 + 10_000 * i, n=n // 2)
           for i in range(2)]
    outs = [llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0] for sp in sps]
    counts = np.bincount([c.token_ids[1] for o in outs for c in o.outputs], minlength=VOCAB).astype(float)
    assert llm.engine.spec_stats.num_drafts >= n
    expected = p2.numpy() * n
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    if expected[~big].sum() > 0:  # the pooled rare cells
        obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expected[~big].sum())
    exp = exp * obs.sum() / exp.sum()
    stat = float(((obs - exp) ** 2 / exp).sum())
    pvalue = float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64),
                                           torch.tensor(stat / 2, dtype=torch.float64)))
    assert pvalue > 1e-3, (stat, len(obs))


def test_bad_configs_and_mismatched_heads(tiny_dir, heads, tmp_path):
    with pytest.raises(ValueError, match="num_layers does not apply to method 'eagle'"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2, "num_layers": 3})
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, 16\], got 40"):
        SpeculativeConfig.from_dict({"method": "medusa", "num_speculative_tokens": 40})
    with pytest.raises(ValueError, match="unknown key.*'tree_depth'"):
        SpeculativeConfig.from_dict({"method": "eagle", "num_speculative_tokens": 2, "tree_depth": 8})
    # Medusa with more drafts than heads (3).
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[1, 3\].*got 4"):
        LLM(str(tiny_dir), speculative_config={"method": "medusa", "model": heads["medusa"][0],
                                               "num_speculative_tokens": 4}, **COMMON)
    # A head made for another model: both hidden sizes and both vocabularies are named.
    other = DraftHeadConfig(method="eagle", target="other", hidden_size=96, vocab_size=1000, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=24, intermediate_size=128)
    save_head(str(tmp_path / "other"), other, {"fc.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="hidden size 96 and vocabulary 1000; the target .* has hidden size 64 and vocabulary 48"):
        LLM(str(tiny_dir), speculative_config={"method": "eagle", "model": str(tmp_path / "other"),
                                               "num_speculative_tokens": 2}, **COMMON)
    # A Medusa head passed as EAGLE, a directory that is no head, and no head for a model without a bundled one.
    with pytest.raises(ValueError, match="holds a medusa head, not an eagle head"):
        LLM(str(tiny_dir), speculative_config={"method": "eagle", "model": heads["medusa"][0],
                                               "num_speculative_tokens": 2}, **COMMON)
    with pytest.raises(ValueError, match="is not a draft head directory"):
        LLM(str(tiny_dir), speculative_config={"method": "eagle", "model": str(tmp_path),
                                               "num_speculative_tokens": 2}, **COMMON)
    with pytest.raises(ValueError, match="needs \"model\".*none ships for the target"):
        LLM(str(tiny_dir), speculative_config={"method": "eagle", "num_speculative_tokens": 2}, **COMMON)




@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_shipped_heads_are_token_identical_on_the_default_model(default_greedy_ref, method):
    """``{"method": "eagle"}`` (and ``"medusa"``) without ``model`` loads the head shipped for the default model;
    greedy output is the target's, token for token, and some drafts are accepted."""
    llm = LLM(speculative_config={"method": method, "num_speculative_tokens": 3, "adaptive": False}, **DEFAULT)
    got = [o.outputs[0].token_ids for o in llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=48),
                                                    use_tqdm=False)]
    assert got == default_greedy_ref
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


def test_the_pool_split_is_stated_at_start_up(tiny_dir, heads, caplog):
    """The EAGLE layer's KV (1 of the tiny target's 2 layers) is named in bytes and pool tokens at start-up."""
    import logging

    with caplog.at_level(logging.INFO, logger="roofline.worker.worker"):
        llm = LLM(str(tiny_dir), speculative_config={"method": "eagle", "model": heads["eagle"][0],
                                                     "num_speculative_tokens": 2}, **COMMON)
    w = llm.engine.worker
    assert (w.kv_bytes_per_token, w.proposer.kv_bytes_per_token) == (512, 256)  # fp32, 2 KV heads x 16 dims
    alone = (16 << 20) // (512 * 16) * 16
    assert (f"the draft's KV takes 256 of 768 bytes per token, so the pool holds {w.num_blocks * 16} tokens "
            f"instead of {alone} (33% fewer)") in caplog.text


def test_the_start_up_line_states_the_speculative_config(tiny_dir, heads):
    """The line `generate` and `serve` print at start-up names the method, the head and the tree's shape."""
    d = heads["eagle"][0]
    llm = LLM(str(tiny_dir), speculative_config={"method": "eagle", "model": d, "num_speculative_tokens": 3,
                                                 "tree_topk": 2, "tree_budget": 6}, **COMMON)
    assert llm.engine.kv_cache_summary.endswith(
        f"; speculative decoding: eagle head {d}; tree depth 3, top-2, 6 nodes; adaptive gamma")
    llm = LLM(str(tiny_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                 "adaptive": False}, **COMMON)
    assert llm.engine.kv_cache_summary.endswith("; speculative decoding: ngram; chain, gamma_max 4; fixed gamma")


def test_token_map_counts_the_regenerated_answers():
    """The K most frequent answer tokens (prompts not counted), ties by id, unseen tokens last; K out of range
    is refused naming the range."""
    seqs = [([7, 7, 7, 3, 3, 5], 2), ([9, 9, 9, 9, 5, 3], 4)]  # answers: 7 3 3 5 | 5 3
    assert train.token_map_from(seqs, 5, 10).tolist() == [3, 5, 7, 0, 1]
    with pytest.raises(ValueError, match=r"--draft-vocab-size must be in \[1, 10\], got 11"):
        train.token_map_from(seqs, 11, 10)


def test_a_mismatched_head_is_refused_before_the_target_loads(tiny_dir, heads, tmp_path, monkeypatch):
    import roofline.engine_factory as factory

    def no_load(*a, **k):
        raise AssertionError("the target's weights were loaded before the head was checked")

    monkeypatch.setattr(factory, "build_executor", no_load)
    other = DraftHeadConfig(method="eagle", target="other", hidden_size=96, vocab_size=1000)
    save_head(str(tmp_path / "other"), other, {"fc.weight": torch.zeros(1)})
    for spec, match in [({"method": "medusa", "model": heads["medusa"][0], "num_speculative_tokens": 4},
                         r"num_speculative_tokens must be in \[1, 3\] for the Medusa head .*\(3 heads\), got 4"),
                        ({"method": "eagle", "model": str(tmp_path / "other"), "num_speculative_tokens": 2},
                         "hidden size 96 and vocabulary 1000; the target"),
                        ({"method": "eagle", "model": heads["medusa"][0], "num_speculative_tokens": 2},
                         "holds a medusa head, not an eagle head"),
                        ({"method": "medusa", "num_speculative_tokens": 2}, "none ships for the target")]:
        with pytest.raises(ValueError, match=match):
            LLM(str(tiny_dir), speculative_config=spec, **COMMON)


def test_medusa_depth_defaults_to_the_head_count(tiny, tiny_dir, heads):
    # vLLM takes num_speculative_tokens from the draft config when it has one: Medusa's head count here.
    from roofline.spec_config import max_tree_nodes

    llm = LLM(str(tiny_dir), speculative_config={"method": "medusa", "model": heads["medusa"][0], "tree_topk": 2,
                                                 "adaptive": False}, **COMMON)
    spec = llm.engine.config.speculative_config
    assert (spec.num_speculative_tokens, spec.tree_budget) == (3, max_tree_nodes("medusa", 2, 3))
    prompts = [{"prompt_token_ids": list(range(2, 2 + n))} for n in (5, 17)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in tiny.generate(prompts, sp, use_tqdm=False)]
    assert llm.engine.spec_stats.num_drafts > 0
    with pytest.raises(ValueError, match=r"needs 'num_speculative_tokens' \(gamma_max.*'medusa' defaults to its head"):
        SpeculativeConfig.from_dict({"method": "eagle", "model": heads["eagle"][0]})


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_a_missing_head_directory_is_refused_before_the_target_loads(method, tmp_path):
    from roofline.spec_config import SpeculativeConfig

    with pytest.raises(ValueError, match=rf"model '{tmp_path}/none' does not exist: give an? {method} head directory"):
        SpeculativeConfig(method=method, num_speculative_tokens=2, model=str(tmp_path / "none"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        SpeculativeConfig(method=method, num_speculative_tokens=2, model=str(tmp_path / "file"))
    (tmp_path / "empty").mkdir()  # a directory without the head's two files: refused here too, not after loading
    with pytest.raises(ValueError, match=r"'.*/empty' is not a draft head directory \(it needs config.json and "
                                         r"model.safetensors"):
        SpeculativeConfig(method=method, num_speculative_tokens=2, model=str(tmp_path / "empty"))


def test_feature_store_appends_replaces_accepts_and_drops():
    """``FeatureStore`` (a doubling buffer per row): appends a step's rows at the row's computed count, replaces
    rejected positions, keeps a tree's root and accepted path, drops the head, and refuses unobserved ranges."""
    from types import SimpleNamespace

    import numpy as np

    from roofline.spec_decode.feature_store import FeatureStore

    store = FeatureStore(2)
    batch = SimpleNamespace(row_of={7: 1}, num_computed_tokens=np.zeros(2, dtype=np.int64))
    worker = SimpleNamespace(input_batch=batch)
    feats = torch.arange(200 * 3, dtype=torch.float32).reshape(200, 3)  # feature of position p: row p
    for c, n in ((0, 70), (70, 1), (71, 5)):  # a prefill past the first capacity, a decode step, a verify pass
        batch.num_computed_tokens[1] = c
        store.observe(worker, SimpleNamespace(scheduled=[(7, n)]), feats[c:c + n].clone())
    assert torch.equal(store.get(1, 0, 76), feats[:76])
    batch.num_computed_tokens[1] = 72  # drafts at 72.. were rejected: the next step rewrites from 72
    store.observe(worker, SimpleNamespace(scheduled=[(7, 2)]), -feats[72:74])
    assert torch.equal(store.get(1, 70, 74), torch.cat([feats[70:72], -feats[72:74]]))
    with pytest.raises(RuntimeError, match=r"positions \[70, 75\) were not observed \(held: \[0, 74\)\)"):
        store.get(1, 70, 75)
    store.accept_tree(1, 71, [1])  # root at 71, node 1 (at 73) accepted: it now holds position 72
    assert torch.equal(store.get(1, 70, 73), torch.cat([feats[70:72], -feats[73:74]]))
    store.drop_before(1, 60)
    assert torch.equal(store.get(1, 60, 73), torch.cat([feats[60:72], -feats[73:74]]))
    with pytest.raises(RuntimeError, match="held: \\[60, 73\\)"):
        store.get(1, 59, 61)
    store.reset(1)
    assert store.feats(1) is None


@pytest.mark.parametrize(("argv", "match"), [
    (["--steps", "-5"], r"--steps must be an integer >= 1, got -5"),
    (["--num-prompts", "0"], r"--num-prompts must be an integer >= 2, got 0"),
    (["--lr", "nan"], r"--lr must be a finite number > 0, got nan"),
    (["--cls-weight", "-1"], r"--cls-weight must be a finite number >= 0, got -1.0"),
    (["--feature-noise", "inf"], r"--feature-noise must be in \[0, 10\], got inf"),
    (["--method", "medusa", "--feature-noise", "0.1"], r"--feature-noise is for --method eagle, got --method medusa"),
    (["--method", "medusa", "--unroll"], r"--unroll is for --method eagle"),
    (["--aux-layers", "2,x"], r"--aux-layers must be distinct decoder layer indices >= 0.*got '2,x'"),
    (["--aux-layers", "3,3"], r"--aux-layers must be distinct .* got '3,3'"),
    (["--method", "medusa", "--aux-layers", "2"], r"--aux-layers is for --method eagle"),
    (["--aux-layers", "2,,15"], r"--aux-layers must be distinct .* got '2,,15'"),
    (["--aux-layers", "+3"], r"--aux-layers must be distinct .* got '\+3'"),
    (["--init-head", ""], r"--init-head must be a head directory"),
    (["--init-head", "/nonexistent/head"], r"train-draft --init-head '/nonexistent/head' is not a draft head directory"),
    (["--init-head", str(HEADS_DIR / "smollm2-135m-medusa")], r"holds a medusa head, not an eagle head; --init-head "
                                                               r"takes EAGLE heads only \(train a Medusa head from"),
])
def test_train_draft_refuses_bad_arguments_before_loading_the_target(argv, match):
    """``check_train_args`` runs first in ``run_train_draft``: before it, a bad value was found after the target
    loaded and regenerated its answers (minutes), or never (a negative token-loss weight trained on)."""
    import argparse

    parser = argparse.ArgumentParser()
    train_cli.add_train_draft_parser(parser.add_subparsers())
    args = parser.parse_args(["train-draft", "--output", "/nonexistent/out", *(
        [] if "--method" in argv else ["--method", "eagle"]), *argv])
    with pytest.raises(ValueError, match=match):
        args.func(args)
    train_cli.check_train_args(parser.parse_args(["train-draft", "--method", "eagle", "--output", "x"]))  # defaults


def test_train_draft_fine_tunes_at_a_lower_default_lr(truncated_eagle):
    """``--lr`` left out: 5e-4 from scratch, 3e-5 with ``--init-head`` (5e-4 wrecked a trained head within 3 steps);
    a given ``--lr`` is kept either way."""
    import argparse

    parser = argparse.ArgumentParser()
    train_cli.add_train_draft_parser(parser.add_subparsers())
    base = ["train-draft", "--method", "eagle", "--output", "x"]
    for extra, want in (([], 5e-4), (["--init-head", truncated_eagle], 3e-5),
                        (["--init-head", truncated_eagle, "--lr", "1e-4"], 1e-4), (["--lr", "2e-3"], 2e-3)):
        args = parser.parse_args(base + extra)
        train_cli.check_train_args(args)
        assert args.lr == want, extra
    assert (train_cli.LR_SCRATCH, train_cli.LR_INIT_HEAD) == (5e-4, 3e-5)


def test_train_draft_fuses_aux_layers_from_an_initial_head(tiny, truncated_eagle, tmp_path, monkeypatch):
    """``train-draft --aux-layers 1,0 --init-head DIR`` (the target and its prompts stubbed by the tiny model's):
    the head it writes fuses those layers, starts from DIR's weights (its fusing weight from zero) and keeps DIR's
    draft vocabulary; a layer past the target's is refused naming its range."""
    import argparse

    rng = np.random.default_rng(5)
    monkeypatch.setattr("roofline.llm.LLM", lambda *a, **k: tiny)
    monkeypatch.setattr(train_cli, "train_prompts", lambda tok, n, seed, mpt: [
        rng.integers(2, VOCAB, size=9).tolist() for _ in range(n)])
    parser = argparse.ArgumentParser()
    train_cli.add_train_draft_parser(parser.add_subparsers())
    out = tmp_path / "fused"
    args = parser.parse_args(["train-draft", "--method", "eagle", "--output", str(out), "--num-prompts", "6",
                              "--max-tokens", "12", "--steps", "3", "--batch-size", "2", "--lr", "1e-3",
                              "--aux-layers", "1,0", "--init-head", truncated_eagle])
    assert args.func(args) == 0
    cfg, t = load_head(str(out), "eagle")
    _, init = load_head(truncated_eagle, "eagle")
    assert cfg.aux_layers == [1, 0] and cfg.draft_vocab_size == 16 and torch.equal(t["token_map"], init["token_map"])
    assert t["fuse.weight"].shape == (64, 128) and 0 < float(t["fuse.weight"].abs().max()) < 0.1  # 3 steps from 0
    assert float((t["fc.weight"] - init["fc.weight"]).abs().max()) < 0.1  # 3 steps from the initial head
    # The fused head as --init-head: its layers are kept when --aux-layers is left out, other layers refused
    # before the target loads.
    args = parser.parse_args(["train-draft", "--method", "eagle", "--output", str(tmp_path / "again"), "--steps", "1",
                              "--num-prompts", "4", "--max-tokens", "12", "--batch-size", "2", "--init-head", str(out)])
    assert args.func(args) == 0
    again, t2 = load_head(str(tmp_path / "again"), "eagle")
    assert again.aux_layers == [1, 0] and t2["fuse.weight"].shape == (64, 128)
    swapped = parser.parse_args(["train-draft", "--method", "eagle", "--output", str(out), "--init-head", str(out),
                                 "--aux-layers", "0,1"])
    monkeypatch.setattr("roofline.llm.LLM", None)  # must not be reached
    with pytest.raises(ValueError, match=r"fuses layers \[1, 0\]; --aux-layers must name the same"):
        swapped.func(swapped)
    monkeypatch.setattr("roofline.llm.LLM", lambda *a, **k: tiny)
    bad = parser.parse_args(["train-draft", "--method", "eagle", "--output", str(out), "--aux-layers", "0,2"])
    with pytest.raises(ValueError, match=r"--aux-layers must name layers in \[0, 2\) of the target, got '0,2'"):
        bad.func(bad)
