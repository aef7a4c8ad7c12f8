"""Decode on CPU in one C++ call per step: the CPU's counterpart of the CUDA graphs.

On a GPU a decode step replays a captured CUDA graph, so no Python runs between its kernels. On CPU the same
step is ~270 small C++ calls (per layer: two norms, four linears, RoPE + the KV store, the attention,
SiLU-and-mul), each wrapped in Python that checks its arguments, allocates its output and dispatches through the
modules: on the default model that Python was about half of a batch-1 token (~7 ms of int8's 14.5 on the Intel
Xeon of 2026-12-04) and ~10 ms of a 36.5 ms batch-32 forward. ``CpuDecodePlan`` collects, once, each layer's
weight, norm and KV-cache pointers into a C array, and a decode-only step then runs every decoder layer and the
final norm in one call (``roofline_decode_step`` in ``roofline.kernels.cpu_paged_attention``'s library). It calls
the same C++ pieces as the modules, in the same order with the same arguments (bf16: the tile GEMM of
``roofline.kernels.cpu_bf16.tile_linear``, AMX or AVX-512 BF16, whose rows do not depend on M; INT8: the one-row
GEMV, or the AMX-INT8 GEMM), so its hidden states are bit-identical to the
module path's (``tests/worker/test_cpu_plan.py``); the embedding lookup and the LM head stay in torch.

It applies where every piece has a C++ kernel: a bf16 model on CPU (``--dtype bfloat16``) or an fp32 one (the CPU's
default dtype; its norms and SiLU run the same C++ in the modules, its linears the small-M fp32 linear of
``roofline.kernels.cpu_f32``, so a CPU with AVX-512F or AVX2 + FMA, and an fp32 KV cache), the Llama-family dense
decoder (no q/k norm, no MoE), bf16 linears tile-packed after loading (``UnquantizedLinearMethod``; a CPU with
AVX-512 BF16 or AMX-BF16) or ``--quantization int8`` (W8A8: the GEMV at one row, the AMX-INT8 or AVX-512 VNNI GEMM at
more), an fp32 or bf16 KV cache the C++ attention reads, one process, at most
``cpu_bf16.TILE_MAX_ROWS`` rows (256, with AMX or AVX-512 BF16 / VNNI; fp32: ``cpu_f32.MAX_ROWS``; past that the
modules run oneDNN's or MKL's large-M GEMM). On the default model in fp32
(Intel Xeon with AMX, 2 cores, 2026-12-06) a batch-1 token took 23.5 ms with the plan against 35.1 ms without,
the same tokens. Speculative decoding's verify passes run in it too: a chain's are decode rows
already (``InputPreparer``), and a token tree's become decode rows with the tree's ancestor mask
(:meth:`CpuDecodePlan.run`). An EAGLE draft layer's decode-row passes run in a plan of their own
(:meth:`CpuDecodePlan.for_layers`: the layer without an embedding or a final norm, over the draft's KV pool); other
drafts run their modules. ``build`` returns None otherwise,
with the reason, which ``roofline generate`` prints under its start-up CPU line (``CPU decode plan: off (...)``);
the worker then runs the modules, as before. ``ROOFLINE_CPU_PLAN=0`` turns it off (A/B).

It holds raw pointers: the parameters and the KV pool must not move after it is built. The worker builds it after
the pool is allocated and the weights are processed; ``load_weights`` copies into the same tensors.
"""

from __future__ import annotations

import ctypes
import os

import torch

from roofline.attention.backend import tree_decode_rows

ENABLED = os.environ.get("ROOFLINE_CPU_PLAN", "1") != "0"


class _Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("bias_bf16", ctypes.c_int32), ("w", ctypes.c_void_p),
                ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("N", ctypes.c_int64), ("K", ctypes.c_int64),
                ("tiles", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_float),
                ("eps2", ctypes.c_float), ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


