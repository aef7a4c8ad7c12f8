"""Speculative decoding: proposers behind one registry (``proposer``: n-gram on the host; ``draft_proposers``:
a draft model or the layer-skip self on the worker's device, ``draft_model`` its separate model), the
engine-side controller (``controller``: whether to draft, gamma, timings), verification (``verifier``) by
exact rejection sampling (``rejection``), the policy that picks gamma from the bound model (``policy``), and
its counters (``stats``). Configured by ``SpeculativeConfig`` (``--speculative-config``)."""
