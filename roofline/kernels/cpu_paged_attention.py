"""Paged decode attention on CPU in one C++ loop per sequence, reading K/V in place from the paged cache.

The torch path (``roofline.attention.torch_backend``) gathers every decode row's K/V blocks into a dense padded
tensor per length bucket and calls SDPA per bucket: on the main job's batch-32 bf16 step (AMD EPYC, then an Intel
Xeon, 2026-12-04) ``index_select`` was 23% of the step's CPU time and the SDPA calls 18%, since each step copies
every context token's K and V of every layer again. This kernel reads the cache where it lies: for one decode
row it walks the row's block table and, in each block, scores every KV head's G = H / H_kv query heads against
the block's keys, keeping an online softmax (running max, sum and output per head, rescaled per block; Milakov and
Gimelshein 2018, as FlashAttention), so every key and value is read once, front to back, no copy is made and
nothing past the row's length (the stale tail of its last block) is read. With AVX-512 (head_dim a multiple of
16) each key and value is widened once for its G heads, the block's softmax weights go through a vector exp
(Cephes ``expf``, ~1 ulp) and the next block is prefetched: on the main job's batch-32 steps (Intel Xeon, AMX,
2026-12-04) the kernel's share went from 28.8 to 13.3 ms a step. Work items are the rows, shared out by OpenMP
(the same libgomp runtime as torch's: the library links ``libgomp.so.1``, which the process already has).
The same library carries the decode step's other small C++ pieces: :func:`rope_and_store` (RoPE and the KV store in
one pass, ``roofline_rope_store``), the bf16 helpers of ``roofline.kernels.cpu_bf16`` (the small-M GEMMs
``roofline_vnni_linear_bf16`` (AVX-512 BF16) and ``roofline_amx_linear_bf16`` (AMX) and their weight packing,
the fused residual add + RMSNorm ``roofline_add_rmsnorm_bf16``, SiLU-and-mul
``roofline_silu_mul_bf16``), the
one-row INT8 W8A8 GEMV of ``roofline.kernels.cpu_int8`` (``roofline_gemv_w8a8``) and the CPU decode plan's whole
step (``roofline_decode_step``, ``roofline.worker.cpu_plan``).

Numerics: fp32 scores, softmax and accumulation, keys in order; K/V fp32 or bf16 (widened exactly). A row's
result depends on its own context only (batch-invariant). Its summation order is not SDPA's: the fp32 model stays
token-identical to HF transformers on the parity tests (tests/test_parity.py, test_architectures.py,
test_batch_invariance.py, test_prompt_logprobs.py pass with it), and a bf16 model agrees with the fp32 one as
well as the SDPA path did (bench/results/cpu-attention-20261204/).

Built on first use with the system C++ compiler (``g++ -O3 -march=native -fopenmp``, ~1 s) into
``$ROOFLINE_CACHE_DIR`` (default ``~/.cache/roofline``), keyed by the source and the CPU; loaded with ctypes. A
cache directory that cannot be used, or a cached file that does not load (truncated), falls back to a rebuild in a
private temporary directory. Without a compiler, or if the build fails, :func:`unavailable_reason` says why and
the caller keeps the torch path (one warning). ``ROOFLINE_CPU_ATTENTION=0`` (or ``ENABLED = False``, read at each call) turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENABLED = os.environ.get("ROOFLINE_CPU_ATTENTION", "1") != "0"
MAX_GROUP = 16  # query heads per KV head
MAX_HEAD_DIM = 256
MAX_HEADS = 256  # query heads of a row (the kernel's per-thread softmax state)
MAX_STATE = 16384  # query heads x head_dim of a row (its per-thread output accumulator, floats)

_SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <limits>
#include <cmath>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <type_traits>
#include <utility>
#include <vector>

static inline float widen(float x) { return x; }
static inline float widen(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; std::memcpy(&f, &u, 4); return f; }

// Quantized caches: int8 codes, and E4M3 codes (OCP FP8 2023: bias 7, no infinities, S.1111.111 NaN) as f8e4m3.
// widen() gives the code's value; decode() applies the cache's scale (per slot or per KV head) as it dequantizes.
struct f8e4m3 { uint8_t v; };
static inline float widen(int8_t c) { return (float)c; }
// E4M3 -> fp32 exactly, by integer arithmetic on the bits (vectorizes): a normal code's exponent e (1..15) and
// mantissa m go to fp32's fields as e + 120 and m << 20; a subnormal m * 2^-9 is the normal 1.m' pattern of
// (m + 8) * 2^-9 less 2^-6, computed the same way; S.1111.111 is NaN.
static inline float widen(f8e4m3 c) {
  const uint32_t em = c.v & 0x7fu, sign = (uint32_t)(c.v & 0x80u) << 24;
  const uint32_t normal = (em << 20) + (120u << 23);
  float f, sub;
  std::memcpy(&f, &normal, 4);
  const uint32_t shifted = ((em + 8u) << 20) + (120u << 23);  // (8 + m) * 2^-9 for em < 8, as a normal (e = 1)
  std::memcpy(&sub, &shifted, 4);
  const float mag = em < 8u ? sub - 0.015625f : f;
  uint32_t u;
  std::memcpy(&u, &mag, 4);
  u = em == 0x7fu ? 0x7fc00000u : u;
  u |= sign;
  std::memcpy(&f, &u, 4);
  return f;
}
template <typename KV> struct is_code { static constexpr bool value = false; };
template <> struct is_code<int8_t> { static constexpr bool value = true; };
template <> struct is_code<f8e4m3> { static constexpr bool value = true; };

static inline uint16_t narrow(float f);
static inline void put(float* p, float f) { *p = f; }
static inline void put(uint16_t* p, float f) { *p = narrow(f); }

#if defined(__AVX512F__)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> fp32, exact
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// narrow() on 16 lanes: fp32 -> bf16 nearest-even, NaN kept quiet (integer arithmetic, so denormals are rounded
// as torch rounds them, unlike vcvtneps2bf16); round_bf16 keeps the rounded values as fp32.
static inline __m256i narrow16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}
static inline __m512 round_bf16(__m512 f) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow16(f)), 16));
}

// exp(x): Cephes expf (2^n e^r, Cody-Waite ln2 split, degree-6 polynomial, about 1 ulp); x below -88 gives ~0
// (e^-88 ~ 6e-39), x above ~88.7 gives +inf.
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX512F__)
// A block's values into G query heads' output accumulators, held in registers across the block's keys (G * ND zmm,
// ND = D / 16): per key, ND widened loads, G broadcasts and G * ND FMAs, the same FMAs in the same order as the
// loop through memory it replaces (so the same bits), without its G * ND loads and stores per key.
template <int G, int ND, typename KV>
static inline void pv_registers(const KV* vb, int64_t vstride, int64_t nk, const float* s, float* accg) {
  __m512 a[G][ND];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < ND; ++c) a[g][c] = _mm512_loadu_ps(accg + (g * ND + c) * 16);
  for (int64_t j = 0; j < nk; ++j) {
    __m512 v[ND];
    for (int c = 0; c < ND; ++c) v[c] = load16(vb + j * vstride + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(s[g * 64 + j]);
      for (int c = 0; c < ND; ++c) a[g][c] = _mm512_fmadd_ps(p, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(accg + (g * ND + c) * 16, a[g][c]);
}

// The 16 horizontal sums of v[0..15] as one vector (lane i = the sum of v[i]'s lanes): pairs within 128-bit lanes
// (unpack + add), then quads (shuffle + add), then across the four 128-bit lanes (two lane shuffles + add, twice):
// 45 instructions for 16 dot products instead of 16 full reductions (~8 each).
static inline __m512 hsum16(const float* p) {
  __m512 w[8];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = _mm512_load_ps(p + (2 * i) * 16), b = _mm512_load_ps(p + (2 * i + 1) * 16);
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  __m512 u[4];
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 t0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 t1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(t0, t1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// pv_registers for the (G, D) pairs whose accumulators fit in 24 zmm (D 64: G <= 6; D 128: G <= 3); false otherwise.
template <typename KV>
static inline bool pv_fast(int64_t G, int64_t nd, const KV* vb, int64_t vstride, int64_t nk, const float* s,
                           float* accg) {
  if (nd == 4) {
    switch (G) {
      case 1: pv_registers<1, 4>(vb, vstride, nk, s, accg); return true;
      case 2: pv_registers<2, 4>(vb, vstride, nk, s, accg); return true;
      case 3: pv_registers<3, 4>(vb, vstride, nk, s, accg); return true;
      case 4: pv_registers<4, 4>(vb, vstride, nk, s, accg); return true;
      case 5: pv_registers<5, 4>(vb, vstride, nk, s, accg); return true;
      case 6: pv_registers<6, 4>(vb, vstride, nk, s, accg); return true;
      default: return false;
    }
  }
  if (nd == 8) {
    switch (G) {
      case 1: pv_registers<1, 8>(vb, vstride, nk, s, accg); return true;
      case 2: pv_registers<2, 8>(vb, vstride, nk, s, accg); return true;
      case 3: pv_registers<3, 8>(vb, vstride, nk, s, accg); return true;
      default: return false;
    }
  }
  return false;
}
#endif

// One work item per decode row: its blocks in order, and within each block every KV head's G query heads (so a
// block's keys, then its values, are read front to back once), online softmax per query head (running max, sum and
// output, rescaled per block). AVX-512 with D % 16 == 0: each key and value is widened once for its G heads and
// the block's weights go through a vector exp, with the next block prefetched; otherwise a scalar loop (std::exp).
// State: H * D <= 16384 floats per thread.
template <typename KV, typename O>
static void decode(const float* q, const KV* kc, const KV* vc, const int64_t* tables, const int64_t* lens,
                   const int64_t* rows, O* out, int64_t n, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                   int64_t table_stride, float scale, int nthreads, const int64_t* tree_lo = nullptr,
                   const uint64_t* tree_bits = nullptr, const float* ksc = nullptr, const float* vsc = nullptr,
                   int per_slot = 0) {
  const int64_t G = H / Hkv;
  // Codes (int8, E4M3): each block's keys and values are dequantized once into fp32 (code x scale, the scales per
  // slot [num_blocks * bs, Hkv] (per_slot) or per KV head [Hkv]: ref_dequantize's arithmetic), and the block then
  // runs as an fp32 cache's block would: the same bits as this kernel over the dequantized cache.
  constexpr bool CODES = is_code<KV>::value;
  using E = typename std::conditional<CODES, float, KV>::type;  // the element type attention reads
  #pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
  for (int64_t i = 0; i < n; ++i) {
    int64_t len = lens[i];
    const float* qrow = q + rows[i] * H * D;  // [H, D]: KV head h's group is heads h * G .. h * G + G - 1
    alignas(64) static thread_local float m[256], l[256], acc[16384], s[16 * 64], part[16 * 16 * 16];
    // A tree row (bits not all ones) sees the keys below lo and the region keys lo + a whose bit a is set. It
    // attends to them as one sequence, in order, cut into blocks as a chain holding exactly those keys would be:
    // the whole blocks below lo / bs * bs through the table, the rest (the prefix's partial block, then the seen
    // region keys) gathered into a scratch laid out as blocks. So a tree node's result is, bit for bit, the decode
    // row of its position once its root-to-node path is the sequence's tail (the decode step after acceptance).
    static thread_local std::vector<KV> scratch_k, scratch_v;
    static thread_local std::vector<float> scratch_ks, scratch_vs;  // their per-slot scales
    const uint64_t bits = tree_lo ? tree_bits[i] : ~0ull;
    int64_t direct = len;  // keys read through the table; past it, the scratch
    if (bits != ~0ull) {
      const int64_t lo = tree_lo[i], row = Hkv * D;
      direct = lo / bs * bs;
      scratch_k.resize((bs + 64) * row);
      scratch_v.resize((bs + 64) * row);
      if (per_slot) { scratch_ks.resize((bs + 64) * Hkv); scratch_vs.resize((bs + 64) * Hkv); }
      int64_t kept = 0;
      for (int64_t t = direct; t < len; ++t) {
        if (t >= lo && !((bits >> (t - lo)) & 1)) continue;
        const int64_t slot = tables[i * table_stride + t / bs] * bs + t % bs, off = slot * row;
        std::memcpy(scratch_k.data() + kept * row, kc + off, row * sizeof(KV));
        std::memcpy(scratch_v.data() + kept * row, vc + off, row * sizeof(KV));
        if (per_slot) {
          std::memcpy(scratch_ks.data() + kept * Hkv, ksc + slot * Hkv, Hkv * sizeof(float));
          std::memcpy(scratch_vs.data() + kept * Hkv, vsc + slot * Hkv, Hkv * sizeof(float));
        }
        ++kept;
      }
      len = direct + kept;
    }
    for (int64_t h = 0; h < H; ++h) { m[h] = -INFINITY; l[h] = 0.f; }
    std::memset(acc, 0, sizeof(float) * H * D);
    for (int64_t t0 = 0; t0 < len; t0 += bs) {
      const int64_t nk = (len - t0 < bs) ? (len - t0) : bs;
      // The block's first slot in the cache, or (past direct) in the scratch.
      const int64_t slot0 = t0 < direct ? tables[i * table_stride + t0 / bs] * bs : t0 - direct;
      const KV* kcode = (t0 < direct ? kc : scratch_k.data()) + slot0 * Hkv * D;
      const KV* vcode = (t0 < direct ? vc : scratch_v.data()) + slot0 * Hkv * D;
      const E* kblk;
      const E* vblk;
      if constexpr (CODES) {
        static thread_local std::vector<float> kdq_buf, vdq_buf;  // [bs, Hkv, D] fp32
        const int64_t row = Hkv * D;
        if ((int64_t)kdq_buf.size() < bs * row) { kdq_buf.resize(bs * row); vdq_buf.resize(bs * row); }
        float* kdq = kdq_buf.data();
        float* vdq = vdq_buf.data();
        const float* ksb = per_slot ? (t0 < direct ? ksc : scratch_ks.data()) + slot0 * Hkv : ksc;
        const float* vsb = per_slot ? (t0 < direct ? vsc : scratch_vs.data()) + slot0 * Hkv : vsc;
        for (int64_t j = 0; j < nk; ++j)
          for (int64_t h = 0; h < Hkv; ++h) {
            const float sk = ksb[per_slot ? j * Hkv + h : h], sv = vsb[per_slot ? j * Hkv + h : h];
            const KV* kj = kcode + j * row + h * D;
            const KV* vj = vcode + j * row + h * D;
            float* kd = kdq + j * row + h * D;
            float* vd = vdq + j * row + h * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) { kd[d] = widen(kj[d]) * sk; vd[d] = widen(vj[d]) * sv; }
          }
        kblk = kdq;
        vblk = vdq;
      } else {
        kblk = kcode;
        vblk = vcode;
      }
#if defined(__AVX512F__)
      if (t0 + bs < direct) {  // the next block's keys and values, while this one computes
        const int64_t nxt = tables[i * table_stride + t0 / bs + 1];
        const char* pk = (const char*)(kc + nxt * bs * Hkv * D);
        const char* pv = (const char*)(vc + nxt * bs * Hkv * D);
        for (int64_t off = 0; off < (int64_t)(bs * Hkv * D * sizeof(KV)); off += 64) {
          _mm_prefetch(pk + off, _MM_HINT_T0);
          _mm_prefetch(pv + off, _MM_HINT_T0);
        }
      }
#endif
      for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
        const E* kb = kblk + kvh * D;  // key j of the block: kb + j * Hkv * D
        const E* vb = vblk + kvh * D;
        const float* qg0 = qrow + kvh * G * D;
        float* mg = m + kvh * G;
        float* lg = l + kvh * G;
        float* accg = acc + kvh * G * D;
#if defined(__AVX512F__)
        if (D % 16 == 0) {
          const int64_t nd = D / 16;
          __m512 kv[16];
          for (int64_t j0 = 0; j0 < nk; j0 += 16) {  // 16 keys' lane-wise products, then their 16 sums at once
            const int64_t jn = nk - j0 < 16 ? nk - j0 : 16;
            for (int64_t jj = 0; jj < jn; ++jj) {
              for (int64_t c = 0; c < nd; ++c) kv[c] = load16(kb + (j0 + jj) * Hkv * D + c * 16);
              for (int64_t g = 0; g < G; ++g) {
                __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg0 + g * D), kv[0]);
                for (int64_t c = 1; c < nd; ++c)
                  a = _mm512_fmadd_ps(_mm512_loadu_ps(qg0 + g * D + c * 16), kv[c], a);
                _mm512_store_ps(part + (g * 16 + jj) * 16, a);
              }
            }
            const __mmask16 km = jn == 16 ? (__mmask16)0xffff : (__mmask16)((1u << jn) - 1);
            for (int64_t g = 0; g < G; ++g)  // lanes past jn sum stale vectors and are not stored
              _mm512_mask_storeu_ps(s + g * 64 + j0, km, _mm512_mul_ps(hsum16(part + g * 256), _mm512_set1_ps(scale)));
          }
          for (int64_t g = 0; g < G; ++g) {
            float* sg = s + g * 64;
            float mx = mg[g];
            for (int64_t j = 0; j < nk; ++j) mx = sg[j] > mx ? sg[j] : mx;
            const __m512 mxv = _mm512_set1_ps(mx);
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < nk; j += 16) {
              const __mmask16 k = nk - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nk - j)) - 1);
              const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + j), mxv));
              _mm512_mask_storeu_ps(sg + j, k, e);
              sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
            }
            const float corr = std::exp(mg[g] - mx);  // exp(-inf) = 0 on the first block
            lg[g] = lg[g] * corr + _mm512_reduce_add_ps(sum);
            mg[g] = mx;
            const __m512 cv = _mm512_set1_ps(corr);
            for (int64_t c = 0; c < nd; ++c)
              _mm512_storeu_ps(accg + g * D + c * 16, _mm512_mul_ps(_mm512_loadu_ps(accg + g * D + c * 16), cv));
          }
          if (pv_fast(G, nd, vb, Hkv * D, nk, s, accg)) continue;
          for (int64_t j = 0; j < nk; ++j) {
            for (int64_t c = 0; c < nd; ++c) kv[c] = load16(vb + j * Hkv * D + c * 16);
            for (int64_t g = 0; g < G; ++g) {
              const __m512 p = _mm512_set1_ps(s[g * 64 + j]);
              float* ag = accg + g * D;
              for (int64_t c = 0; c < nd; ++c)
                _mm512_storeu_ps(ag + c * 16, _mm512_fmadd_ps(p, kv[c], _mm512_loadu_ps(ag + c * 16)));
            }
          }
          continue;
        }
#endif
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qg0 + g * D;
          float mx = mg[g];
          for (int64_t j = 0; j < nk; ++j) {
            const E* kj = kb + j * Hkv * D;
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * widen(kj[d]);
            s[g * 64 + j] = dot * scale;
            mx = s[g * 64 + j] > mx ? s[g * 64 + j] : mx;
          }
          const float corr = std::exp(mg[g] - mx);  // exp(-inf) = 0 on the first block
          float sum = 0.f;
          for (int64_t j = 0; j < nk; ++j) { s[g * 64 + j] = std::exp(s[g * 64 + j] - mx); sum += s[g * 64 + j]; }
          lg[g] = lg[g] * corr + sum;
          mg[g] = mx;
          float* ag = accg + g * D;
          #pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
          for (int64_t j = 0; j < nk; ++j) {
            const E* vj = vb + j * Hkv * D;
            const float p = s[g * 64 + j];
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * widen(vj[d]);
          }
        }
      }
    }
    O* orow = out + rows[i] * H * D;
    for (int64_t h = 0; h < H; ++h) {
      const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
      for (int64_t d = 0; d < D; ++d) put(orow + h * D + d, acc[h * D + d] * inv);
    }
  }
}

// out_bf16: the output rows are bf16 (rounded once from the fp32 result), else fp32.
extern "C" {
void roofline_decode_f32(const float* q, const float* kc, const float* vc, const int64_t* tables, const int64_t* lens,
                         const int64_t* rows, void* out, int64_t n, int64_t H, int64_t Hkv, int64_t D, int64_t bs,
                         int64_t table_stride, float scale, int nthreads, int out_bf16, const int64_t* tree_lo,
                         const uint64_t* tree_bits) {
  if (out_bf16) decode(q, kc, vc, tables, lens, rows, (uint16_t*)out, n, H, Hkv, D, bs, table_stride, scale, nthreads,
                       tree_lo, tree_bits);
  else decode(q, kc, vc, tables, lens, rows, (float*)out, n, H, Hkv, D, bs, table_stride, scale, nthreads, tree_lo,
              tree_bits);
}
// Quantized caches: codes int8 (fp8 = 0) or E4M3 (fp8 = 1); scales float32 per slot [num_blocks * bs, Hkv]
// (per_slot = 1) or per KV head [Hkv].
void roofline_decode_codes(const float* q, const void* kc, const void* vc, const float* ksc, const float* vsc,
                           int per_slot, int fp8, const int64_t* tables, const int64_t* lens, const int64_t* rows,
                           void* out, int64_t n, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int64_t table_stride,
                           float scale, int nthreads, int out_bf16, const int64_t* tree_lo, const uint64_t* tree_bits) {
#define ROOFLINE_CODES(KV, O) decode(q, (const KV*)kc, (const KV*)vc, tables, lens, rows, (O*)out, n, H, Hkv, D, bs, \
                                     table_stride, scale, nthreads, tree_lo, tree_bits, ksc, vsc, per_slot)
  if (fp8) { if (out_bf16) ROOFLINE_CODES(f8e4m3, uint16_t); else ROOFLINE_CODES(f8e4m3, float); }
  else { if (out_bf16) ROOFLINE_CODES(int8_t, uint16_t); else ROOFLINE_CODES(int8_t, float); }
#undef ROOFLINE_CODES
}
void roofline_decode_bf16(const float* q, const uint16_t* kc, const uint16_t* vc, const int64_t* tables,
                          const int64_t* lens, const int64_t* rows, void* out, int64_t n, int64_t H, int64_t Hkv,
                          int64_t D, int64_t bs, int64_t table_stride, float scale, int nthreads, int out_bf16,
                          const int64_t* tree_lo, const uint64_t* tree_bits) {
  if (out_bf16) decode(q, kc, vc, tables, lens, rows, (uint16_t*)out, n, H, Hkv, D, bs, table_stride, scale, nthreads,
                       tree_lo, tree_bits);
  else decode(q, kc, vc, tables, lens, rows, (float*)out, n, H, Hkv, D, bs, table_stride, scale, nthreads, tree_lo,
              tree_bits);
}
}

// The GEMVs prefetch each weight row 8 KiB ahead (prefetches never fault past the end). Intel Xeon (AMX) of
// 2026-12-04, 2 threads: INT8 3072x576 streamed from DRAM went from 17.1-17.2 GB/s without to 19.9-20.4 at 4 KiB
// (256 B or 1 KiB: no gain); end to end at batch 1 (the CPU decode plan), two runs each: bf16 12.82 / 13.21 ms a
// token at 8 KiB against 13.47 / 14.20 at 4 KiB, 14.42 at 2 KiB and 12.91 at 16 KiB; int8 6.35 / 6.07 against
// 6.57 / 6.50, 6.86 and 6.42.
static constexpr int64_t kPrefetch = 8192;

// narrow rounds fp32 to bf16, nearest-even (NaN kept quiet), as torch's .to(torch.bfloat16) does.
static inline uint16_t narrow(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Small-M fp32 linear (roofline.kernels.cpu_f32.linear_f32): y [M, N] = x [M, K] @ w^T (+ bias [N]), all fp32, w
// [N, K] row-major, 1 <= M <= 64. Every weight row is streamed from memory once for all M rows; F.linear (MKL's
// sgemm past two rows) ran 4 rows at 1.8x the time of one on the default model's linears. Each output is one
// 16-lane fp32 FMA accumulator over K in order, its lanes summed by _mm512_reduce_add_ps, then the bias added: the
// same operations at every M, so a row's result does not depend on the rows beside it (a speculative verify pass's
// rows equal the decode steps' single rows). Four weight rows per step, x in chunks of four rows (the chunks after
// the first re-read the four weight rows from L1); weight rows prefetched kPrefetch ahead; blocks of four rows
// over the threads. Without AVX-512F, on a CPU with AVX2 and FMA (most laptops: Intel client cores, AMD Zen 1-3),
// the same loop on 8-lane registers: each output one 8-lane accumulator over K in order, its lanes summed in one
// fixed order (f32_sum), x in chunks of two rows (16 ymm registers: 8 accumulators, 4 weight vectors and
// x), so again a row's result does not depend on M. Returns 0 (nothing written) without AVX-512F or AVX2 + FMA,
// K % 16 != 0 or M outside [1, 64].
#if defined(__AVX512F__)
static constexpr int kF32Lanes = 16, kF32Rows = 4;  // lanes per register, x rows per chunk
typedef __m512 f32vec;
static inline f32vec f32_zero() { return _mm512_setzero_ps(); }
static inline f32vec f32_load(const float* p) { return _mm512_loadu_ps(p); }
static inline f32vec f32_fma(f32vec a, f32vec b, f32vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline float f32_sum(f32vec a) { return _mm512_reduce_add_ps(a); }
#define ROOFLINE_LINEAR_F32 1
#elif defined(__AVX2__) && defined(__FMA__)
static constexpr int kF32Lanes = 8, kF32Rows = 2;
typedef __m256 f32vec;
static inline f32vec f32_zero() { return _mm256_setzero_ps(); }
static inline f32vec f32_load(const float* p) { return _mm256_loadu_ps(p); }
static inline f32vec f32_fma(f32vec a, f32vec b, f32vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline float f32_sum(f32vec a) {  // ((0+4)+(2+6)) + ((1+5)+(3+7))
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}
#define ROOFLINE_LINEAR_F32 1
#endif

#if defined(ROOFLINE_LINEAR_F32)
template <int MB>
static inline void f32_block(const float* x, int64_t K, const float* w0, int64_t kc, bool prefetch, float* s) {
  f32vec acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = f32_zero();
  for (int64_t c = 0; c < kc; ++c) {
    f32vec wv[4];
    for (int r = 0; r < 4; ++r) {
      if (prefetch) _mm_prefetch((const char*)(w0 + r * K + c * kF32Lanes) + kPrefetch, _MM_HINT_T0);
      wv[r] = f32_load(w0 + r * K + c * kF32Lanes);
    }
    for (int m = 0; m < MB; ++m) {
      const f32vec xv = f32_load(x + m * K + c * kF32Lanes);
      for (int r = 0; r < 4; ++r) acc[m][r] = f32_fma(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) s[m * 4 + r] = f32_sum(acc[m][r]);
}
#endif

extern "C" int roofline_linear_f32(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t N,
                                   int64_t K, int nthreads) {
#if defined(ROOFLINE_LINEAR_F32)
  if (K % 16 != 0 || M < 1 || M > 64) return 0;
  const int64_t kc = K / kF32Lanes, nb = (N + 3) / 4;
  #pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t n0 = b * 4, rows = N - n0 < 4 ? N - n0 : 4;
    const float* w0 = w + n0 * K;
    float s[16];
    for (int64_t m0 = 0; m0 < M; m0 += kF32Rows) {
      const int mb = M - m0 < kF32Rows ? (int)(M - m0) : kF32Rows;
      const float* xm = x + m0 * K;
      if (rows == 4) {
        switch (mb) {
          case 1: f32_block<1>(xm, K, w0, kc, m0 == 0, s); break;
          case 2: f32_block<2>(xm, K, w0, kc, m0 == 0, s); break;
#if defined(__AVX512F__)
          case 3: f32_block<3>(xm, K, w0, kc, m0 == 0, s); break;
          default: f32_block<4>(xm, K, w0, kc, m0 == 0, s); break;
#endif
        }
        for (int m = 0; m < mb; ++m)
          for (int r = 0; r < 4; ++r) y[(m0 + m) * N + n0 + r] = s[m * 4 + r] + (bias ? bias[n0 + r] : 0.0f);
      } else {  // the last rows of N: one accumulator per output, the same operations as above
        for (int m = 0; m < mb; ++m)
          for (int64_t r = 0; r < rows; ++r) {
            f32vec a = f32_zero();
            for (int64_t c = 0; c < kc; ++c)
              a = f32_fma(f32_load(xm + m * K + c * kF32Lanes), f32_load(w0 + r * K + c * kF32Lanes), a);
            y[(m0 + m) * N + n0 + r] = f32_sum(a) + (bias ? bias[n0 + r] : 0.0f);
          }
      }
    }
  }
  return 1;
#else
  (void)x; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nthreads;
  return 0;
#endif
}

// Small-M bf16 GEMM on AMX tiles (roofline.kernels.cpu_bf16.amx_linear): y [M, N] = bf16(x [M, K] @ w^T (+ bias)),
// the products summed in fp32 by TDPBF16PS (Intel SDM, "Intel AMX instructions") and the bias added in fp32 before
// one rounding. w arrives packed once by roofline_amx_pack_bf16 as B-operand tiles: [N/16][K/32] tiles of 16 rows
// (k pairs) x 16 columns (n) x 2 (the pair), 1 KiB each, so each thread streams its rows of w front to back. Each
// thread takes 32 output columns at a time (two column tiles), reads x rows straight from memory as A tiles (32 rows
// at a time, two row tiles; the last chunk configures fewer rows) and keeps four C tiles. Linux gives a process the
// tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): asked once here.
// Returns 0 (nothing written) where the compiler or CPU lacks AMX-BF16, the request fails, K % 32 or N % 16.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
static int amx_permitted() {
  static int ok = -1;  // a race only repeats the idempotent request
  if (ok < 0) ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}
struct alignas(64) TileConfig { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
// Tiles 0-3: C (row tile r, column tile j at 2r + j); 4, 5: A (x rows); 6, 7: B (w). m0 / m1: rows of the two
// row tiles (m1 = 0: one row tile).
static inline void amx_configure(int m0, int m1) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)m0;
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)(m1 ? m1 : 1);
  _tile_loadconfig(&cfg);
}
template <int MB, int NB>
static inline void amx_block(const uint16_t* x, int64_t K, const uint16_t* w0, int64_t kc, float* cbuf) {
  const uint16_t* w1 = w0 + kc * 512;
  _tile_zero(0);
  if (NB == 2) _tile_zero(1);
  if (MB == 2) { _tile_zero(2); if (NB == 2) _tile_zero(3); }
  for (int64_t kb = 0; kb < kc; ++kb) {
    _tile_loadd(6, w0 + kb * 512, 64);
    if (NB == 2) _tile_loadd(7, w1 + kb * 512, 64);
    _tile_loadd(4, x + kb * 32, K * 2);
    _tile_dpbf16ps(0, 4, 6);
    if (NB == 2) _tile_dpbf16ps(1, 4, 7);
    if (MB == 2) {
      _tile_loadd(5, x + 16 * K + kb * 32, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (NB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf, 64);
  if (NB == 2) _tile_stored(1, cbuf + 256, 64);
  if (MB == 2) { _tile_stored(2, cbuf + 512, 64); if (NB == 2) _tile_stored(3, cbuf + 768, 64); }
}
#endif

extern "C" int roofline_amx_pack_bf16(const uint16_t* w, uint16_t* out, int64_t N, int64_t K, int nthreads) {
  if (K % 32 || N % 16) return 0;
  const int64_t kc = K / 32;
  #pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t nb = 0; nb < N / 16; ++nb)
    for (int64_t kb = 0; kb < kc; ++kb) {
      uint16_t* t = out + (nb * kc + kb) * 512;
      for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c) {
          t[r * 32 + c * 2] = w[(nb * 16 + c) * K + kb * 32 + 2 * r];
          t[r * 32 + c * 2 + 1] = w[(nb * 16 + c) * K + kb * 32 + 2 * r + 1];
        }
    }
  return 1;
}

// Small-M bf16 GEMM with AVX-512 BF16 dot products (roofline.kernels.cpu_bf16.vnni_linear), for a CPU without AMX
// tiles: y [M, N] = bf16(x [M, K] @ w^T (+ bias [N])), 1 <= M <= 256, on w packed by roofline_amx_pack_bf16 (whose
// tile rows are exactly vdpbf16ps's B operand: 16 columns x one k pair). Each output is one fp32 lane: vdpbf16ps
// (Intel SDM) adds x's k pair (broadcast) times w's into it, pair after pair in k order; the bias is added in fp32
// and the sum rounded once. The same operations at every M, so a row's bits do not depend on the rows beside it (a
// speculative verify pass's rows equal the decode steps' single rows) and no horizontal sum is needed. A thread
// takes 32 output columns (two 16-column panels, each K x 32 bf16 contiguous) and runs x in blocks of up to 8 rows
// (16 accumulators); the first block streams the panels from memory (prefetched kPrefetch ahead), the others re-read
// them from cache. Returns 0 (nothing written) without AVX-512 BF16, K % 32, N % 16 or M outside [1, 256].
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
template <int MB, int NB>
static inline void vnni_block(const uint16_t* x, int64_t K, const uint16_t* w0, int64_t kc, bool prefetch,
                              const uint16_t* bias, uint16_t* y, int64_t N) {
  const uint16_t* wj[2] = {w0, w0 + kc * 512};
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t pairs = kc * 16;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      if (prefetch && (p & 1) == 0) _mm_prefetch((const char*)(wj[j] + p * 32) + kPrefetch, _MM_HINT_T0);
      wv[j] = (__m512bh)_mm512_loadu_si512(wj[j] + p * 32);
    }
    for (int m = 0; m < MB; ++m) {
      int32_t xp;
      std::memcpy(&xp, x + m * K + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, wv[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m512 b = bias ? load16(bias + j * 16) : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m)
      _mm256_storeu_si256((__m256i*)(y + m * N + j * 16), narrow16(bias ? _mm512_add_ps(acc[m][j], b) : acc[m][j]));
  }
}
template <int NB>
static inline void vnni_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w0, int64_t kc,
                             const uint16_t* bias, uint16_t* y, int64_t N) {
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const uint16_t* xm = x + m0 * K;
    uint16_t* ym = y + m0 * N;
    const bool pf = m0 == 0;
    switch (M - m0 < 8 ? (int)(M - m0) : 8) {
      case 1: vnni_block<1, NB>(xm, K, w0, kc, pf, bias, ym, N); break;
      case 2: vnni_block<2, NB>(xm, K, w0, kc, pf, bias, ym, N); break;
      case 3: vnni_block<3, NB>(xm, K, w0, kc, pf, bias, ym, N); break;
      case 4: vnni_block<4, NB>(xm, K, w0, kc, pf, bias, ym, N); break;
      case 5: vnni_block<5, NB>(xm, K, w0, kc, pf, bias, ym, N); break;
      case 6: vnni_block<6, NB>(xm, K, w0, kc, pf, bias, ym, N); break;
      case 7: vnni_block<7, NB>(xm, K, w0, kc, pf, bias, ym, N); break;
      default: vnni_block<8, NB>(xm, K, w0, kc, pf, bias, ym, N); break;
    }
  }
}
#endif

extern "C" int roofline_vnni_linear_bf16(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, uint16_t* y,
                                         int64_t M, int64_t N, int64_t K, int nthreads) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (K % 32 || N % 16 || M < 1 || M > 256) return 0;
  const int64_t kc = K / 32, nsb = (N + 31) / 32;
  #pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint16_t* w0 = wp + sb * 2 * kc * 512;
    const uint16_t* b0 = bias ? bias + sb * 32 : nullptr;
    if (N - sb * 32 >= 32) vnni_rows<2>(x, M, K, w0, kc, b0, y + sb * 32, N);
    else vnni_rows<1>(x, M, K, w0, kc, b0, y + sb * 32, N);
  }
  return 1;
#else
  (void)x; (void)wp; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nthreads;
  return 0;
#endif
}

extern "C" int roofline_amx_linear_bf16(const uint16_t* x, const uint16_t* wp, const uint16_t* bias, uint16_t* y,
                                        int64_t M, int64_t N, int64_t K, int nthreads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
  if (K % 32 || N % 16 || M < 1 || !amx_permitted()) return 0;
  const int64_t kc = K / 32, nsb = (N + 31) / 32;
  #pragma omp parallel num_threads(nthreads)
  {
    int configured = -1;  // the rows of the chunk the tiles are configured for
    alignas(64) float cbuf[1024];
    #pragma omp for schedule(static)
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const int nb = N - sb * 32 >= 32 ? 2 : 1;
      const uint16_t* w0 = wp + sb * 2 * kc * 512;
      for (int64_t mc = 0; mc < M; mc += 32) {
        const int rows = M - mc < 32 ? (int)(M - mc) : 32;
        const int m0 = rows < 16 ? rows : 16, m1 = rows - m0;
        if (rows != configured) { amx_configure(m0, m1); configured = rows; }
        const uint16_t* xc = x + mc * K;
        if (m1) { if (nb == 2) amx_block<2, 2>(xc, K, w0, kc, cbuf); else amx_block<2, 1>(xc, K, w0, kc, cbuf); }
        else { if (nb == 2) amx_block<1, 2>(xc, K, w0, kc, cbuf); else amx_block<1, 1>(xc, K, w0, kc, cbuf); }
        for (int mb = 0; mb < (m1 ? 2 : 1); ++mb)
          for (int j = 0; j < nb; ++j) {
            const int64_t n0 = sb * 32 + j * 16;
            const __m512 b = bias ? load16(bias + n0) : _mm512_setzero_ps();
            for (int r = 0; r < (mb ? m1 : m0); ++r) {
              const __m512 v = _mm512_add_ps(_mm512_load_ps(cbuf + (mb * 2 + j) * 256 + r * 16), b);
              _mm256_storeu_si256((__m256i*)(y + (mc + mb * 16 + r) * N + n0), narrow16(v));
            }
          }
      }
    }
    if (configured >= 0) _tile_release();
  }
  return 1;
#else
  (void)x; (void)wp; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)nthreads;
  return 0;
#endif
}

// HF LlamaRMSNorm on bf16 rows, with vLLM's fused residual add (roofline.kernels.cpu_bf16.add_rmsnorm):
// r = bf16(x + res) (written to res_out when res is given, else r = x); y = bf16(w * bf16(r * rsqrt(mean(r^2) + eps)))
// with r^2 summed in fp32 (16 lanes, then the lanes in order). One row per iteration; rows over the threads
// only past 16 rows (a decode row is ~1 us of work). The second pass reads r back from res_out (or x).
extern "C" void roofline_add_rmsnorm_bf16(const uint16_t* x, const uint16_t* res, const uint16_t* w, uint16_t* out,
                                         uint16_t* res_out, int64_t T, int64_t H, float eps, int nthreads) {
  #pragma omp parallel for schedule(static) num_threads(T > 16 ? nthreads : 1)
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* r = res ? res_out + t * H : x + t * H;
    alignas(64) float lanes[16] = {0};
    int64_t h0 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 acc = _mm512_setzero_ps();
    for (; h0 + 16 <= H; h0 += 16) {  // lane k sums h = k mod 16, as the scalar loop; products rounded, then added
      __m512 v = load16(x + t * H + h0);
      if (res) {
        const __m256i b = narrow16(_mm512_add_ps(v, load16(res + t * H + h0)));
        _mm256_storeu_si256((__m256i*)(res_out + t * H + h0), b);
        v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
      }
      acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    _mm512_store_ps(lanes, acc);
#endif
    for (int64_t h = h0; h < H; ++h) {
      float v = widen(x[t * H + h]);
      if (res) {
        uint16_t b = narrow(v + widen(res[t * H + h]));
        res_out[t * H + h] = b;
        v = widen(b);
      }
      const float sq = v * v;
      lanes[h & 15] += sq;
    }
    float ss = 0.f;
    for (int i = 0; i < 16; ++i) ss += lanes[i];
    const float inv = 1.0f / std::sqrt(ss / (float)H + eps);
    int64_t h1 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 iv = _mm512_set1_ps(inv);
    for (; h1 + 16 <= H; h1 += 16)
      _mm256_storeu_si256((__m256i*)(out + t * H + h1),
                          narrow16(_mm512_mul_ps(load16(w + h1), round_bf16(_mm512_mul_ps(load16(r + h1), iv)))));
#endif
    for (int64_t h = h1; h < H; ++h)
      out[t * H + h] = narrow(widen(w[h]) * widen(narrow(widen(r[h]) * inv)));
  }
}
// Rotate-half RoPE of a step's q and k rows and the KV-cache store (roofline.kernels.cpu_paged_attention.rope_and_store;
// the numerics of roofline.kernels.rope_cache.ref_rotary + the cache write): x1 * cos - x2 * sin and x2 * cos + x1 * sin
// in fp32, each product rounded before the add (no FMA contraction, as torch's separate ops), then rounded to the
// model dtype X; k (so rounded) and v are stored at slots[t] (skipped where < 0) in the cache dtype C, q goes to
// qout [T, H, D] in Q. q/k/v: [T, heads, D] with row strides sq/sk/sv elements and heads D apart (the fused qkv
// projection's views). cs [max_pos, D] fp32 = cat(cos, sin).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
static inline float as_model(float f, const float*) { return f; }
static inline float as_model(float f, const uint16_t*) { return widen(narrow(f)); }
#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline __m512 as_model16(__m512 f, const float*) { return f; }
static inline __m512 as_model16(__m512 f, const uint16_t*) { return round_bf16(f); }
static inline void store16(float* p, __m512 f) { _mm512_storeu_ps(p, f); }
static inline void store16(uint16_t* p, __m512 f) { _mm256_storeu_si256((__m256i*)p, narrow16(f)); }
#endif
template <typename X, typename C, typename Q>
static void rope_store(const X* q, const X* k, const X* v, int64_t sq, int64_t sk, int64_t sv, const int64_t* pos,
                       const float* cs, const int64_t* slots, C* kc, C* vc, Q* qout, int64_t T, int64_t H,
                       int64_t Hkv, int64_t D, int nthreads) {
  const int64_t half = D / 2;
  #pragma omp parallel for schedule(static) num_threads(T > 8 ? nthreads : 1)
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cs + pos[t] * D;
    const float* sn = c + half;
    const int64_t slot = slots[t];
    for (int64_t h = 0; h < H + Hkv; ++h) {  // q heads, then k heads
      const bool is_q = h < H;
      if (!is_q && slot < 0) continue;
      const X* x = is_q ? q + t * sq + h * D : k + t * sk + (h - H) * D;
      Q* qo = qout + (t * H + h) * D;
      C* ko = kc + (slot * Hkv + (h - H)) * D;
      int64_t d0 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      for (; d0 + 16 <= half; d0 += 16) {  // the same products and roundings, 16 lanes at a time
        const __m512 x1 = load16(x + d0), x2 = load16(x + d0 + half);
        const __m512 cv = _mm512_loadu_ps(c + d0), sv = _mm512_loadu_ps(sn + d0);
        const __m512 lo = as_model16(_mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv)), x);
        const __m512 hi = as_model16(_mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv)), x);
        if (is_q) { store16(qo + d0, lo); store16(qo + d0 + half, hi); }
        else { store16(ko + d0, lo); store16(ko + d0 + half, hi); }
      }
#endif
      for (int64_t d = d0; d < half; ++d) {
        const float x1 = widen(x[d]), x2 = widen(x[d + half]);
        const float a = x1 * c[d], b = x2 * sn[d], e = x2 * c[d], f = x1 * sn[d];
        const float lo = as_model(a - b, x), hi = as_model(e + f, x);
        if (is_q) { put(qo + d, lo); put(qo + d + half, hi); }
        else { put(ko + d, lo); put(ko + d + half, hi); }
      }
    }
    if (slot >= 0) {
      const X* vr = v + t * sv;
      C* vo = vc + slot * Hkv * D;
      int64_t i0 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      for (; i0 + 16 <= Hkv * D; i0 += 16) store16(vo + i0, load16(vr + i0));
#endif
      for (int64_t i = i0; i < Hkv * D; ++i) put(vo + i, widen(vr[i]));
    }
  }
}
#pragma GCC pop_options

// x_bf16 / c_bf16 / q_bf16: the model (q/k/v), the cache and the q output in bf16 (1) or fp32 (0). Returns 0, with
// nothing written, for an fp32 model with a bf16 cache or q, a position outside [0, max_pos) or a slot >= num_slots.
extern "C" int roofline_rope_store(const void* q, const void* k, const void* v, int64_t sq, int64_t sk, int64_t sv,
                                   const int64_t* pos, const float* cs, const int64_t* slots, void* kc, void* vc,
                                   void* qout, int64_t T, int64_t H, int64_t Hkv, int64_t D, int x_bf16, int c_bf16,
                                   int q_bf16, int64_t max_pos, int64_t num_slots, int nthreads) {
  for (int64_t t = 0; t < T; ++t)
    if (pos[t] < 0 || pos[t] >= max_pos || slots[t] >= num_slots) return 0;
#define RS(X, C, Q) rope_store((const X*)q, (const X*)k, (const X*)v, sq, sk, sv, pos, cs, slots, (C*)kc, (C*)vc, \
                               (Q*)qout, T, H, Hkv, D, nthreads)
  if (x_bf16) {
    if (c_bf16) { if (q_bf16) RS(uint16_t, uint16_t, uint16_t); else RS(uint16_t, uint16_t, float); }
    else { if (q_bf16) RS(uint16_t, float, uint16_t); else RS(uint16_t, float, float); }
  } else {
    if (c_bf16 || q_bf16) return 0;  // an fp32 model keeps fp32 everywhere
    RS(float, float, float);
  }
#undef RS
  return 1;
}

// SiLU-and-mul rows (roofline.kernels.cpu_bf16.silu_and_mul): x [T, 2I] -> out [T, I], out[t, i] = silu(g) * u with
// g = x[t, i], u = x[t, I + i], silu(g) = g / (1 + exp(-g)) in fp32. bf16 rows round silu(g) to bf16 and then the
// product (torch's bf16 F.silu, then its bf16 mul); fp32 rows round neither. The exp is exp512 (Cephes, ~1 ulp;
// torch's is SLEEF's, also ~1 ulp) 16 lanes at a time, std::exp on the tail or without AVX-512; rows over the threads
// past 16k elements. The element type's loads, stores and rounding are the overloads below.
static inline uint16_t silu_mul_one(uint16_t g, uint16_t u) {
  const float gv = widen(g);
  return narrow(widen(narrow(gv / (1.0f + std::exp(-gv)))) * widen(u));
}
static inline float silu_mul_one(float g, float u) { return g / (1.0f + std::exp(-g)) * u; }
#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline __m512 silu_load(const uint16_t* p) { return load16(p); }
static inline __m512 silu_load(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 silu_round(__m512 v, const uint16_t*) { return round_bf16(v); }
static inline __m512 silu_round(__m512 v, const float*) { return v; }
static inline void silu_store(uint16_t* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, narrow16(v)); }
static inline void silu_store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
#endif
template <typename E>
static void silu_mul_rows(const E* x, E* out, int64_t T, int64_t I, int nthreads) {
  #pragma omp parallel for schedule(static) num_threads(T * I >= 16384 ? nthreads : 1)
  for (int64_t t = 0; t < T; ++t) {
    const E* g = x + t * 2 * I;
    const E* u = g + I;
    E* o = out + t * I;
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (; i + 16 <= I; i += 16) {
      const __m512 gv = silu_load(g + i);
      const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
      const __m512 sv = silu_round(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), g);
      silu_store(o + i, _mm512_mul_ps(sv, silu_load(u + i)));
    }
#endif
    for (; i < I; ++i) o[i] = silu_mul_one(g[i], u[i]);
  }
}
extern "C" void roofline_silu_mul_bf16(const uint16_t* x, uint16_t* out, int64_t T, int64_t I, int nthreads) {
  silu_mul_rows(x, out, T, I, nthreads);
}
extern "C" void roofline_silu_mul_f32(const float* x, float* out, int64_t T, int64_t I, int nthreads) {
  silu_mul_rows(x, out, T, I, nthreads);
}
// fp32 rows (roofline.kernels.cpu_bf16.add_rmsnorm on fp32): r = x + res (written to res_out when res is given,
// else r = x); y = w * (r * (1 / sqrt(mean(r^2) + eps))), HF LlamaRMSNorm's order in fp32, r^2 summed in 16 lanes
// (lane k: h = k mod 16, in order), then the lanes in order. One row per iteration; rows over the threads only
// past 16 rows.
extern "C" void roofline_add_rmsnorm_f32(const float* x, const float* res, const float* w, float* out, float* res_out,
                                        int64_t T, int64_t H, float eps, int nthreads) {
  #pragma omp parallel for schedule(static) num_threads(T > 16 ? nthreads : 1)
  for (int64_t t = 0; t < T; ++t) {
    const float* xr = x + t * H;
    float* rr = res ? res_out + t * H : nullptr;
    alignas(64) float lanes[16] = {0};
    int64_t h0 = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; h0 + 16 <= H; h0 += 16) {
      __m512 v = _mm512_loadu_ps(xr + h0);
      if (res) {
        v = _mm512_add_ps(v, _mm512_loadu_ps(res + t * H + h0));
        _mm512_storeu_ps(rr + h0, v);
      }
      acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    _mm512_store_ps(lanes, acc);
#endif
    for (int64_t h = h0; h < H; ++h) {
      float v = xr[h];
      if (res) {
        v = v + res[t * H + h];
        rr[h] = v;
      }
      const float sq = v * v;
      lanes[h & 15] += sq;
    }
    float ss = 0.f;
    for (int i = 0; i < 16; ++i) ss += lanes[i];
    const float inv = 1.0f / std::sqrt(ss / (float)H + eps);
    const float* r = res ? rr : xr;
    for (int64_t h = 0; h < H; ++h) {
      const float n = r[h] * inv;
      out[t * H + h] = w[h] * n;
    }
  }
}

// One-row INT8 W8A8 dynamic GEMV (roofline.kernels.cpu_int8.w8a8_dynamic_linear at M = 1), bit-identical to its torch
// path: s = max(max_k |x[k]| / 127, 1e-10) and q[k] = round-half-even(x[k] / s) in fp32; acc[n] = sum_k q[k] w[n, k]
// exact in int32 (AVX-512 VNNI vpdpbusd takes u8 x s8, so q + 128 goes in and 128 * sum_k w[n, k], summed by a second
// vpdpbusd against ones, comes off); y[n] = (float)acc[n] * (s * ws[n]) (+ bias[n]), rounded to y's dtype. x and y
// fp32 or bf16 (x_bf16 / y_bf16), bias fp32 / bf16 / null. Returns 0 (nothing written) without AVX-512 VNNI or when K
// is not a multiple of 64 or over 16384.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // the scale product, then the bias add: torch's two ops, no FMA
extern "C" int roofline_gemv_w8a8(const void* x, int x_bf16, const int8_t* w, const float* ws, const void* bias,
                                  int bias_bf16, void* y, int y_bf16, int64_t N, int64_t K, int nthreads) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (K % 64 != 0 || K > 16384) return 0;
  alignas(64) uint8_t xq[16384];
  float amax = 0.f;
  bool nan = false;
  for (int64_t k = 0; k < K; ++k) {
    const float v = x_bf16 ? widen(((const uint16_t*)x)[k]) : ((const float*)x)[k];
    const float a = std::fabs(v);
    nan |= a != a;
    amax = a > amax ? a : amax;
  }
  float s = amax / 127.0f;
  s = s < 1e-10f ? 1e-10f : s;
  if (nan) s = std::numeric_limits<float>::quiet_NaN();  // torch's inf-norm is NaN: the whole row comes out NaN
  for (int64_t k = 0; k < K; ++k) {
    const float v = x_bf16 ? widen(((const uint16_t*)x)[k]) : ((const float*)x)[k];
    const float r = std::nearbyint(v / s);  // NaN (any NaN in the row, or inf / inf): code 0
    xq[k] = (uint8_t)((r == r ? (int)r : 0) + 128);
  }
  const int64_t kc = K / 64;
  const __m512i ones = _mm512_set1_epi8(1);
  #pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t n0 = 0; n0 < N; n0 += 4) {
    const int64_t rows = N - n0 < 4 ? N - n0 : 4;
    int32_t tot[4];
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {  // four rows share each x chunk; a partial group row by row
      if (rows == 4) {
        const int8_t* w0 = w + n0 * K;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, s0 = a0, s1 = a0, s2 = a0, s3 = a0;
        for (int64_t c = 0; c < kc; ++c) {
          const __m512i xv = _mm512_load_si512(xq + c * 64);
          for (int r = 0; r < 4; ++r) _mm_prefetch((const char*)(w0 + r * K + c * 64) + kPrefetch, _MM_HINT_T0);
          const __m512i b0 = _mm512_loadu_si512(w0 + c * 64), b1 = _mm512_loadu_si512(w0 + K + c * 64);
          const __m512i b2 = _mm512_loadu_si512(w0 + 2 * K + c * 64), b3 = _mm512_loadu_si512(w0 + 3 * K + c * 64);
          a0 = _mm512_dpbusd_epi32(a0, xv, b0); s0 = _mm512_dpbusd_epi32(s0, ones, b0);
          a1 = _mm512_dpbusd_epi32(a1, xv, b1); s1 = _mm512_dpbusd_epi32(s1, ones, b1);
          a2 = _mm512_dpbusd_epi32(a2, xv, b2); s2 = _mm512_dpbusd_epi32(s2, ones, b2);
          a3 = _mm512_dpbusd_epi32(a3, xv, b3); s3 = _mm512_dpbusd_epi32(s3, ones, b3);
        }
        tot[0] = _mm512_reduce_add_epi32(a0) - 128 * _mm512_reduce_add_epi32(s0);
        tot[1] = _mm512_reduce_add_epi32(a1) - 128 * _mm512_reduce_add_epi32(s1);
        tot[2] = _mm512_reduce_add_epi32(a2) - 128 * _mm512_reduce_add_epi32(s2);
        tot[3] = _mm512_reduce_add_epi32(a3) - 128 * _mm512_reduce_add_epi32(s3);
      } else {
        for (int64_t r = 0; r < rows; ++r) {
          __m512i a = _mm512_setzero_si512(), sw = a;
          for (int64_t c = 0; c < kc; ++c) {
            const __m512i b = _mm512_loadu_si512(w + (n0 + r) * K + c * 64);
            a = _mm512_dpbusd_epi32(a, _mm512_load_si512(xq + c * 64), b);
            sw = _mm512_dpbusd_epi32(sw, ones, b);
          }
          tot[r] = _mm512_reduce_add_epi32(a) - 128 * _mm512_reduce_add_epi32(sw);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = n0 + r;
      float o = (float)tot[r] * (s * ws[n]);
      if (bias) o += bias_bf16 ? widen(((const uint16_t*)bias)[n]) : ((const float*)bias)[n];
      if (y_bf16) ((uint16_t*)y)[n] = narrow(o); else ((float*)y)[n] = o;
    }
  }
  return 1;
#else
  (void)x; (void)x_bf16; (void)w; (void)ws; (void)bias; (void)bias_bf16; (void)y; (void)y_bf16; (void)N; (void)K;
  (void)nthreads;
  return 0;
#endif
}
#pragma GCC pop_options

// INT8 AMX B-operand tiles for TDPBSSD (roofline.kernels.cpu_int8.tile_pack_int8): w int8 [N, K] -> [N/16][K/64]
// tiles of 16 rows (k quads) x 16 columns (n) x 4, 1 KiB each: tile[r][4c + i] = w[16n + c][64k + 4r + i]. Returns
// 0 (nothing written) unless N % 16 == 0 and K % 64 == 0.
extern "C" int roofline_amx_pack_s8(const int8_t* w, int8_t* out, int64_t N, int64_t K, int nthreads) {
  if (K % 64 || N % 16) return 0;
  const int64_t kc = K / 64;
  #pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t nb = 0; nb < N / 16; ++nb)
    for (int64_t kb = 0; kb < kc; ++kb) {
      int8_t* t = out + (nb * kc + kb) * 1024;
      for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c)
          for (int i = 0; i < 4; ++i) t[r * 64 + c * 4 + i] = w[(nb * 16 + c) * K + kb * 64 + 4 * r + i];
    }
  return 1;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The W8A8 rows' codes (x [M, K] fp32 or bf16, K % 16 == 0): s[m] = max(max_k |x[m, k]| / 127, 1e-10), q[m, k] =
// round-half-even(x[m, k] / s[m]) int8, 16 lanes at a time, rows over the threads (exact: the max of |x| in any
// order, IEEE division, round-half-even by roundscale, the same as the GEMV's scalar std::nearbyint(v / s)).
static void quantize_rows_s8(const void* x, int x_bf16, int64_t M, int64_t K, int8_t* q, float* sx, int nthreads) {
  #pragma omp parallel for schedule(static) num_threads(M * K >= 16384 ? nthreads : 1)
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xb = (const uint16_t*)x + m * K;
    const float* xf = (const float*)x + m * K;
    __m512 mx = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = x_bf16 ? load16(xb + k) : _mm512_loadu_ps(xf + k);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
    }
    float s = _mm512_reduce_max_ps(mx) / 127.0f;
    s = s < 1e-10f ? 1e-10f : s;
    if (nan) s = std::numeric_limits<float>::quiet_NaN();  // torch's inf-norm is NaN: the whole row comes out NaN
    sx[m] = s;
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_div_ps(x_bf16 ? load16(xb + k) : _mm512_loadu_ps(xf + k), sv);
      const __m512i c = _mm512_cvtps_epi32(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      _mm_storeu_si128((__m128i*)(q + m * K + k), _mm512_cvtepi32_epi8(c));
    }
  }
}
#endif

// INT8 W8A8 dynamic GEMM of 1-256 rows with AVX-512 VNNI (roofline.kernels.cpu_int8.vnni_linear_w8a8), for a CPU
// without AMX-INT8, on w packed by roofline_amx_pack_s8 (a tile row is vpdpbusd's B operand: 16 columns x one k
// quad): the rows quantized by quantize_rows_s8; acc[m, n] = sum_k (q[m, k] + 128) w[n, k] by vpdpbusd (u8 x s8,
// Intel SDM) with x's k quad broadcast, minus 128 * sum_k w[n, k] (a second vpdpbusd against ones): exact int32, so
// every row is bit-identical to the GEMV's and the torch path's; then y = (float)acc * (s[m] * ws[n]) (+ bias[n])
// rounded once to y's dtype. A thread takes 32 columns, x in blocks of up to 8 rows. Returns 0 (nothing written)
// without AVX-512 VNNI, unless N % 16 == 0, K % 64 == 0, K <= 16384 and 1 <= M <= 256.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // the scale product, then the bias add, as roofline_gemv_w8a8
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
template <int MB, int NB>
static inline void vnni_block_s8(const int8_t* q, int64_t K, const int8_t* w0, int64_t kc, bool first, __m512i* sw,
                                 const float* sx, const float* ws, const void* bias, int bias_bf16, void* y,
                                 int y_bf16, int64_t N) {
  const int8_t* wj[2] = {w0, w0 + kc * 1024};
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_si512();
  if (first)
    for (int j = 0; j < NB; ++j) sw[j] = _mm512_setzero_si512();
  const int64_t quads = kc * 16;
  for (int64_t p = 0; p < quads; ++p) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) {
      if (first) _mm_prefetch((const char*)(wj[j] + p * 64) + kPrefetch, _MM_HINT_T0);
      wv[j] = _mm512_loadu_si512(wj[j] + p * 64);
      if (first) sw[j] = _mm512_dpbusd_epi32(sw[j], ones, wv[j]);
    }
    for (int m = 0; m < MB; ++m) {
      uint32_t xp;
      std::memcpy(&xp, q + m * K + 4 * p, 4);
      const __m512i xb = _mm512_set1_epi32((int32_t)(xp ^ 0x80808080u));  // q + 128 as u8
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], xb, wv[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m512i off = _mm512_slli_epi32(sw[j], 7);  // 128 * sum_k w[n, k]
    const __m512 wsv = _mm512_loadu_ps(ws + j * 16);
    const __m512 b = !bias ? _mm512_setzero_ps()
                     : bias_bf16 ? load16((const uint16_t*)bias + j * 16) : load16((const float*)bias + j * 16);
    for (int m = 0; m < MB; ++m) {
      __m512 o = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[m][j], off)),
                               _mm512_mul_ps(_mm512_set1_ps(sx[m]), wsv));
      if (bias) o = _mm512_add_ps(o, b);
      if (y_bf16) _mm256_storeu_si256((__m256i*)((uint16_t*)y + m * N + j * 16), narrow16(o));
      else _mm512_storeu_ps((float*)y + m * N + j * 16, o);
    }
  }
}
template <int NB>
static inline void vnni_rows_s8(const int8_t* q, int64_t M, int64_t K, const int8_t* w0, int64_t kc, const float* sx,
                                const float* ws, const void* bias, int bias_bf16, void* y, int y_bf16, int64_t N) {
  __m512i sw[2];
  const int64_t ysz = y_bf16 ? 2 : 4;
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const int8_t* qm = q + m0 * K;
    void* ym = (char*)y + m0 * N * ysz;
    const bool first = m0 == 0;
    switch (M - m0 < 8 ? (int)(M - m0) : 8) {
#define ROOFLINE_S8_CASE(R) \
      case R: vnni_block_s8<R, NB>(qm, K, w0, kc, first, sw, sx + m0, ws, bias, bias_bf16, ym, y_bf16, N); break;
      ROOFLINE_S8_CASE(1) ROOFLINE_S8_CASE(2) ROOFLINE_S8_CASE(3) ROOFLINE_S8_CASE(4)
      ROOFLINE_S8_CASE(5) ROOFLINE_S8_CASE(6) ROOFLINE_S8_CASE(7)
      default: vnni_block_s8<8, NB>(qm, K, w0, kc, first, sw, sx + m0, ws, bias, bias_bf16, ym, y_bf16, N); break;
#undef ROOFLINE_S8_CASE
    }
  }
}
#endif
extern "C" int roofline_vnni_linear_w8a8(const void* x, int x_bf16, const int8_t* wp, const float* ws,
                                         const void* bias, int bias_bf16, void* y, int y_bf16, int64_t M, int64_t N,
                                         int64_t K, int nthreads) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (K % 64 || N % 16 || K > 16384 || M < 1 || M > 256) return 0;
  std::vector<int8_t> q(M * K);
  std::vector<float> sx(M);
  quantize_rows_s8(x, x_bf16, M, K, q.data(), sx.data(), nthreads);
  const int64_t kc = K / 64, nsb = (N + 31) / 32, ysz = y_bf16 ? 2 : 4;
  #pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const int8_t* w0 = wp + sb * 2 * kc * 1024;
    const void* b0 = !bias ? nullptr : (const char*)bias + sb * 32 * (bias_bf16 ? 2 : 4);
    void* y0 = (char*)y + sb * 32 * ysz;
    const float* ws0 = ws + sb * 32;
    if (N - sb * 32 >= 32) vnni_rows_s8<2>(q.data(), M, K, w0, kc, sx.data(), ws0, b0, bias_bf16, y0, y_bf16, N);
    else vnni_rows_s8<1>(q.data(), M, K, w0, kc, sx.data(), ws0, b0, bias_bf16, y0, y_bf16, N);
  }
  return 1;
#else
  (void)x; (void)x_bf16; (void)wp; (void)ws; (void)bias; (void)bias_bf16; (void)y; (void)y_bf16; (void)M; (void)N;
  (void)K; (void)nthreads;
  return 0;
#endif
}
#pragma GCC pop_options

// INT8 W8A8 dynamic GEMM of M rows on AMX tiles (roofline.kernels.cpu_int8.w8a8_dynamic_linear at 1..256 rows): each
// row quantized as roofline_gemv_w8a8 does (s = max(max_k |x| / 127, 1e-10), q = round-half-even(x / s), |q| <= 127),
// acc[m, n] = sum_k q[m, k] w[n, k] exact in int32 by TDPBSSD (s8 x s8, Intel SDM), y = (float)acc * (s[m] * ws[n])
// (+ bias[n]) rounded once to y's dtype: so every row is bit-identical to the GEMV's row and to the torch path, at any
// M. w packed by roofline_amx_pack_s8. Tiling as roofline_amx_linear_bf16 (32 columns x 32 rows, four C tiles).
// Returns 0 (nothing written) without AMX-INT8, when the tile state is refused, or unless N % 16 == 0, K % 64 == 0
// and K <= 16384.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512F__) \
    && defined(__AVX512BW__)
template <int MB, int NB>
static inline void amx_block_s8(const int8_t* x, int64_t K, const int8_t* w0, int64_t kc, int32_t* cbuf) {
  const int8_t* w1 = w0 + kc * 1024;
  _tile_zero(0);
  if (NB == 2) _tile_zero(1);
  if (MB == 2) { _tile_zero(2); if (NB == 2) _tile_zero(3); }
  for (int64_t kb = 0; kb < kc; ++kb) {
    _tile_loadd(6, w0 + kb * 1024, 64);
    if (NB == 2) _tile_loadd(7, w1 + kb * 1024, 64);
    _tile_loadd(4, x + kb * 64, K);
    _tile_dpbssd(0, 4, 6);
    if (NB == 2) _tile_dpbssd(1, 4, 7);
    if (MB == 2) {
      _tile_loadd(5, x + 16 * K + kb * 64, K);
      _tile_dpbssd(2, 5, 6);
      if (NB == 2) _tile_dpbssd(3, 5, 7);
    }
  }
  _tile_stored(0, cbuf, 64);
  if (NB == 2) _tile_stored(1, cbuf + 256, 64);
  if (MB == 2) { _tile_stored(2, cbuf + 512, 64); if (NB == 2) _tile_stored(3, cbuf + 768, 64); }
}
#endif
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // the scale product, then the bias add, as roofline_gemv_w8a8
extern "C" int roofline_amx_linear_w8a8(const void* x, int x_bf16, const int8_t* wp, const float* ws,
                                        const void* bias, int bias_bf16, void* y, int y_bf16, int64_t M, int64_t N,
                                        int64_t K, int nthreads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512F__) \
    && defined(__AVX512BW__)
  if (K % 64 || N % 16 || K > 16384 || M < 1 || !amx_permitted()) return 0;
  std::vector<int8_t> q(M * K);
  std::vector<float> sx(M);
  quantize_rows_s8(x, x_bf16, M, K, q.data(), sx.data(), nthreads);
  const int64_t kc = K / 64, nsb = (N + 31) / 32;
  #pragma omp parallel num_threads(nthreads)
  {
    int configured = -1;
    alignas(64) int32_t cbuf[1024];
    #pragma omp for schedule(static)
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const int nb = N - sb * 32 >= 32 ? 2 : 1;
      const int8_t* w0 = wp + sb * 2 * kc * 1024;
      for (int64_t mc = 0; mc < M; mc += 32) {
        const int rows = M - mc < 32 ? (int)(M - mc) : 32;
        const int m0 = rows < 16 ? rows : 16, m1 = rows - m0;
        if (rows != configured) { amx_configure(m0, m1); configured = rows; }
        const int8_t* xc = q.data() + mc * K;
        if (m1) { if (nb == 2) amx_block_s8<2, 2>(xc, K, w0, kc, cbuf); else amx_block_s8<2, 1>(xc, K, w0, kc, cbuf); }
        else { if (nb == 2) amx_block_s8<1, 2>(xc, K, w0, kc, cbuf); else amx_block_s8<1, 1>(xc, K, w0, kc, cbuf); }
        for (int mb = 0; mb < (m1 ? 2 : 1); ++mb)
          for (int j = 0; j < nb; ++j)
            for (int r = 0; r < (mb ? m1 : m0); ++r) {
              const int64_t m = mc + mb * 16 + r;
              for (int c = 0; c < 16; ++c) {
                const int64_t n = sb * 32 + j * 16 + c;
                float o = (float)cbuf[(mb * 2 + j) * 256 + r * 16 + c] * (sx[m] * ws[n]);
                if (bias) o += bias_bf16 ? widen(((const uint16_t*)bias)[n]) : ((const float*)bias)[n];
                if (y_bf16) ((uint16_t*)y)[m * N + n] = narrow(o); else ((float*)y)[m * N + n] = o;
              }
            }
      }
    }
    if (configured >= 0) _tile_release();
  }
  return 1;
#else
  (void)x; (void)x_bf16; (void)wp; (void)ws; (void)bias; (void)bias_bf16; (void)y; (void)y_bf16; (void)M; (void)N;
  (void)K; (void)nthreads;
  return 0;
#endif
}
#pragma GCC pop_options
// A whole decode step's decoder layers in one call (roofline.worker.cpu_plan.CpuDecodePlan): the same C++ pieces the
// modules call one by one, in the modules' order and with their arguments, so the result is bit-identical to the
// module path; what it removes is the Python between them (~230 us a layer at one row). Per layer:
// h = rmsnorm(x [+ residual]); qkv = h W_qkv^T (+ b); RoPE + the KV store; attention over each row's blocks (bf16
// out); o = a W_o^T; h = rmsnorm(o + residual); gate_up; SiLU-and-mul; x = down. Then the final norm into x.
// A linear is bf16 (kind 0 / 3: W [N, K] bf16, its tiles for AMX / AVX-512 BF16, bias bf16 or null), INT8 W8A8
// (kind 1 / 4: W int8 [N, K], scale fp32 [N], bias bf16/fp32 or null, its tiles for AMX-INT8 / AVX-512 VNNI or null:
// one row only without them) or fp32 (kind 2). Returns 0 with nothing written where a piece would decline (no
// AVX-512 BF16 / VNNI, a K it does not take, no tiles past one row, a position, slot or block out of range, a row's
// blocks past its table).
struct RooflineLinear { int32_t kind; int32_t bias_bf16; const void* w; const float* scale; const void* bias;
                        int64_t N, K; const void* tiles; };
struct RooflineLayer { const void* norm1; const void* norm2; float eps1, eps2;  // bf16 or fp32, as x
                       RooflineLinear qkv, o, gate_up, down; void* k_cache; void* v_cache; };

// A linear of the plan on M rows, as roofline.kernels.cpu_bf16.packed_linear / cpu_int8 run it: kind 0 (bf16) the
// AMX GEMM on the tile-packed copy, kind 3 (bf16) the AVX-512 BF16 GEMM on the same layout (1-256 rows; the rows of
// either do not depend on M); kind 1 / 4 (INT8 W8A8) the GEMV at one row (kind 4 with tiles: the VNNI GEMM), at more
// the AMX-INT8 / AVX-512 VNNI GEMM (2-256 rows) on the tiles (the same bits: exact int32 sums either way).
static int plan_linear(const RooflineLinear& l, const uint16_t* x, uint16_t* y, int64_t M, int nthreads) {
  if (l.kind == 0) return roofline_amx_linear_bf16(x, (const uint16_t*)l.tiles, (const uint16_t*)l.bias, y, M, l.N,
                                                   l.K, nthreads);
  if (l.kind == 3) return roofline_vnni_linear_bf16(x, (const uint16_t*)l.tiles, (const uint16_t*)l.bias, y, M, l.N,
                                                    l.K, nthreads);
  if (M > 1 && l.kind == 1) return roofline_amx_linear_w8a8(x, 1, (const int8_t*)l.tiles, l.scale, l.bias, l.bias_bf16,
                                                            y, 1, M, l.N, l.K, nthreads);
  // Kind 4 takes one row on the tiles too (AMD EPYC Zen 4, 2026-12-07: 16-20% faster than the GEMV at M = 1, same
  // bits; cpu_int8.w8a8_dynamic_linear); kind 1 keeps the GEMV there (AMX at one row: unmeasured).
  if (l.tiles != nullptr && (M > 1 || l.kind == 4))
    return roofline_vnni_linear_w8a8(x, 1, (const int8_t*)l.tiles, l.scale, l.bias, l.bias_bf16, y, 1, M, l.N, l.K,
                                     nthreads);
  return roofline_gemv_w8a8(x, 1, (const int8_t*)l.w, l.scale, l.bias, l.bias_bf16, y, 1, l.N, l.K, nthreads);
}

// Kind 2 (fp32 weights, fp32 x): roofline_linear_f32, whose rows do not depend on M.
static int plan_linear(const RooflineLinear& l, const float* x, float* y, int64_t M, int nthreads) {
  return l.kind == 2 && roofline_linear_f32(x, (const float*)l.w, (const float*)l.bias, y, M, l.N, l.K, nthreads);
}

static bool plan_linear_ok(const RooflineLinear& l, int64_t M) {
#if defined(ROOFLINE_LINEAR_F32)
  if (l.kind == 2) return l.K % 16 == 0 && M <= 64;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (l.kind == 0 || l.kind == 3)
    return l.tiles != nullptr && l.K % 32 == 0 && l.N % 16 == 0 && (l.kind == 0 || M <= 256);
  return (l.kind == 1 || l.kind == 4) && l.K % 64 == 0 && l.K <= 16384
         && (M == 1 || (l.tiles != nullptr && l.N % 16 == 0 && (l.kind == 1 || M <= 256)));
#else
  (void)l; (void)M;
  return false;
#endif
}

// A decode step of M rows (one new token per sequence) through every decoder layer and the final norm: x [M, hidden]
// bf16 holds the embeddings on entry and the final norm's output on return. Row r has position pos[r], stores its
// k/v at flat slot slot[r], and attends to the first seq_lens[r] positions of the blocks in table[r * table_stride
// ...] (int32). Every row's k/v is stored before any row attends, so rows of one sequence with consecutive slots
// and lengths are a causal extend (a chain verify pass). tree_lo / tree_bits (null, or [M]): row r sees key t >=
// tree_lo[r] only where bit t - tree_lo[r] of tree_bits[r] is set (a token tree's ancestor mask; all ones: plain
// causal), with seq_lens[r] - tree_lo[r] in [1, 64] and key 0 seen (tree_lo[r] >= 1 or bit 0 set). aux_out (null,
// or [M, aux_stride] of A): where aux_slot[i] >= 0 (aux_slot [L]), the residual stream entering layer i goes to
// columns [aux_slot[i] * hidden, + hidden) of each row (LlamaModel.set_aux_layers). Returns 0,
// having written nothing, where a check fails (the caller runs the modules then).
static void plan_norm(const uint16_t* x, const uint16_t* res, const void* w, uint16_t* out, uint16_t* res_out,
                      int64_t T, int64_t H, float eps, int nthreads) {
  roofline_add_rmsnorm_bf16(x, res, (const uint16_t*)w, out, res_out, T, H, eps, nthreads);
}
static void plan_norm(const float* x, const float* res, const void* w, float* out, float* res_out, int64_t T,
                      int64_t H, float eps, int nthreads) {
  roofline_add_rmsnorm_f32(x, res, (const float*)w, out, res_out, T, H, eps, nthreads);
}
static void plan_silu_mul(const uint16_t* x, uint16_t* out, int64_t T, int64_t I, int nthreads) {
  roofline_silu_mul_bf16(x, out, T, I, nthreads);
}
static void plan_silu_mul(const float* x, float* out, int64_t T, int64_t I, int nthreads) {
  roofline_silu_mul_f32(x, out, T, I, nthreads);
}
static inline uint16_t plan_add(uint16_t a, uint16_t b) { return narrow(widen(a) + widen(b)); }  // torch's bf16 add
static inline float plan_add(float a, float b) { return a + b; }

// The step in the model's dtype A: uint16_t (bf16; linears of kinds 0 and 1, a bf16 or fp32 cache) or float (fp32;
// kind 2 linears, an fp32 cache).
template <typename A>
static int decode_step(const RooflineLayer* layers, int64_t L, const void* final_norm, float final_eps, A* x,
                       int64_t M, int64_t hidden, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int cache_bf16,
                       float scale, const int64_t* pos, const int64_t* slot, const int32_t* table,
                       int64_t table_stride, const int64_t* seq_lens, const float* cs, int64_t max_pos,
                       int64_t num_slots, int nthreads, const int64_t* tree_lo, const uint64_t* tree_bits,
                       void* aux_out, const int64_t* aux_slot, int64_t aux_stride) {
  constexpr bool kBf16 = sizeof(A) == 2;
  if (M < 1 || (H / Hkv) > 16 || D > 256 || H > 256 || H * D > 16384 || bs > 64 || D % 2) return 0;
  if (!kBf16 && cache_bf16) return 0;  // roofline_rope_store: an fp32 model writes an fp32 cache
  const int64_t num_blocks = num_slots / bs;
  for (int64_t r = 0; r < M; ++r) {
    const int64_t nb = (seq_lens[r] + bs - 1) / bs;
    if (seq_lens[r] < 1 || nb > table_stride || pos[r] < 0 || pos[r] >= max_pos || slot[r] < 0
        || slot[r] >= num_slots) return 0;
    if (tree_lo && tree_bits[r] != ~0ull && ((tree_lo[r] < 1 && !(tree_bits[r] & 1)) || seq_lens[r] <= tree_lo[r]
                                             || seq_lens[r] - tree_lo[r] > 64)) return 0;
    for (int64_t b = 0; b < nb; ++b)
      if (table[r * table_stride + b] < 0 || table[r * table_stride + b] >= num_blocks) return 0;
  }
  int64_t inter = 0;
  for (int64_t i = 0; i < L; ++i) {
    const RooflineLayer& ly = layers[i];
    if (!plan_linear_ok(ly.qkv, M) || !plan_linear_ok(ly.o, M) || !plan_linear_ok(ly.gate_up, M)
        || !plan_linear_ok(ly.down, M)) return 0;
    if ((ly.qkv.kind == 2) == kBf16) return 0;  // fp32 linears with fp32 rows only
    inter = ly.down.K > inter ? ly.down.K : inter;
  }
  const int64_t qkv_n = (H + 2 * Hkv) * D;
  std::vector<A> h(M * hidden), res(M * hidden), res2(M * hidden), qkv(M * qkv_n), att(M * H * D),
      gu(M * 2 * inter), act(M * inter);
  std::vector<float> q32(M * H * D);
  std::vector<int64_t> tab(M * table_stride), rows(M);
  for (int64_t i = 0; i < M * table_stride; ++i) tab[i] = table[i];
  for (int64_t r = 0; r < M; ++r) rows[r] = r;
  for (int64_t i = 0; i < L; ++i) {
    const RooflineLayer& ly = layers[i];
    if (i == 0) {  // residual = the embedding; h = rmsnorm(x)
      std::memcpy(res.data(), x, M * hidden * sizeof(A));
      plan_norm(x, nullptr, ly.norm1, h.data(), nullptr, M, hidden, ly.eps1, nthreads);
    } else {  // (h, residual) = rmsnorm(x + residual), x + residual
      plan_norm(x, res.data(), ly.norm1, h.data(), res2.data(), M, hidden, ly.eps1, nthreads);
      std::swap(res, res2);
    }
    if (aux_out && aux_slot[i] >= 0)  // the residual stream entering layer i (LlamaModel.set_aux_layers)
      for (int64_t r = 0; r < M; ++r)
        std::memcpy((A*)aux_out + r * aux_stride + aux_slot[i] * hidden, res.data() + r * hidden, hidden * sizeof(A));
    plan_linear(ly.qkv, h.data(), qkv.data(), M, nthreads);
    const A* q = qkv.data();
    roofline_rope_store(q, q + H * D, q + (H + Hkv) * D, qkv_n, qkv_n, qkv_n, pos, cs, slot, ly.k_cache, ly.v_cache,
                        q32.data(), M, H, Hkv, D, kBf16, cache_bf16, 0, max_pos, num_slots, nthreads);
    if (cache_bf16)
      decode(q32.data(), (const uint16_t*)ly.k_cache, (const uint16_t*)ly.v_cache, tab.data(), seq_lens, rows.data(),
             att.data(), M, H, Hkv, D, bs, table_stride, scale, nthreads, tree_lo, tree_bits);
    else
      decode(q32.data(), (const float*)ly.k_cache, (const float*)ly.v_cache, tab.data(), seq_lens, rows.data(),
             att.data(), M, H, Hkv, D, bs, table_stride, scale, nthreads, tree_lo, tree_bits);
    plan_linear(ly.o, att.data(), x, M, nthreads);
    plan_norm(x, res.data(), ly.norm2, h.data(), res2.data(), M, hidden, ly.eps2, nthreads);
    std::swap(res, res2);
    plan_linear(ly.gate_up, h.data(), gu.data(), M, nthreads);
    plan_silu_mul(gu.data(), act.data(), M, ly.down.K, nthreads);
    plan_linear(ly.down, act.data(), x, M, nthreads);
  }
  if (final_norm) {
    plan_norm(x, res.data(), final_norm, h.data(), res2.data(), M, hidden, final_eps, nthreads);
    std::memcpy(x, h.data(), M * hidden * sizeof(A));
  } else {  // no final norm (an EAGLE draft layer's output): x + residual, rounded once as torch's add
    for (int64_t i = 0; i < M * hidden; ++i) x[i] = plan_add(x[i], res[i]);
  }
  return 1;
}

// x [M, hidden] bf16 (roofline_decode_step) or fp32 (roofline_decode_step_f32); the arguments as decode_step's.
#define ROOFLINE_STEP_ARGS const RooflineLayer* layers, int64_t L, const void* final_norm, float final_eps
#define ROOFLINE_STEP_REST int64_t M, int64_t hidden, int64_t H, int64_t Hkv, int64_t D, int64_t bs, int cache_bf16, \
    float scale, const int64_t* pos, const int64_t* slot, const int32_t* table, int64_t table_stride, \
    const int64_t* seq_lens, const float* cs, int64_t max_pos, int64_t num_slots, int nthreads, \
    const int64_t* tree_lo, const uint64_t* tree_bits, void* aux_out, const int64_t* aux_slot, int64_t aux_stride
#define ROOFLINE_STEP_CALL(X) decode_step(layers, L, final_norm, final_eps, X, M, hidden, H, Hkv, D, bs, cache_bf16, \
    scale, pos, slot, table, table_stride, seq_lens, cs, max_pos, num_slots, nthreads, tree_lo, tree_bits, aux_out, \
    aux_slot, aux_stride)
extern "C" int roofline_decode_step(ROOFLINE_STEP_ARGS, uint16_t* x, ROOFLINE_STEP_REST) {
  return ROOFLINE_STEP_CALL(x);
}
extern "C" int roofline_decode_step_f32(ROOFLINE_STEP_ARGS, float* x, ROOFLINE_STEP_REST) {
  return ROOFLINE_STEP_CALL(x);
}
"""
MAX_BLOCK = 64  # s[16 * 64]: keys per block the kernel's score buffer holds


