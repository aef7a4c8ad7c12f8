"""Verification: the target's logits at each speculating row's 1 + k positions and its drafts in, the
accepted drafts and one more token out (``rejection.rejection_sample``), copied to the host without a sync.

A token tree (``roofline.spec_decode.tree``) is verified by ``verify_tree`` in the same place.

``verify`` runs in the worker's step, right after the forward pass; ``Verified.collect`` runs in the step's
``result()`` (after its one host sync): it writes the emitted tokens into the persistent batch and the
``StepOutput``, with the target's logprobs of each emitted token when a request asks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from roofline.step import StepOutput


class Verified:
    """A launched verification: its rows, their sequence ids and host copies (pinned, filled when the step's
    event completes) of the emitted tokens, accepted counts and, when asked, logprobs."""

    def __init__(self, rows: list[int], seq_ids: list[int], host: dict[str, torch.Tensor], counts: list[int]):
        self.rows, self.seq_ids, self.host, self.counts = rows, seq_ids, host, counts

    def collect(self, worker: Any, out: StepOutput) -> None:
        """Speculating rows: their emitted tokens go into the batch (after the drafts' slots were used as
        inputs) and into ``out``, with the target's logprobs of each emitted token when asked; the proposer
        learns how far each row's draft state stays valid (``rewind``)."""
        from roofline.worker.sampling import logprob_entry

        batch = worker.input_batch
        tokens = self.host["token_ids"].tolist()
        accepted = self.host["num_accepted"].tolist()
        lp = {k: v.tolist() for k, v in self.host.items() if k in ("logprobs", "ranks", "top_ids", "top_logprobs")}
        flat = 0
        for i, (row, sid) in enumerate(zip(self.rows, self.seq_ids, strict=True)):
            emitted = tokens[i][:accepted[i] + 1]
            if batch.seq_ids[row] == sid:
                n = int(batch.num_tokens[row])
                batch.token_ids[row, n:n + len(emitted)] = emitted
                batch.num_tokens[row] = n + len(emitted)
                if worker.proposer is not None:  # the draft's state holds up to the last accepted draft
                    worker.proposer.rewind(row, n + accepted[i])
            out.seq_ids.append(sid)
            out.sampled_token_ids.append(emitted)
            out.num_accepted[sid] = accepted[i]
            p = batch.params[row]
            k = p.logprobs if p is not None and batch.seq_ids[row] == sid else None
            if not lp or k is None:
                out.logprobs.append(None)
            else:
                out.logprobs.append([
                    logprob_entry(tok, lp["logprobs"][flat + t], lp["ranks"][flat + t], lp["top_ids"][flat + t],
                                  lp["top_logprobs"][flat + t], k) for t, tok in enumerate(emitted)])
            if self.counts:
                flat += self.counts[i]


