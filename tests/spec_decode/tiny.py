"""The tiny random Llama the learned-drafter and token-tree tests share: its config, the engine arguments, and a
module-scoped ``tiny`` engine (``tests/spec_decode/conftest.py``)."""

from __future__ import annotations

VOCAB = 48
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rope_theta": 10000.0, "eos_token_id": 1}
COMMON = dict(load_format="dummy", device="cpu", attention_backend="torch", dtype="float32", max_model_len=128,
              max_num_seqs=64, block_size=16, kv_cache_memory="16MiB")

# The default model (real weights, CPU, fp32), for the slow greedy-identity tests of the learned heads and trees.
DEFAULT = dict(max_model_len=512, dtype="float32", device="cpu", attention_backend="torch", kv_cache_memory="256MiB")
CHATS = [[{"role": "user", "content": "Write a short poem about the sea."}],
         [{"role": "user", "content": "Explain what a hash table is in three sentences."}]]
