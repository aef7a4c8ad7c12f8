"""Speculative decoding: proposers (``ngram``; the layer-truncated self-draft lives in the worker), exact
rejection sampling (``rejection``), the policy that picks gamma from the bound model (``policy``), and its
counters (``stats``). Configured by ``SpeculativeConfig`` (``--speculative-config``)."""