def verify(worker: Any, hidden: torch.Tensor, rows: np.ndarray, last_indices: np.ndarray, ks: np.ndarray,
           draft_probs: dict[int, torch.Tensor]) -> Verified:
    """Score each speculating row's 1 + k positions and accept or reject its drafts.

    Args:
        worker: the worker (its persistent batch, model, sampling inputs and host copies).
        hidden: [T, H] the step's last hidden states.
        rows: [S] batch rows that speculate; ``last_indices`` [S] the flat index of each one's last token;
            ``ks`` [S] its number of drafts (>= 1), which sit in ``token_ids`` after its known tokens.
        draft_probs: {row: q [k_r, V]} from a device proposer; a row without one has a one-hot q.
    """
    from roofline.layers.sampler import processed_probs, token_logprobs
    from roofline.spec_decode.rejection import rejection_sample

    if worker.inputs.trees:  # a tree proposer drafted this step (every speculating row holds a tree)
        return verify_tree(worker, hidden, rows, last_indices)
    batch, dev = worker.input_batch, worker.device
    s, kmax = len(rows), int(ks.max())
    counts = ks + 1
    offsets = np.repeat(np.cumsum(counts) - counts, counts)  # [F] start of each row's run
    j = np.arange(int(counts.sum())) - offsets  # [F] position within the run
    row_of_flat = np.repeat(np.arange(s), counts)  # [F]
    flat_idx = np.repeat(last_indices - ks, counts) + j
    logits = worker.model.compute_logits(hidden[torch.from_numpy(flat_idx).to(dev)])  # [F, V] fp32
    md = worker.prepare_sampling(np.repeat(rows, counts), tag="spec_")
    probs = processed_probs(logits, md)
    rof, jj = torch.from_numpy(row_of_flat).to(dev), torch.from_numpy(j).to(dev)
    target = torch.zeros(s, kmax + 1, probs.shape[1], device=dev)
    target[rof, jj] = probs
    cols = batch.num_tokens[rows][:, None] + np.arange(kmax)  # [S, K] the drafts' slots in token_ids
    drafts = np.where(np.arange(kmax) < ks[:, None],
                      batch.token_ids[rows[:, None], np.minimum(cols, batch.token_ids.shape[1] - 1)], 0)
    q = None
    if draft_probs:
        q = torch.zeros(s, kmax, probs.shape[1], device=dev)
        for i, r in enumerate(rows.tolist()):
            qr = draft_probs.get(r)
            if qr is not None:
                q[i, :len(qr)] = qr
            else:  # a host-proposed row in the same step: one-hot q
                k = int(ks[i])
                q[i, torch.arange(k, device=dev), torch.from_numpy(drafts[i, :k]).to(dev)] = 1.0
    first = np.cumsum(counts) - counts  # flat index of each row's first position
    temps = md.temperatures[torch.from_numpy(first).to(dev)]
    keyed = keyed_samples(worker, rows, [np.arange(int(c)) for c in counts],
                          [int(f) + np.arange(int(c)) for f, c in zip(first, counts, strict=True)], probs,
                          batch.temperature[rows])
    matched = match_ids = None
    if keyed:  # seeded sampling rows: accept while each draft is the target's own keyed sample there
        ids_h, rows_h = np.zeros((s, kmax + 1), dtype=np.int64), np.zeros(s, dtype=bool)
        for i, ids in keyed.items():
            ids_h[i, :len(ids)], rows_h[i] = ids, True
        match_ids, matched = torch.from_numpy(ids_h).to(dev), torch.from_numpy(rows_h).to(dev)
    res = rejection_sample(target, torch.from_numpy(drafts).to(dev), torch.from_numpy(ks).to(dev), q,
                           temps < 1e-5, matched=matched, match_ids=match_ids)
    row_list = rows.tolist()
    host = {"token_ids": worker.to_host(res.token_ids), "num_accepted": worker.to_host(res.num_accepted)}
    spec_counts: list[int] = []
    if int(batch.num_logprobs[rows].max()) >= 0:
        emitted = res.token_ids[rof, jj].clamp(min=0)  # [F] the token emitted at each position (or 0)
        so = token_logprobs(logits, emitted, int(batch.num_logprobs[rows].max()))
        host.update(logprobs=worker.to_host(so.logprobs), ranks=worker.to_host(so.ranks),
                    top_ids=worker.to_host(so.top_ids), top_logprobs=worker.to_host(so.top_logprobs))
        spec_counts = counts.tolist()
    return Verified(row_list, [batch.seq_ids[r] for r in row_list], host, spec_counts)