def _cache_dir() -> Path:
    return Path(os.environ.get("ROOFLINE_CACHE_DIR") or Path.home() / ".cache" / "roofline")


def _cpu_key() -> str:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return "unknown"
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def _library() -> ctypes.CDLL | str:
    """The compiled kernel library, or a string saying why there is none (``ENABLED`` is read at each call)."""
    return _build() if ENABLED else "ROOFLINE_CPU_ATTENTION=0"


@functools.cache
def _build() -> ctypes.CDLL | str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return "no C++ compiler (g++) on PATH"
    tag = hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]
    name = f"cpu_paged_attention-{tag}-{_cpu_key()}.so"
    why = ""
    # The cache directory first; if it is unusable (not writable, not a directory) or its file does not load (a
    # truncated or foreign file), a private temporary directory: the engine never fails for want of a cache.
    for where in (_cache_dir(), None):
        try:
            lib = _compile_and_load(cxx, name, where)
        except (OSError, subprocess.SubprocessError) as e:
            why = f"{why}; " if why else ""
            why += f"{'the cache ' + str(where) if where else 'a temporary directory'}: {type(e).__name__}: {e}"
            continue
        return lib  # the library, or the compiler's refusal (another directory would not change it)
    return f"the build failed ({why})"


def _compile_and_load(cxx: str, name: str, where: Path | None, extra_flags: tuple[str, ...] = ()
                      ) -> ctypes.CDLL | str:
    """Build (unless ``where`` already holds ``name``) and load; ``where`` None: a fresh temporary directory.
    ``extra_flags`` follow ``-march=native`` (the tests build ``-mno-avx512f`` to run the AVX2 paths on an AVX-512
    CPU). Returns the library, or a string when the compiler refused the source; OSError for file-system trouble."""
    if where is not None:
        so = where / name
        if so.exists():
            try:
                return _load(so)
            except OSError:
                so.unlink()  # a truncated or foreign file: rebuild it below
        where.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="roofline-cpu-kernel-")) if where is None else where
    with tempfile.TemporaryDirectory(dir=base) as tmp:
        src = Path(tmp) / "kernel.cpp"
        src.write_text(_SOURCE)
        out = Path(tmp) / name
        cmd = [cxx, "-O3", "-march=native", *extra_flags, "-fopenmp", "-shared", "-fPIC", "-o", str(out), str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            return f"the build failed: {' '.join(cmd)}: {r.stderr.strip()[-400:]}"
        so = base / name
        os.replace(out, so)  # atomic: a concurrent process sees the whole file or none
    return _load(so)


def _load(so: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(so))
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn_name in ("roofline_decode_f32", "roofline_decode_bf16"):
        fn = getattr(lib, fn_name)
        fn.argtypes = [ptr] * 7 + [i64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ptr, ptr]
        fn.restype = None
    lib.roofline_decode_codes.argtypes = [ptr] * 5 + [ctypes.c_int] * 2 + [ptr] * 4 + [i64] * 6 \
        + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ptr, ptr]
    lib.roofline_decode_codes.restype = None
    lib.roofline_rope_store.argtypes = [ptr] * 3 + [i64] * 3 + [ptr] * 6 + [i64] * 4 + [ctypes.c_int] * 3 + [i64] * 2 \
        + [ctypes.c_int]
    lib.roofline_rope_store.restype = ctypes.c_int
    lib.roofline_silu_mul_bf16.argtypes = [ptr] * 2 + [i64] * 2 + [ctypes.c_int]
    lib.roofline_silu_mul_bf16.restype = None
    lib.roofline_gemv_w8a8.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int, ptr, ctypes.c_int, i64, i64,
                                       ctypes.c_int]
    lib.roofline_gemv_w8a8.restype = ctypes.c_int
    lib.roofline_decode_step.argtypes = [ptr, i64, ptr, ctypes.c_float, ptr] + [i64] * 6 + [ctypes.c_int, ctypes.c_float] \
        + [ptr] * 3 + [i64, ptr, ptr, i64, i64, ctypes.c_int, ptr, ptr, ptr, ptr, i64]
    lib.roofline_decode_step.restype = ctypes.c_int
    lib.roofline_decode_step_f32.argtypes = lib.roofline_decode_step.argtypes
    lib.roofline_decode_step_f32.restype = ctypes.c_int
    lib.roofline_add_rmsnorm_f32.argtypes = [ptr] * 5 + [i64] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.roofline_add_rmsnorm_f32.restype = None
    lib.roofline_silu_mul_f32.argtypes = [ptr] * 2 + [i64] * 2 + [ctypes.c_int]
    lib.roofline_silu_mul_f32.restype = None
    lib.roofline_vnni_linear_bf16.argtypes = [ptr] * 4 + [i64] * 3 + [ctypes.c_int]
    lib.roofline_vnni_linear_bf16.restype = ctypes.c_int
    lib.roofline_linear_f32.argtypes = [ptr] * 4 + [i64] * 3 + [ctypes.c_int]
    lib.roofline_linear_f32.restype = ctypes.c_int
    lib.roofline_amx_pack_bf16.argtypes = [ptr] * 2 + [i64] * 2 + [ctypes.c_int]
    lib.roofline_amx_pack_bf16.restype = ctypes.c_int
    lib.roofline_amx_linear_bf16.argtypes = [ptr] * 4 + [i64] * 3 + [ctypes.c_int]
    lib.roofline_amx_linear_bf16.restype = ctypes.c_int
    lib.roofline_amx_pack_s8.argtypes = [ptr] * 2 + [i64] * 2 + [ctypes.c_int]
    lib.roofline_amx_pack_s8.restype = ctypes.c_int
    lib.roofline_amx_linear_w8a8.argtypes = [ptr, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int, ptr, ctypes.c_int,
                                             i64, i64, i64, ctypes.c_int]
    lib.roofline_amx_linear_w8a8.restype = ctypes.c_int
    lib.roofline_vnni_linear_w8a8.argtypes = lib.roofline_amx_linear_w8a8.argtypes
    lib.roofline_vnni_linear_w8a8.restype = ctypes.c_int
    lib.roofline_add_rmsnorm_bf16.argtypes = [ptr] * 5 + [i64] * 2 + [ctypes.c_float, ctypes.c_int]
    lib.roofline_add_rmsnorm_bf16.restype = None
    return lib


