"""CPU feature detection for the CPU decode path (issue 32).

``detect_cpu_features`` reads the x86 flags of ``/proc/cpuinfo`` once and reports which matrix extensions
oneDNN/FBGEMM can use: AMX (``amx_tile`` with ``amx_bf16``/``amx_int8``), AVX-512 BF16 (``avx512_bf16``),
AVX-512 VNNI (``avx512_vnni``), AVX-512F, and AVX2 with FMA (``avx2``, ``fma``). Source: Linux ``arch/x86/include/asm/cpufeatures.h`` flag names.
``startup_line`` is the one line the CLI prints to say what the machine offers and what was chosen, and why
the chosen format runs fast or slowly here (``format_note``); ``fastest_dtype`` is bf16 where oneDNN has bf16
matrix instructions (``scripts/run.sh`` asks for it).

Thread policy. OpenMP's fork/join per op makes every op wait for its slowest thread, so an intra-op pool larger
than the cores other processes leave free collapses *when the waiting threads spin* (issue 32: 1,939 ms per
decode step with 2 threads beside one busy process on 2 cores, 159 ms with 1). Threads that never spin do not
collapse, but every op then pays a futex wake-up per thread: the main job's decode step on a quiet 2-core Xeon
took 108 ms with purely passive threads and 79 ms with threads that spin 100,000 times before they sleep
(``bench/results/cpu-threads-20261204``). So ``import roofline`` (before torch loads; libgomp reads these once)
sets ``OMP_WAIT_POLICY=PASSIVE`` with ``GOMP_SPINCOUNT=100000``: a bounded spin, then sleep. Spinning is fast
only while the cores are free, so the pool follows the load: ``apply_thread_policy`` sizes it at start-up to the
cores other processes leave free (``choose_threads`` on ``other_busy_cores``) and returns a ``ThreadGovernor``
that the worker ticks every step; about twice a second it re-reads ``/proc/stat`` and shrinks the pool at once
when another process takes a core, and grows it back after two quiet readings. ``OMP_NUM_THREADS`` set by the
user pins the count (no governor: torch's kernels round differently with the thread count, so a pinned count is
also the reproducible one); ``GOMP_SPINCOUNT=0`` gives purely passive threads, which keep every core.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass

# OpenMP threads that spin between ops collapse when another process shares the cores (issue 32: 12x slower
# decode beside one busy process); passive waiting does not. libgomp reads this once, when torch loads, so
# ``import roofline`` imports this module first, before anything imports torch.
TORCH_LOADED_BEFORE_ROOFLINE = "torch" in sys.modules
SPIN_COUNT = 100_000  # GOMP_SPINCOUNT default: spin-waits before a thread sleeps (see the module docstring)
if not TORCH_LOADED_BEFORE_ROOFLINE:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))


@dataclass(frozen=True)
class CpuFeatures:
    model: str  # "model name" of the first processor, "unknown" if absent
    cores: int  # logical processors listed in cpuinfo (>= 1)
    avx512f: bool
    avx512_bf16: bool
    avx512_vnni: bool
    amx_bf16: bool
    amx_int8: bool
    avx2_fma: bool = False  # AVX2 and FMA: the small-M fp32 linear's loop where there is no AVX-512F

    @property
    def best_matrix_isa(self) -> str:
        """The fastest bf16/int8 matrix path: "amx", "avx512_bf16", "avx512_vnni", "avx512" or "none"."""
        if self.amx_bf16 or self.amx_int8:
            return "amx"
        if self.avx512_bf16:
            return "avx512_bf16"
        if self.avx512_vnni:
            return "avx512_vnni"
        return "avx512" if self.avx512f else "none"


def parse_cpuinfo(text: str) -> CpuFeatures:
    """Features from the text of /proc/cpuinfo (x86 layout: "key\\t: value" lines, one block per processor).

    Only the first processor's ``flags`` and ``model name`` are read; ``cores`` counts ``processor`` lines.
    Text without flags (non-x86, containers hiding it) gives every feature False.
    """
    model, flags, cores = "unknown", set(), 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            cores += 1
        elif key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    amx_tile = "amx_tile" in flags
    return CpuFeatures(model=model, cores=max(cores, 1), avx512f="avx512f" in flags,
                       avx512_bf16="avx512_bf16" in flags, avx512_vnni="avx512_vnni" in flags,
                       amx_bf16=amx_tile and "amx_bf16" in flags, amx_int8=amx_tile and "amx_int8" in flags,
                       avx2_fma={"avx2", "fma"} <= flags)


@functools.cache
def detect_cpu_features(path: str = "/proc/cpuinfo") -> CpuFeatures:
    """``parse_cpuinfo`` of ``path``, read once per process; an unreadable file gives no features."""
    try:
        with open(path) as f:
            return parse_cpuinfo(f.read())
    except OSError:
        return parse_cpuinfo("")


def fastest_dtype(features: CpuFeatures) -> tuple[str, str]:
    """The faster activation/weight dtype for decode on this CPU, and why: ``"bfloat16"`` where oneDNN has bf16
    matrix instructions (AMX-BF16 or AVX-512 BF16), else ``"float32"`` (bf16 would be converted to fp32 in
    software: correct, slower). Measured on an AMD EPYC Zen 5 with AVX-512 BF16, 2 threads, the default model,
    alternated in one run (``python -m roofline.bench.cpu --table``, README CPU table): bf16 decode steps
    1.3x fp32's at batch 1 and 2.6x at batch 32. Not exact: bf16 is not token-identical to HF fp32 (its
    quality is in the README), which is why the engine's ``--dtype auto`` stays float32 and ``scripts/run.sh``
    asks for this one."""
    if features.amx_bf16:
        return "bfloat16", "AMX-BF16 tiles"
    if features.avx512_bf16:
        return "bfloat16", "AVX-512 BF16 dot products"
    return "float32", "no AVX-512 BF16 or AMX: bf16 would be converted in software"


# What `roofline eval` measured for --quantization int8 on CPU (bf16 activations, W8A8 per-token INT8) against the
# fp32 model, on the default model (SmolLM2-135M-Instruct): bench/results/cpu-plan-20261204/eval-b62302b.json
# (commit f986af7, Intel Xeon with AMX, 8184 scored ShareGPT tokens, 16 greedy prompts, passkey at 1k tokens).
DEFAULT_MODEL_INT8_QUALITY = ("on the default model, roofline eval: perplexity 6.989 vs 6.723 fp32 (+3.95%; bf16 "
                              "+0.08%), KL 0.035 nats (p99 0.20), top-1 agreement 0.915, passkey 0.6 vs 1.0")


def auto_quantization(features: CpuFeatures, dtype: str, default_model: bool = False) -> tuple[str | None, str, str]:
    """``--quantization auto`` on CPU: (the weight format, the dtype, the start-up note saying what was chosen, why
    and at what quality). INT8 W8A8 with bf16 activations where the CPU has AVX-512 VNNI and bf16 units (the C++
    W8A8 GEMVs of the CPU decode plan: 6.39 ms a token at batch 1 against bf16's 11.40 ms on the Intel Xeon (AMX)
    of 2026-12-05, README CPU table), with ``dtype`` "auto" becoming "bfloat16"; else no quantization (with fp32
    activations INT8 loses its gain: 16.4 ms there). ``default_model``: the model is the default one, whose
    quality was measured (other models: the note gives the command that measures it)."""
    fast, _ = fastest_dtype(features)
    if not features.avx512_vnni or fast != "bfloat16":
        return None, dtype, ("none: this CPU lacks AVX-512 VNNI or bf16 units, so the INT8 GEMVs would not pay; "
                             "full-precision weights")
    if dtype not in ("auto", "bfloat16"):
        return None, dtype, (f"none: INT8 pays with bf16 activations, and --dtype is {dtype}; full-precision "
                             f"weights")
    quality = (DEFAULT_MODEL_INT8_QUALITY if default_model else
               "quality not measured for this model here: run `roofline eval --model MODEL --device cpu --candidates "
               "dtype=bfloat16 dtype=bfloat16,quantization=int8`")
    return "int8", "bfloat16", (f"int8 (W8A8 with bf16 activations: AVX-512 VNNI GEMVs, the fastest batch-1 format "
                                f"on this CPU, ~1.8x bf16's decode step; at 32 rows bf16 is ~2.7x faster here, so "
                                f"serve batches in bf16; {quality})")


# Measured on the AMD EPYC Zen 5 of 2026-12-04 (2 threads, the default model, alternated in one run, decode step
# against fp32's): float16 1.8-2.2x at batch 1 (torch's fp16 GEMV converts in registers and streams half fp32's
# bytes), 0.39x at batch 32 (its fp16 GEMM above M = 1 is a software path); int4 (W4A16, group 64,
# ``torch._weight_int4pack_mm_for_cpu``) 0.22x at batch 1 and 0.61x at batch 32.
FP16_NOTE = ("float16: fast at batch 1 (a GEMV converting in registers, ~2x fp32's step), slow path at larger "
             "batches (a software GEMM, 0.4x fp32 at batch 32)")
INT4_NOTE = ("int4 W4A16, slow path: torch's CPU int4 kernel, ~0.2x fp32's step at batch 1 and 0.6x at 32; "
             "--quantization int8 is faster here")


def format_note(features: CpuFeatures, dtype: str, quantization: str | None = None) -> str:
    """Why the CPU runs ``dtype`` (and ``quantization``) fast or slowly here: names the matrix instructions used,
    the slow path when the CPU lacks them or torch has none (still correct), or the faster dtype available."""
    notes = []
    fast, isa = fastest_dtype(features)
    if dtype == "bfloat16":
        notes.append(f"bf16 on {isa}" if fast == "bfloat16" else f"slow path: {isa}")
    elif dtype == "float32" and quantization is None:
        notes.append(f"exact; --dtype bfloat16 is faster here, on {isa}" if fast == "bfloat16" else "exact")
    elif dtype == "float16":
        notes.append(FP16_NOTE)
    if quantization in ("int8", "smoothquant"):
        vnni = "AMX-INT8" if features.amx_int8 else "AVX-512 VNNI" if features.avx512_vnni else None
        notes.append(f"int8 W8A8 dynamic on {vnni}, LM head included" if vnni else
                     "int8 W8A8 dynamic, slow path: no AVX-512 VNNI or AMX-INT8")
    elif quantization == "int4":
        notes.append(INT4_NOTE)
    return "; ".join(notes)


def startup_line(features: CpuFeatures, dtype: str, threads: int, why: str = "", quantization: str | None = None,
                 ) -> str:
    """One line: CPU model, the matrix extensions found, the dtype (and quantization) in use and why it runs
    fast or slowly here (``format_note``), the thread count and why that count."""
    isa = [n for n, on in (("AMX", features.amx_bf16 or features.amx_int8), ("AVX-512 BF16", features.avx512_bf16),
                           ("AVX-512 VNNI", features.avx512_vnni), ("AVX-512F", features.avx512f)) if on]
    note = format_note(features, dtype, quantization)
    fmt = f"dtype {dtype}" + (f", quantization {quantization}" if quantization else "") + (f" ({note})" if note else "")
    return (f"CPU: {features.model} ({features.cores} cores; {', '.join(isa) or 'no AVX-512/AMX'}); "
            f"{fmt}, {threads} thread{'s' if threads != 1 else ''}" + (f" ({why})" if why else ""))


def _proc_stat_times(path: str = "/proc/stat", cpus: frozenset[int] | None = None) -> tuple[int, int, int] | None:
    """(busy, total jiffies summed over the CPUs, number of CPUs) from /proc/stat, None if unreadable. ``cpus``:
    only those ``cpuN`` lines (this process's affinity mask), else the all-CPU line."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    per_cpu = [line.split() for line in lines if line.startswith("cpu") and line[3:4].isdigit()]
    if cpus is not None:
        rows = [[int(x) for x in r[1:9]] for r in per_cpu if int(r[0][3:]) in cpus]
        if not rows:
            return None
        fields = [sum(col) for col in zip(*rows, strict=False)]
        ncpu = len(rows)
    else:
        fields = [int(x) for x in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
        ncpu = len(per_cpu)
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields), max(ncpu, 1)


def other_busy_cores(interval_s: float = 0.1) -> float | None:
    """Cores kept busy by *other* processes over ``interval_s`` seconds (>= 0.0), or None without /proc/stat.
    ``_others_busy`` over a sleep: this process's share is only the probe's own overhead."""
    read = functools.partial(_proc_stat_times, cpus=_affinity())
    a, own0, t0 = read(), time.process_time(), time.monotonic()
    time.sleep(interval_s)
    return _others_busy(a, read(), time.process_time() - own0, time.monotonic() - t0)


def _others_busy(a: tuple[int, int, int] | None, b: tuple[int, int, int] | None, own_s: float, wall_s: float
                 ) -> float | None:
    """Cores other processes kept busy between two ``_proc_stat_times`` readings ``a`` and ``b`` (this
    process's CPUs), ``wall_s`` seconds apart, during which this process used ``own_s`` CPU-seconds (every
    thread, ``time.process_time``): busy cores minus this process's, at least 0; None without both readings."""
    if a is None or b is None or b[1] <= a[1] or wall_s <= 0:
        return None
    return max(0.0, (b[0] - a[0]) / (b[1] - a[1]) * b[2] - own_s / wall_s)


def choose_threads(cores: int, other_busy: float | None, requested: int | None = None,
                   passive: bool = False) -> tuple[int, str]:
    """The intra-op thread count for ``cores`` usable cores with ``other_busy`` cores taken by other processes,
    and why. ``requested`` (``OMP_NUM_THREADS``) wins; with purely ``passive`` OpenMP waiting, every core
    (sleeping threads do not collapse under sharing); otherwise the free cores, rounded, at least 1.

    Raises:
        ValueError: ``cores`` < 1 or ``requested`` < 1.
    """
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    if requested is not None:
        if requested < 1:
            raise ValueError(f"OMP_NUM_THREADS must be >= 1, got {requested}")
        over = f"; more than the {cores} usable cores: oversubscribed, slower" if requested > cores else ""
        return requested, f"OMP_NUM_THREADS={requested}{over}"
    if passive:
        return cores, f"{cores} usable cores, OpenMP wait policy passive"
    if other_busy is None:
        return cores, f"{cores} usable cores, load unknown"
    return free_cores(cores, other_busy), f"{cores} usable cores, {other_busy:.1f} busy with other processes"


def free_cores(cores: int, other_busy: float) -> int:
    """``cores`` minus the cores other processes keep busy, rounded to the nearest, between 1 and ``cores``."""
    return max(1, min(cores, int(cores - other_busy + 0.5)))


class ThreadGovernor:
    """Keeps torch's intra-op pool at the cores other processes leave free while an engine runs (issue 32).

    ``tick()`` is called once per engine step and costs a clock read; every ``interval_s`` seconds it reads the
    busy time of this process's CPUs from /proc/stat and subtracts this process's own CPU time
    (``time.process_time``: every thread) over the same span, which leaves the cores other processes used.
    The pool shrinks on the first reading that asks for fewer threads (2 spinning threads beside a busy process
    ran 3-25x slower) and grows only after ``grow_after`` consecutive readings that ask for more (no flapping).

    Args:
        cores: usable cores (>= 1), the largest pool.
        threads: the pool's size now (1..cores).
        interval_s: seconds between readings (> 0).
        grow_after: consecutive readings needed to grow the pool (>= 1).
        read_stat / clock / cpu_time / set_threads: injectable for tests (/proc/stat over the affinity CPUs,
            ``time.monotonic``, ``time.process_time``, ``torch.set_num_threads``).
    """

    def __init__(self, cores: int, threads: int, interval_s: float = 0.5, grow_after: int = 2,
                 read_stat=None, clock=time.monotonic, cpu_time=time.process_time, set_threads=None):
        if not 1 <= threads <= cores:
            raise ValueError(f"threads must be in [1, cores={cores}], got {threads}")
        if interval_s <= 0 or grow_after < 1:
            raise ValueError(f"interval_s must be > 0 and grow_after >= 1, got {interval_s} and {grow_after}")
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        if read_stat is None:
            read_stat = functools.partial(_proc_stat_times, cpus=_affinity())
        self.cores, self.threads, self.interval_s, self.grow_after = cores, threads, interval_s, grow_after
        self._read_stat, self._clock, self._cpu_time, self._set_threads = read_stat, clock, cpu_time, set_threads
        self._grow_votes = 0
        self.changes = 0  # how many times the pool was resized
        self.seconds_at: dict[int, float] = {}  # thread count -> seconds spent at it, up to the last reading
        self.last_other_busy: float | None = None
        self._mark = self._sample()

    def _sample(self):
        return self._clock(), self._cpu_time(), self._read_stat()

    def tick(self) -> int | None:
        """Re-size the pool if a reading is due and says so; returns the new thread count, else None."""
        now = self._clock()
        if now - self._mark[0] < self.interval_s:
            return None
        t0, own0, stat0 = self._mark
        self._mark = (t1, own1, stat1) = self._sample()
        self.seconds_at[self.threads] = self.seconds_at.get(self.threads, 0.0) + t1 - t0
        other = _others_busy(stat0, stat1, own1 - own0, t1 - t0)
        if other is None:
            return None
        self.last_other_busy = other
        want = free_cores(self.cores, other)
        if want > self.threads:
            self._grow_votes += 1
            if self._grow_votes < self.grow_after:
                return None
        self._grow_votes = 0
        if want == self.threads:
            return None
        self._set_threads(want)
        self.threads, self.changes = want, self.changes + 1
        return want

    def summary(self) -> str:
        """One line for the run summary: the seconds at each thread count and the number of re-sizes."""
        spans = ", ".join(f"{n} for {t:.1f} s" for n, t in sorted(self.seconds_at.items(), reverse=True))
        return (f"{spans or f'{self.threads} throughout'} since start-up (re-sized {self.changes} "
                f"time{'s' if self.changes != 1 else ''} to the cores other processes left free)")


def _affinity() -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def wait_policy_is_passive() -> bool:
    """Whether libgomp loaded with purely passive waiting (``OMP_WAIT_POLICY=PASSIVE`` and ``GOMP_SPINCOUNT=0``,
    both in the environment before torch was imported): threads that never spin. ``import roofline`` sets the
    policy with a bounded spin (``SPIN_COUNT``), which is not purely passive."""
    if TORCH_LOADED_BEFORE_ROOFLINE or os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        return False
    try:
        return int(os.environ.get("GOMP_SPINCOUNT", "0")) == 0
    except ValueError:
        return False


def apply_thread_policy(dtype: str, quantization: str | None = None) -> tuple[str, ThreadGovernor | None]:
    """Size torch's intra-op pool with ``choose_threads`` (sampling the load now) and return the start-up line
    and the ``ThreadGovernor`` that keeps it sized while the engine runs (None when ``OMP_NUM_THREADS`` pins the
    count, or threads never spin).

    Raises:
        ValueError: ``OMP_NUM_THREADS`` is set but not an integer >= 1.
    """
    import torch

    env = os.environ.get("OMP_NUM_THREADS")
    requested = None
    if env is not None:  # set but empty is an error too (libgomp says so as well)
        try:
            requested = int(env)
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS must be an integer >= 1, got {env!r}") from None
    passive = wait_policy_is_passive()
    busy = None if requested is not None or passive else other_busy_cores()
    cores = usable_cores()
    threads, why = choose_threads(cores, busy, requested, passive)
    torch.set_num_threads(threads)
    governor = None
    if requested is None and not passive:
        governor = ThreadGovernor(cores, threads)
        why += "; re-sized to the free cores while running"
    return startup_line(detect_cpu_features(), dtype, threads, why, quantization), governor
