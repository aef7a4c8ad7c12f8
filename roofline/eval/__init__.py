"""The quality gate (``roofline eval``): perplexity, KL(baseline || candidate), top-1 agreement and passkey
retrieval of candidate configurations against the unquantized baseline, on the same tokens.

- ``data``: the held-out ShareGPT slice and its windows;
- ``metrics``: per-position KL, NLL and agreement, accumulated window by window;
- ``passkey``: the long-context retrieval prompts and their greedy check;
- ``runner``: candidates as baseline ``EngineArgs`` + overrides, the run, the table;
- ``cli``: the subcommand.
"""