def unavailable_reason() -> str | None:
    """None where the kernel is built and loaded, else why not (logged once by the caller)."""
    lib = _library()
    return lib if isinstance(lib, str) else None


CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn)
CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)  # quantized caches: codes plus float32 scales


def supports(num_heads: int, head_dim: int, k_cache: torch.Tensor) -> bool:
    """Whether the kernel runs ``num_heads`` query heads of ``head_dim`` over this cache: an fp32, bf16, int8 or
    fp8_e4m3 CPU cache [num_blocks, block_size, H_kv, D] with block_size <= 64, H / H_kv <= 16, D <= 256, H <= 256
    and H * D <= 16384, and the library built."""
    return (k_cache.device.type == "cpu" and k_cache.dtype in CACHE_DTYPES and k_cache.dim() == 4
            and k_cache.shape[1] <= MAX_BLOCK and k_cache.shape[3] == head_dim <= MAX_HEAD_DIM
            and num_heads % k_cache.shape[2] == 0 and num_heads // k_cache.shape[2] <= MAX_GROUP
            and num_heads <= MAX_HEADS and num_heads * head_dim <= MAX_STATE
            and unavailable_reason() is None)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor, scale: float,
                           out: torch.Tensor, tree_lo: torch.Tensor | None = None,
                           tree_bits: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> None:
    """Attention of decode rows over their paged context, written into ``out`` (the rows not named are left).

    Each row is one work item whose arithmetic depends only on its own query and keys, so its result is the same
    bits in any batch and any chunking (a prefill chunk's rows can run as items too: row t of a chunk with L keys
    after it, q_len rows, is an item over L - q_len + t + 1 keys).

    Args:
        q: [T, H, D] float32, contiguous (the step's rows; only ``rows`` are read).
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] float32 or bfloat16, or int8 / float8_e4m3fn codes
            with ``k_scale`` / ``v_scale`` (``roofline.kernels.common``): float32, contiguous, per slot
            [num_blocks, block_size, H_kv] or per KV head [H_kv]. Each block is dequantized once (code x scale in
            fp32, ``ref_dequantize``'s arithmetic) and attended as an fp32 block: the same bits as this function on
            the dequantized fp32 cache.
        block_tables: [n, max_blocks] int64, contiguous: row i's blocks in order.
        seq_lens: [n] int64: row i attends to its first seq_lens[i] cache positions (>= 1).
        rows: [n] int64: row i's index in q and out.
        out: [T, H, D] float32 or bfloat16 (rounded once from the fp32 result), contiguous.
        tree_lo, tree_bits: optional [n] int64 (both or neither): a token tree's ancestor mask in decode-row form.
            Row i sees cache position t >= tree_lo[i] only where bit t - tree_lo[i] of tree_bits[i] (two's
            complement) is set; -1 (all bits) is plain causal. Where tree_bits[i] != -1, seq_lens[i] - tree_lo[i]
            must be in [1, 64] and the row must see key 0 (tree_lo[i] >= 1, or bit 0 set).

    Raises:
        ValueError: a dtype, layout or size outside :func:`supports`, or a tree row outside those ranges (names it).
    """
    lib = _library()
    if isinstance(lib, str):
        raise ValueError(f"the CPU paged attention kernel is unavailable: {lib}")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if (q.device.type != "cpu" or q.dtype != torch.float32 or not supports(q.shape[1], q.shape[2], k_cache)
            or v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape):
        raise ValueError(f"unsupported: q {q.dtype} {tuple(q.shape)}, cache {k_cache.dtype} {tuple(k_cache.shape)}")
    for name, t, dt in (("q", q, (torch.float32,)), ("out", out, (torch.float32, torch.bfloat16)),
                        ("block_tables", block_tables, (torch.int64,)), ("seq_lens", seq_lens, (torch.int64,)),
                        ("rows", rows, (torch.int64,))):
        if t.dtype not in dt or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {' or '.join(map(str, dt))}, got {t.dtype} "
                             f"(contiguous: {t.is_contiguous()})")
    if out.shape != q.shape:
        raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    codes = k_cache.dtype in CODE_DTYPES
    per_slot = False
    if codes:
        slot_shape, head_shape = tuple(k_cache.shape[:3]), (num_kv_heads,)
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if (t is None or t.dtype != torch.float32 or not t.is_contiguous()
                    or tuple(t.shape) not in (slot_shape, head_shape)):
                raise ValueError(f"a {k_cache.dtype} cache needs {name} as contiguous float32 {list(slot_shape)} "
                                 f"(per slot) or {list(head_shape)} (per KV head), got "
                                 f"{None if t is None else (t.dtype, tuple(t.shape))}")
        per_slot = k_scale.dim() == 3
        if v_scale.dim() != k_scale.dim():
            raise ValueError(f"k_scale {tuple(k_scale.shape)} and v_scale {tuple(v_scale.shape)} must have one form")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale / v_scale go with an int8 or fp8 cache, not {k_cache.dtype}")
    n = rows.shape[0]
    if (tree_lo is None) != (tree_bits is None):
        raise ValueError("tree_lo and tree_bits go together: pass both or neither")
    if tree_lo is not None:
        for name, t in (("tree_lo", tree_lo), ("tree_bits", tree_bits)):
            if t.dtype != torch.int64 or not t.is_contiguous() or t.shape != (n,):
                raise ValueError(f"{name} must be contiguous int64 [{n}], got {t.dtype} {tuple(t.shape)}")
        masked = tree_bits != -1
        span = seq_lens - tree_lo
        bad = masked & ((span < 1) | (span > 64) | ((tree_lo < 1) & ((tree_bits & 1) == 0)))
        if bad.any():
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"tree row {i}: seq_lens - tree_lo = {int(span[i])} (allowed 1..64), tree_lo = "
                             f"{int(tree_lo[i])} with bit 0 {'set' if int(tree_bits[i]) & 1 else 'clear'} (key 0 "
                             f"must be seen: tree_lo >= 1 or bit 0 set)")
    if n == 0:
        return
    if codes:
        lib.roofline_decode_codes(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(),
            int(per_slot), int(k_cache.dtype == torch.float8_e4m3fn), block_tables.data_ptr(), seq_lens.data_ptr(),
            rows.data_ptr(), out.data_ptr(), n, q.shape[1], num_kv_heads, head_dim, k_cache.shape[1],
            block_tables.stride(0), float(scale), torch.get_num_threads(), int(out.dtype == torch.bfloat16),
            None if tree_lo is None else tree_lo.data_ptr(), None if tree_bits is None else tree_bits.data_ptr())
        return
    fn = lib.roofline_decode_f32 if k_cache.dtype == torch.float32 else lib.roofline_decode_bf16
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
       rows.data_ptr(), out.data_ptr(), n, q.shape[1], num_kv_heads, head_dim, k_cache.shape[1],
       block_tables.stride(0), float(scale), torch.get_num_threads(), int(out.dtype == torch.bfloat16),
       None if tree_lo is None else tree_lo.data_ptr(), None if tree_bits is None else tree_bits.data_ptr())