def keyed_samples(worker: Any, rows: np.ndarray, offsets: list[np.ndarray], prob_rows: list[np.ndarray],
                  probs: torch.Tensor, temps: np.ndarray) -> dict[int, list[int]]:
    """The target's own samples of each seeded sampling row, as plain decoding would draw them: for row ``i``
    (batch row ``rows[i]``) and each pair ``(j, f)`` of ``offsets[i]`` and ``prob_rows[i]``,
    ``argmax(probs[f] / E)`` with ``E`` [V] drawn from the request's generator re-seeded with
    ``keyed_seed(seed, n + j)`` (``n``: the row's known tokens, so ``n + j`` is the sequence index of the token
    ``probs[f]`` predicts). ``temps`` [S]: the rows' temperatures. Returns {i: [ids]}; rows without a seed or at
    temperature 0 are absent.

    Verifying a seeded row by matching its drafts against these ("accept while equal, emit the first sample that
    differs") makes its output the plain engine's token for token, with speculation on or off; a one-hot draft
    is accepted exactly as often as rejection sampling accepts it (with probability p(draft))."""
    from roofline.layers.sampler import keyed_seed

    inputs, batch = worker.inputs, worker.input_batch
    which, flat = [], []  # (row i, its count) and the probs rows, in order
    for i, r in enumerate(rows.tolist()):
        sid = batch.seq_ids[r]
        if sid in inputs.generators and temps[i] >= 1e-5:
            which.append((i, sid))
            flat += prob_rows[i].tolist()
    if not which:
        return {}
    noise = torch.empty(len(flat), probs.shape[1], device=probs.device)
    t = 0
    for i, sid in which:
        g, seed, n = inputs.generators[sid], inputs.seeds[sid], int(batch.num_tokens[rows[i]])
        for j in offsets[i].tolist():
            g.manual_seed(keyed_seed(seed, n + j))
            noise[t].exponential_(generator=g)
            t += 1
    ids = (probs[torch.tensor(flat, device=probs.device)] / noise).argmax(dim=-1).tolist()  # one host copy
    out, t = {}, 0
    for i, _ in which:
        out[i] = ids[t:t + len(offsets[i])]
        t += len(offsets[i])
    return out