def _linear(module) -> tuple[_Linear, str | None]:
    """The C description of a linear layer, or a reason it has none."""
    from roofline.quant.base import UnquantizedLinearMethod
    from roofline.quant.int8 import Int8LinearMethod

    method, bias = module.quant_method, module.bias
    if getattr(module, "tp_size", 1) != 1:
        return _Linear(), "tensor parallelism"
    if isinstance(method, UnquantizedLinearMethod) and module.weight.dtype == torch.float32:
        w = module.weight  # fp32: the small-M fp32 linear on the plain weight (kind 2)
        if not w.is_contiguous() or w.dim() != 2 or w.shape[1] % 16:
            return _Linear(), "fp32 weights that are not contiguous [N, K] with K % 16 == 0"
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            return _Linear(), "a bias that is not fp32"
        return _Linear(2, 0, w.data_ptr(), None, None if bias is None else bias.data_ptr(), w.shape[0], w.shape[1],
                       None), None
    if isinstance(method, UnquantizedLinearMethod):
        from roofline.kernels.cpu_bf16 import amx_available

        w, packed = module.weight, getattr(module, "packed_weight", None)
        if packed is None or w.dtype != torch.bfloat16 or not w.is_contiguous():
            return _Linear(), "16-bit weights not packed bf16"
        if packed.dim() != 4:
            return _Linear(), "bf16 weights packed for oneDNN (no tile kernel, or N % 16 / K % 32)"
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            return _Linear(), "a bias that is not bf16"
        # kind 0: the AMX GEMM on the tiles; kind 3: the AVX-512 BF16 GEMM on the same layout
        return _Linear(0 if amx_available() else 3, 1, w.data_ptr(), None,
                       None if bias is None else bias.data_ptr(), w.shape[0], w.shape[1], packed.data_ptr()), None
    if type(method) is Int8LinearMethod:
        q, s = getattr(module, "qweight", None), getattr(module, "weight_scale", None)
        if (q is None or q.dtype != torch.int8 or not q.is_contiguous() or s is None or s.dtype != torch.float32
                or not s.is_contiguous()):
            return _Linear(), "INT8 weights not in the CPU layout"
        if bias is not None and (bias.dtype not in (torch.bfloat16, torch.float32) or not bias.is_contiguous()):
            return _Linear(), "a bias that is not bf16 or fp32"
        from roofline.kernels.cpu_int8 import amx_int8_available

        tiles = getattr(module, "tile_qweight", None)  # for more than one row (kind 1: AMX-INT8, 4: AVX-512 VNNI)
        return _Linear(1 if amx_int8_available() else 4, int(bias is not None and bias.dtype == torch.bfloat16),
                       q.data_ptr(), s.data_ptr(), None if bias is None else bias.data_ptr(), q.shape[0], q.shape[1],
                       None if tiles is None else tiles.data_ptr()), None
    return _Linear(), f"the {type(method).__name__} weight format"