def rope_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, q_dtype: torch.dtype) -> torch.Tensor | None:
    """Rotate-half RoPE of a step's q and k and the KV-cache store, in one C++ pass over the rows
    (``roofline_rope_store``): the values of ``roofline.kernels.rope_cache.ref_rotary`` followed by the cache write
    (products rounded before the add, as torch's separate ops; rotated q and k rounded to the model dtype), in
    place of ~25 small torch ops per layer (the angle-table gather, 8 multiplies, 2 adds, 2 cats, casts and two
    ``index_put_``). q, k and v are read, never written.

    Args:
        q: [T, H, D], k and v: [T, H_kv, D], float32 or bfloat16 (one dtype), each with its heads contiguous
            (strides (any, D, 1)): the fused qkv projection's views.
        positions: [T] int64, each in [0, cos_sin_cache.shape[0]).
        cos_sin_cache: [max_positions, D] float32, contiguous (``RotaryEmbedding.cos_sin_cache``).
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] float32 or bfloat16, contiguous (an fp32 model needs an
            fp32 cache).
        slot_mapping: [T] int64: row t's k/v go to flat slot ``slot_mapping[t]`` (< 0: not stored).
        q_dtype: float32 (what the attention reads) or bfloat16 (a bf16 model only).

    Returns:
        The rotated q [T, H, D] in ``q_dtype``, or None where this does not apply (no library, another dtype or
        layout, a quantized cache, a position past the table): the caller runs the reference.
    """
    lib = _library()
    if isinstance(lib, str) or q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        return None
    T, H, D = q.shape
    dt = q.dtype
    if (q.device.type != "cpu" or dt not in (torch.float32, torch.bfloat16) or k.dtype != dt or v.dtype != dt
            or k.shape[0] != T or k.shape[2] != D or D % 2
            or any(t.stride(2) != 1 or t.stride(1) != D for t in (q, k, v))
            or k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype
            or k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != (k.shape[1], D) or v_cache.shape != k_cache.shape
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous()
            or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != D or q_dtype not in (torch.float32, torch.bfloat16)
            or (dt == torch.float32 and (k_cache.dtype != torch.float32 or q_dtype != torch.float32))
            or positions.shape != (T,) or slot_mapping.shape != (T,)):
        return None
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    q_out = torch.empty(T, H, D, dtype=q_dtype)
    if T == 0:
        return q_out
    ok = lib.roofline_rope_store(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0),
                                 positions.data_ptr(), cos_sin_cache.data_ptr(), slots.data_ptr(), k_cache.data_ptr(),
                                 v_cache.data_ptr(), q_out.data_ptr(), T, H, k.shape[1], D,
                                 int(dt == torch.bfloat16), int(k_cache.dtype == torch.bfloat16),
                                 int(q_dtype == torch.bfloat16), cos_sin_cache.shape[0],
                                 k_cache.shape[0] * k_cache.shape[1], torch.get_num_threads())
    return q_out if ok else None