def verify_tree(worker: Any, hidden: torch.Tensor, rows: np.ndarray, last_indices: np.ndarray) -> Verified:
    """Verify each speculating row's token tree (``worker.inputs.trees[row]``, a ``tree.DraftTree`` of N nodes
    whose 1 + N query rows end at ``last_indices``) in the step's one target pass: walk it (``tree.walk``: greedy
    longest matching path, or recursive rejection over children), compact the accepted path's KV in every
    layer (and the proposer's features) into positions n .. n - 1 + a, and copy the emitted tokens to the host.

    A sampling row's acceptance tests run on the host from its [N] child probabilities (one device -> host copy
    of the step); its last token is drawn on the device from the residual. The trees are cleared.
    """
    from roofline.attention.backend import slot_mapping
    from roofline.layers.sampler import processed_probs, token_logprobs
    from roofline.spec_decode.tree import compact_kv, residual_sample, walk

    batch, dev, trees = worker.input_batch, worker.device, worker.inputs.trees
    worker.inputs.trees = {}
    row_list = rows.tolist()
    sizes = np.array([len(trees[r]) for r in row_list], dtype=np.int64)
    counts = sizes + 1
    flat_idx = np.concatenate([np.arange(e - n, e + 1) for e, n in zip(last_indices.tolist(), sizes.tolist(),
                                                                      strict=True)])
    first = np.cumsum(counts) - counts  # [S] flat index (in the gathered rows) of each row's root
    logits = worker.model.compute_logits(hidden[torch.from_numpy(flat_idx).to(dev)])  # [F, V] fp32
    md = worker.prepare_sampling(np.repeat(rows, counts), tag="spec_")
    temps = batch.temperature[rows]
    # Greedy rows walk the argmax alone: speculating rows carry no penalties and no banned ids
    # (``SpecController.may_speculate``), so the raw logits' argmax is the processed one. Only a step with a
    # sampling row needs the distributions (a [F, V] softmax: 0.3 ms a step for 4 rows of the default model's
    # 49k vocabulary on the CPU).
    sampling = bool((temps >= 1e-5).any())
    probs = processed_probs(logits, md) if sampling else None  # [F, V]
    # The probability of each node's token at its parent's row, and every row's argmax: one host copy.
    node_tok = np.concatenate([trees[r].tokens for r in row_list])
    if sampling:
        parent_flat = np.concatenate([first[i] + 1 + trees[r].parents for i, r in enumerate(row_list)])
        child_p = probs[torch.from_numpy(parent_flat).to(dev), torch.from_numpy(node_tok).to(dev)].cpu().numpy()
    else:
        child_p = np.zeros(len(node_tok), dtype=np.float32)
    argmax = logits.max(dim=-1).indices.cpu().numpy()  # argmax's first-of-ties; on a CPU 3x faster (0.32 ms)
    gens = [md.generators[f] for f in first.tolist()]
    # Seeded sampling rows walk their keyed samples as greedy rows walk the argmax (keyed_samples): the root's
    # row and node c's row predict the tokens at n and n + depth[c].
    keyed = keyed_samples(worker, rows, [np.concatenate([[0], trees[r].depth]) for r in row_list],
                          [int(f) + np.arange(int(c)) for f, c in zip(first, counts, strict=True)], probs,
                          temps) if sampling else {}
    results = []
    child_off = (np.cumsum(sizes) - sizes).tolist()  # each row's first node in child_p
    for i, r in enumerate(row_list):
        g, base, off = gens[i], int(first[i]), child_off[i]
        if i in keyed:
            results.append(walk(trees[r], child_p[off:off + sizes[i]], np.array(keyed[i]), True, None, None))
            continue

        def uniform(g=g) -> float:
            return float(torch.rand((), generator=g, device=dev)) if g is not None else float(torch.rand(()))

        def final_sample(node: int, rejected: list[int], g=g, base=base) -> int:
            return residual_sample(probs[base + 1 + node], rejected, g)

        results.append(walk(trees[r], child_p[off:off + sizes[i]], argmax[base:base + counts[i]],
                            bool(temps[i] < 1e-5), uniform, final_sample))
    depth = max(len(w.path) for w in results)
    tokens = torch.full((len(row_list), depth + 1), -1, dtype=torch.int64)
    src, dst = [], []
    sel_flat: list[int] = []  # gathered-row index of each emitted token's distribution (root, then the path)
    for i, (r, w) in enumerate(zip(row_list, results, strict=True)):
        t = trees[r]
        emitted = [int(t.tokens[c]) for c in w.path] + [w.token]
        tokens[i, :len(emitted)] = torch.tensor(emitted)
        n = int(batch.num_tokens[r])
        for j, c in enumerate(w.path, start=1):  # node c sits at position n + c, belongs at n - 1 + j
            if n + c != n - 1 + j:
                src.append((r, n + c))
                dst.append((r, n - 1 + j))
        sel_flat += [int(first[i])] + [int(first[i]) + 1 + c for c in w.path]
        if worker.proposer is not None and hasattr(worker.proposer, "accept_tree"):
            worker.proposer.accept_tree(r, n - 1, w.path)
    if src:
        bs = worker.block_size
        s_rows, s_pos = np.array(src).T
        d_rows, d_pos = np.array(dst).T
        compact_kv(worker.backend.kv_pool,
                   torch.from_numpy(slot_mapping(batch.block_table, s_rows, s_pos, bs)).to(dev),
                   torch.from_numpy(slot_mapping(batch.block_table, d_rows, d_pos, bs)).to(dev))
    num_accepted = torch.tensor([len(w.path) for w in results], dtype=torch.int64)
    host = {"token_ids": tokens, "num_accepted": num_accepted}
    spec_counts: list[int] = []
    if int(batch.num_logprobs[rows].max()) >= 0:
        emitted_ids = torch.cat([tokens[i, :len(w.path) + 1] for i, w in enumerate(results)]).to(dev)
        so = token_logprobs(logits[torch.tensor(sel_flat, device=dev)], emitted_ids,
                            int(batch.num_logprobs[rows].max()))
        host.update(logprobs=worker.to_host(so.logprobs), ranks=worker.to_host(so.ranks),
                    top_ids=worker.to_host(so.top_ids), top_logprobs=worker.to_host(so.top_logprobs))
        spec_counts = [len(w.path) + 1 for w in results]
    return Verified(row_list, [batch.seq_ids[r] for r in row_list], host, spec_counts)