class CpuDecodePlan:
    """``can_run(num_seqs, max_blocks)`` / ``run(input_ids, positions, meta)``, as ``CUDAGraphRunner``: a decode
    step of up to ``max_rows`` rows through ``roofline_decode_step``. Build with :meth:`build`."""

    def __init__(self, lib, layers, model, backend, cache_bf16: bool, one_row_why: str = "", final_norm=None,
                 dtype: torch.dtype = torch.bfloat16):
        from roofline.kernels.cpu_bf16 import TILE_MAX_ROWS
        from roofline.kernels.cpu_f32 import MAX_ROWS

        self.lib, self.layers, self.model, self.backend = lib, layers, model, backend
        self.final_norm = final_norm  # an RMSNorm module applied after the last layer, or None (x + residual)
        self.cache_bf16 = cache_bf16
        self.dtype = dtype  # the model's: bf16 (roofline_decode_step) or fp32 (roofline_decode_step_f32)
        self.one_row_why = one_row_why  # why a step takes one row only ("": up to max_rows)
        self.max_rows = 1 if one_row_why else (MAX_ROWS if dtype == torch.float32 else TILE_MAX_ROWS)

    @classmethod
    def build(cls, model, backend, dtype: torch.dtype, device: torch.device, *,
              tp_size: int = 1) -> tuple[CpuDecodePlan | None, str]:
        """(the plan for ``model``, a ``LlamaForCausalLM`` on one process, over ``backend``'s allocated KV pool, and
        ""), or (None, the reason it does not apply; the worker logs it). See the module docstring."""
        why = cls._why_not(model, backend, dtype, device, tp_size)
        if why is None:
            try:
                return cls._build(model, backend, dtype), ""
            except _Unsupported as e:
                why = str(e)
        return None, why

    @staticmethod
    def _why_not(model, backend, dtype, device, tp_size) -> str | None:
        if not ENABLED:
            return "ROOFLINE_CPU_PLAN=0"
        if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
            return f"{device.type} {dtype}, not a bf16 or fp32 model on CPU"
        if tp_size != 1:
            return "tensor parallelism"
        from roofline.kernels import cpu_bf16
        from roofline.kernels import cpu_paged_attention as cpa

        if cpu_bf16._cpp_library() is None:
            return f"no C++ library ({cpa.unavailable_reason() or 'ROOFLINE_CPU_GEMV=0'})"
        if dtype == torch.float32:
            from roofline.kernels import cpu_f32

            if not cpu_f32.available():
                return "fp32 needs the small-M fp32 linear (AVX-512F or AVX2 + FMA)"
        if getattr(backend, "name", None) != "torch" or getattr(backend, "kv_pool", None) is None:
            return "not the torch attention backend with an allocated pool"
        return None

    @classmethod
    def _build(cls, model, backend, dtype: torch.dtype) -> CpuDecodePlan:
        from roofline.kernels import cpu_bf16
        from roofline.models.llama import LlamaForCausalLM

        if not isinstance(model, LlamaForCausalLM):
            raise _Unsupported(f"the {type(model).__name__} model")
        inner = model.model
        if inner.start_layer != 0 or not (inner.is_first_stage and inner.is_last_stage):
            raise _Unsupported("pipeline parallelism")
        layers, cache_bf16, one_row_why = cls._layers(list(inner.layers), backend, dtype)
        if inner.norm.weight.dtype != dtype:
            raise _Unsupported(f"final norm weight not {dtype}")
        return cls(cpu_bf16._cpp_library(), layers, model, backend, cache_bf16, one_row_why, inner.norm, dtype)

    @classmethod
    def for_layers(cls, decoder_layers, backend, dtype: torch.dtype,
                   device: torch.device) -> tuple[CpuDecodePlan | None, str]:
        """(a plan over ``decoder_layers`` alone, layer i on ``backend``'s KV cache i, with no embedding and no
        final norm: :meth:`run_rows` returns the last layer's output plus its residual; ""), or (None, the
        reason). An EAGLE draft layer's decode-row passes on the CPU (``roofline.spec_decode.eagle``)."""
        why = cls._why_not(None, backend, dtype, device, 1)
        if why is None:
            try:
                from roofline.kernels import cpu_bf16

                layers, cache_bf16, one_row_why = cls._layers(list(decoder_layers), backend, dtype)
                return cls(cpu_bf16._cpp_library(), layers, None, backend, cache_bf16, one_row_why, None, dtype), ""
            except _Unsupported as e:
                why = str(e)
        return None, why

    @staticmethod
    def _layers(decoder_layers, backend, dtype: torch.dtype):
        """The C array of ``decoder_layers`` (``dtype``: bf16 or fp32) over ``backend``'s caches, the caches' dtype
        flag and why a step takes one row only ("" for none); raises :class:`_Unsupported`."""
        from roofline.kernels import cpu_paged_attention as cpa
        from roofline.models.llama import LlamaDecoderLayer, LlamaMLP

        caches = backend.kv_pool.caches
        k0 = caches[0].k
        cache_bf16 = k0.dtype == torch.bfloat16
        if caches[0].is_quantized:
            raise _Unsupported(f"a quantized KV cache ({k0.dtype}): the plan reads float32/bfloat16 caches (the C++ "
                               f"attention still runs every row of this one, outside the plan)")
        if not cpa.supports(backend.num_heads, backend.head_dim, k0):
            raise _Unsupported(
                f"a KV cache the C++ attention does not read: {k0.dtype}, block size {k0.shape[1]}, "
                f"{backend.num_heads}/{k0.shape[2]} heads of {backend.head_dim} (it reads float32/bfloat16 blocks "
                f"of <= {cpa.MAX_BLOCK} tokens, <= {cpa.MAX_GROUP} query heads per KV head, head_dim <= "
                f"{cpa.MAX_HEAD_DIM})")
        layers = (_Layer * len(decoder_layers))()
        if dtype == torch.float32 and cache_bf16:
            raise _Unsupported("an fp32 model with a bf16 KV cache")
        for i, layer in enumerate(decoder_layers):
            attn = layer.self_attn if isinstance(layer, LlamaDecoderLayer) else None
            if attn is None or layer.mlp_name != "mlp" or not isinstance(layer.mlp, LlamaMLP) or attn.qk_norm:
                raise _Unsupported(f"layer {i} is not a dense Llama layer without q/k norm")
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(n.weight.dtype != dtype or not n.weight.is_contiguous() for n in norms):
                raise _Unsupported(f"norm weights not {str(dtype).removeprefix('torch.')}")
            parts = {}
            for name, mod in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", layer.mlp.gate_up_proj),
                              ("down", layer.mlp.down_proj)):
                parts[name], why = _linear(mod)
                if why is not None:
                    raise _Unsupported(f"layer {i} {name}: {why}")
                if (parts[name].kind == 2) != (dtype == torch.float32):
                    raise _Unsupported(f"layer {i} {name}: linear weights not in the norms' dtype {dtype}")
            cache = caches[i]
            if cache.k.dtype != k0.dtype or not (cache.k.is_contiguous() and cache.v.is_contiguous()):
                raise _Unsupported("KV caches of mixed dtypes or layouts")
            layers[i] = _Layer(norms[0].weight.data_ptr(), norms[1].weight.data_ptr(), norms[0].eps, norms[1].eps,
                               parts["qkv"], parts["o"], parts["gate_up"], parts["down"], cache.k.data_ptr(),
                               cache.v.data_ptr())
        cs = backend.rotary.cos_sin_cache
        if cs.dtype != torch.float32 or not cs.is_contiguous() or cs.shape[1] != backend.head_dim:
            raise _Unsupported("a RoPE table that is not fp32 [positions, head_dim]")
        qkv_n = (backend.num_heads + 2 * backend.num_kv_heads) * backend.head_dim
        if any(ly.qkv.N != qkv_n or ly.o.K != backend.num_heads * backend.head_dim or ly.gate_up.N != 2 * ly.down.K
               for ly in layers):
            raise _Unsupported("projection sizes that do not match the heads")
        # More than one row of INT8 W8A8 needs every linear's tiles (bf16 linears always have theirs).
        one_row_why = ""
        if dtype == torch.bfloat16 and not all(getattr(ly, name).tiles for ly in layers
                                               for name in ("qkv", "o", "gate_up", "down")):
            one_row_why = "INT8 W8A8 linears without tiles (no AMX-INT8 or AVX-512 VNNI kernel)"
        return layers, cache_bf16, one_row_why

    def describe(self) -> str:
        """What a step runs, for the start-up line."""
        if self.max_rows == 1:
            return f"a batch-1 decode step runs in one C++ call; one row only: {self.one_row_why}"
        if self.dtype == torch.float32:
            return f"a decode step of 1-{self.max_rows} rows runs in one C++ call (fp32: the small-M fp32 linear)"
        kernel = {0: "AMX", 1: "AMX-INT8", 3: "AVX-512 BF16", 4: "AVX-512 VNNI"}[self.layers[0].qkv.kind]
        return f"a decode step of 1-{self.max_rows} rows runs in one C++ call ({kernel} GEMMs)"

    def can_run(self, num_seqs: int, max_blocks: int) -> bool:
        return 1 <= num_seqs <= self.max_rows

    def takes(self, meta) -> bool:
        """Whether :meth:`run` takes this step: a decode step (a chain verify pass included: its rows are decode
        rows) or a token-tree verify step (``meta.tree_mask``), of 1 to ``max_rows`` rows in all."""
        rows = meta.num_seqs if meta.is_decode_only else sum(meta.query_lens_cpu)
        return (meta.is_decode_only or meta.tree_mask is not None) and 1 <= rows <= self.max_rows

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """Hidden states [M, hidden] bf16 of a step of M rows that :meth:`takes` (the module path's where the C++
        declines).

        A tree verify step runs as decode rows too: its query row t of sequence i (q_i rows, L_i keys after the
        step) is a decode row over the first L_i - q_i + t + 1 cache positions of i's block table, at its own
        (tree-depth) RoPE position and slot; the last r_i = min(q_i, W) rows of i, the tree region of
        ``meta.tree_mask`` [S, W], see a region key only where their ancestor bit is set (the C++ attention's
        ``tree_lo`` / ``tree_bits``). Every row's k/v is stored before any row attends, as in the prefill path."""
        model = self.model
        inner = model.model
        x = inner.embed_tokens(input_ids)  # [M, hidden] in the model's dtype, a fresh tensor the call overwrites
        m = x.shape[0]
        if x.dtype != self.dtype or not x.is_contiguous():
            return model(input_ids, positions, meta)
        pos = positions.to(torch.int64).contiguous()
        slots, table = meta.slot_mapping, meta.block_tables
        tree_lo = tree_bits = None
        if meta.tree_mask is not None:
            rows = tree_decode_rows(meta, m)
            if rows is None:
                return model(input_ids, positions, meta)
            table, seq_lens, tree_lo, tree_bits = rows
        else:
            seq_lens = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64)
        if (slots.dtype != torch.int64 or table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != m
                or table.stride(1) != 1 or pos.shape != (m,) or slots.shape != (m,) or not slots.is_contiguous()
                or seq_lens.shape != (m,)):
            return model(input_ids, positions, meta)
        aux = None
        if inner.aux_layers:  # the residual streams an EAGLE head fuses (LlamaModel.set_aux_layers)
            if m > len(inner.aux_out):
                return model(input_ids, positions, meta)  # it writes none either
            aux = (inner.aux_out, inner.aux_slots)
        if not self.run_rows(x, pos, slots, table, seq_lens, tree_lo, tree_bits, aux):
            return model(input_ids, positions, meta)
        return x

    def run_rows(self, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
                 seq_lens: torch.Tensor, tree_lo: torch.Tensor | None = None,
                 tree_bits: torch.Tensor | None = None,
                 aux: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """The plan's layers (then its final norm, if any) over M decode rows, in place: ``x`` [M, hidden] bf16
        contiguous, row r at RoPE position ``pos[r]`` (int64 [M]), its k/v stored at slot ``slots[r]`` (int64),
        attending to the first ``seq_lens[r]`` (int64) positions of block-table row ``table[r]`` (int32 [M, W],
        unit column stride); with ``tree_lo`` / ``tree_bits`` (int64 [M]), keys from ``tree_lo[r]`` on only where
        their bit is set (all ones: no mask); with ``aux`` = (out [>= M, n hidden] in x's dtype, contiguous; slot
        int64 [layers]), the residual stream entering layer i into columns [slot[i] hidden, + hidden) of out's
        first M rows where slot[i] >= 0. Returns False, with ``x`` untouched, where the C++ declines (a row
        outside the cache or the block table) or for more than ``max_rows`` rows: the caller runs its modules."""
        if x.dtype != self.dtype or not x.is_contiguous() or not 1 <= x.shape[0] <= self.max_rows:
            return False
        backend = self.backend
        cache = backend.kv_pool.caches[0]
        num_blocks, bs = cache.k.shape[:2]
        norm = self.final_norm
        step = self.lib.roofline_decode_step_f32 if self.dtype == torch.float32 else self.lib.roofline_decode_step
        return bool(step(
            ctypes.addressof(self.layers), len(self.layers), None if norm is None else norm.weight.data_ptr(),
            0.0 if norm is None else norm.eps, x.data_ptr(), x.shape[0], x.shape[1], backend.num_heads,
            backend.num_kv_heads, backend.head_dim, bs, int(self.cache_bf16), backend.scale, pos.data_ptr(),
            slots.data_ptr(), table.data_ptr(), table.stride(0), seq_lens.data_ptr(),
            backend.rotary.cos_sin_cache.data_ptr(), backend.rotary.cos_sin_cache.shape[0], num_blocks * bs,
            torch.get_num_threads(), None if tree_lo is None else tree_lo.data_ptr(),
            None if tree_bits is None else tree_bits.data_ptr(), None if aux is None else aux[0].data_ptr(),
            None if aux is None else aux[1].data_ptr(), 0 if aux is None else aux[0].stride(0)))


class _Unsupported(Exception):
    """A reason the plan does not apply (``CpuDecodePlan.build`` logs it)."""
