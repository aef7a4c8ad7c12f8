"""Hardware for the bound model: labelled presets and a probe that measures the present device.

A :class:`HardwareSpec` says where its numbers come from (``source``):
- ``"datasheet"``: the vendor's published peak (dense, no sparsity), with the datasheet cited;
- ``"hypothetical"``: a round-number device for worked examples (the worksheet's 3.0 TB/s, 1,000 TFLOP/s);
- ``"measured"``: written by :func:`probe` (``roofline probe``) on this machine, with versions and date.

The bound model (Pope et al. 2022, "Efficiently Scaling Transformer Inference") needs only the read
bandwidth (bytes/s) and the dense matmul peak (FLOP/s) per dtype. The parallel bound adds the links
between GPUs: :data:`INTERCONNECT_PRESETS` (``nvlink``, ``pcie``, ``ib``, ``ethernet``), each with its
datasheet bandwidth and NCCL's per-step latency, cited (defined in ``roofline.costmodel.links``, re-exported
here). torch is imported lazily, inside the probe functions, so presets and ``roofline cost`` load without it.

An executor builds a measured device profile from :func:`measure_read_bandwidth` (bytes/s) and
:func:`measure_gemm_flops` (FLOP/s), both in-process on its device; dtypes may be given in the engine's names
(``bfloat16``, ``torch.float32``), as everywhere in the bound model.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from roofline.costmodel import canonical_dtype
from roofline.costmodel.links import INTERCONNECT_PRESETS, load_interconnect  # noqa: F401 - re-exported

SOURCES = ("datasheet", "hypothetical", "measured")
HARDWARE_JSON_FORMAT = "roofline-hardware/1"


@dataclass(frozen=True)
class HardwareSpec:
    """A device as the bound model sees it.

    Attributes:
        name: preset name or measured device name.
        memory_bandwidth: bytes/s that a decode step can read from device memory.
        peak_flops: dense FLOP/s (OP/s for int8) per dtype key: ``bf16``, ``fp16``, ``fp8``, ``int8``, ``fp32``.
        memory_capacity: device memory in bytes, or ``None`` when unknown (hypothetical devices).
        source: ``"datasheet"``, ``"hypothetical"`` or ``"measured"``.
        citation: where the numbers come from (datasheet title, or "roofline probe on ...").
        details: probe results (all rounds, versions, date); empty for presets.
    """

    name: str
    memory_bandwidth: float
    peak_flops: Mapping[str, float]
    memory_capacity: float | None
    source: str
    citation: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}; got {self.source!r}")
        if not (isinstance(self.memory_bandwidth, int | float) and math.isfinite(self.memory_bandwidth)
                and self.memory_bandwidth > 0):
            raise ValueError(f"memory_bandwidth must be a finite number of bytes/s > 0, got {self.memory_bandwidth!r}")
        for dtype, flops in self.peak_flops.items():
            if not (isinstance(flops, int | float) and math.isfinite(flops) and flops > 0):
                raise ValueError(f"peak_flops[{dtype!r}] must be a finite FLOP/s > 0, got {flops!r}")
        if self.memory_capacity is not None and not self.memory_capacity > 0:
            raise ValueError(f"memory_capacity must be > 0 bytes or None, got {self.memory_capacity!r}")
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        object.__setattr__(self, "details", MappingProxyType(dict(self.details)))

    def peak(self, dtype: str = "bf16") -> float:
        """Dense peak FLOP/s for ``dtype``, a key of :attr:`peak_flops` or the engine's name for it
        (``bfloat16``, ``torch.float16``, ``fp8_e4m3``: :func:`roofline.costmodel.canonical_dtype`);
        ``bf16`` and ``fp16`` stand in for each other.

        Raises:
            ValueError: no peak known for ``dtype`` (lists the known dtypes).
        """
        name = canonical_dtype(dtype)
        for key in (dtype, name, {"bf16": "fp16", "fp16": "bf16", "fp8_e4m3": "fp8"}.get(name, name)):
            if key in self.peak_flops:
                return self.peak_flops[key]
        raise ValueError(f"{self.name} has no peak FLOP/s for dtype {dtype!r}; known: "
                         f"{', '.join(self.peak_flops) or 'none'}")

    def to_dict(self) -> dict[str, Any]:
        """The hardware JSON that :func:`load_hardware` reads back."""
        return {"format": HARDWARE_JSON_FORMAT, "name": self.name,
                "memory_bandwidth_bytes_per_s": self.memory_bandwidth,
                "peak_flops": dict(self.peak_flops), "memory_capacity_bytes": self.memory_capacity,
                "source": self.source, "citation": self.citation, "details": _plain(self.details)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HardwareSpec:
        try:
            return cls(name=d["name"], memory_bandwidth=float(d["memory_bandwidth_bytes_per_s"]),
                       peak_flops={k: float(v) for k, v in d.get("peak_flops", {}).items()},
                       memory_capacity=(None if d.get("memory_capacity_bytes") is None
                                        else float(d["memory_capacity_bytes"])),
                       source=d.get("source", "measured"), citation=d.get("citation", ""),
                       details=d.get("details", {}))
        except KeyError as e:
            raise ValueError(f"hardware JSON lacks key {e.args[0]!r}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj


# Dense peaks (no 2:4 sparsity). Capacities are the datasheet's decimal GB.
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "h100-sxm": HardwareSpec(
        name="h100-sxm", memory_bandwidth=3.35e12,
        peak_flops={"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "int8": 1979e12, "fp32": 67e12},
        memory_capacity=80e9, source="datasheet",
        citation="NVIDIA H100 Tensor Core GPU datasheet, SXM5: 80 GB HBM3 at 3.35 TB/s; dense BF16 989 "
                 "TFLOP/s, FP8 1,979 TFLOP/s (sparsity figures halved)"),
    "h200": HardwareSpec(
        name="h200", memory_bandwidth=4.8e12,
        peak_flops={"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "int8": 1979e12, "fp32": 67e12},
        memory_capacity=141e9, source="datasheet",
        citation="NVIDIA H200 Tensor Core GPU datasheet, SXM: 141 GB HBM3e at 4.8 TB/s; dense BF16 989 "
                 "TFLOP/s, FP8 1,979 TFLOP/s (sparsity figures halved)"),
    "a100-80gb": HardwareSpec(
        name="a100-80gb", memory_bandwidth=2.039e12,
        peak_flops={"bf16": 312e12, "fp16": 312e12, "int8": 624e12, "fp32": 19.5e12},
        memory_capacity=80e9, source="datasheet",
        citation="NVIDIA A100 Tensor Core GPU datasheet, 80GB SXM: HBM2e at 2,039 GB/s; dense BF16 312 "
                 "TFLOP/s, INT8 624 TOPS"),
    "worksheet": HardwareSpec(
        name="worksheet", memory_bandwidth=3.0e12, peak_flops={"bf16": 1000e12, "fp16": 1000e12},
        memory_capacity=None, source="hypothetical",
        citation="hypothetical round-number device of the published bound-model worksheet: 3.0 TB/s, "
                 "1,000 TFLOP/s"),
}


def load_hardware(name_or_path: str | Path) -> HardwareSpec:
    """A preset by name (``h100-sxm``, ``h200``, ``a100-80gb``, ``worksheet``) or a probe JSON file.

    Raises:
        ValueError: neither a preset nor a readable hardware JSON (names the value and the presets).
    """
    key = str(name_or_path)
    if key in HARDWARE_PRESETS:
        return HARDWARE_PRESETS[key]
    path = Path(key)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read hardware JSON {key!r}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"hardware JSON {key!r} must hold an object, got {type(data).__name__}")
        return HardwareSpec.from_dict(data)
    raise ValueError(f"unknown hardware {key!r}; known presets: {', '.join(HARDWARE_PRESETS)}, "
                     "or the path of a JSON file written by `roofline probe`")


# --------------------------------------------------------------------------------------------------
# Probe
# --------------------------------------------------------------------------------------------------

DEFAULT_SIZE_BYTES = {"cpu": 256 * 2**20, "cuda": 4 * 2**30}  # 8x a 32 MiB L3; ~80x an H200 50 MB L2 (1 GiB read 3.7 TB/s, 4 GiB 4.0-4.2)
DEFAULT_GEMM_N = {"cpu": 512, "cuda": 8192}


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use 'cpu' or 'auto'")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    return device


def _time_rounds(fn: Callable[[], Any], device: str, rounds: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn`` for each of ``rounds`` rounds, after ``warmup`` untimed calls.

    CUDA: ``torch.cuda.Event`` pairs around each call; CPU: ``time.perf_counter``.
    """
    import time

    import torch

    for _ in range(warmup):
        fn()
    times: list[float] = []
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def _check_probe_args(rounds: int, size_bytes: int | None) -> None:
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    if size_bytes is not None and size_bytes < 4096:
        raise ValueError(f"size_bytes must be >= 4096, got {size_bytes!r}")


def _read_and_copy(device: str, size_bytes: int, rounds: int, copy: bool) -> dict[str, Any]:
    import torch

    numel = size_bytes // 4
    x = torch.ones(numel, dtype=torch.float32, device=device)  # touched, so pages are resident
    read = _time_rounds(lambda: x.sum(), device, rounds)
    out: dict[str, Any] = {"buffer_bytes": numel * 4, "read_round_s": read,
                           "read_bytes_per_s": numel * 4 / statistics.median(read)}
    if copy:
        y = torch.empty_like(x)
        cp = _time_rounds(lambda: y.copy_(x), device, rounds)
        # Copy moves each byte twice (read + write), the convention of STREAM and nvbandwidth.
        out.update(copy_round_s=cp, copy_bytes_per_s=2 * numel * 4 / statistics.median(cp))
    return out


def measure_read_bandwidth(device: str = "auto", size_bytes: int | None = None, rounds: int = 5) -> float:
    """Median read bandwidth (bytes/s) of a reduction over a buffer well beyond the last-level cache.

    Fast enough to call in-process at the end of a run (about 0.5 s on a CPU with the default 256 MiB;
    4 GiB on CUDA). One warm-up round, then ``rounds`` timed rounds.
    """
    _check_probe_args(rounds, size_bytes)
    dev = _resolve_device(device)
    size = size_bytes or DEFAULT_SIZE_BYTES["cuda" if dev.startswith("cuda") else "cpu"]
    return float(_read_and_copy(dev, size, rounds, copy=False)["read_bytes_per_s"])


def _gemm_rates(device: str, n: int, rounds: int) -> tuple[dict[str, float], dict[str, Any]]:
    """Dense n x n x n GEMM rates (FLOP/s) per dtype; unsupported dtypes are recorded with the reason."""
    import torch

    flops = 2 * n**3
    rates: dict[str, float] = {}
    notes: dict[str, Any] = {}

    def record(key: str, make: Callable[[], Callable[[], Any]]) -> None:
        try:
            fn = make()
            ts = _time_rounds(fn, device, rounds)
            rates[key] = flops / statistics.median(ts)
            notes[key] = {"round_s": ts}
        except Exception as e:  # noqa: BLE001 - "where supported": record why not and go on
            notes[key] = {"unsupported": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}

    def float_mm(dtype: torch.dtype) -> Callable[[], Any]:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        return lambda: torch.matmul(a, b)

    def fp8_mm() -> Callable[[], Any]:
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt needs
        one = torch.tensor(1.0, device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    def int8_mm() -> Callable[[], Any]:
        a = torch.randint(-128, 127, (n, n), dtype=torch.int8, device=device)
        b = torch.randint(-128, 127, (n, n), dtype=torch.int8, device=device)
        return lambda: torch._int_mm(a, b)

    record("bf16", lambda: float_mm(torch.bfloat16))
    record("fp16", lambda: float_mm(torch.float16))
    record("fp32", lambda: float_mm(torch.float32))
    record("fp8", fp8_mm)
    record("int8", int8_mm)
    return rates, notes


def measure_gemm_flops(device: str = "auto", dtype: str = "auto", n: int | None = None, rounds: int = 5) -> float:
    """Median dense GEMM rate (FLOP/s) of an ``n x n x n`` product on random operands, in this process.

    ``dtype``: ``bf16``/``fp16``/``fp32``/``int8`` (``torch._int_mm``, OP/s), the engine's name for one
    (``bfloat16``, ``torch.float32``), or ``auto`` (bf16 on CUDA, fp32 on CPU). ``n`` defaults to 8192 on
    CUDA and 512 on CPU. FLOPs = 2 n^3.

    Raises:
        ValueError: an unknown dtype or device, rounds < 1.
    """
    import torch

    _check_probe_args(rounds, None)
    dev = _resolve_device(device)
    cuda = dev.startswith("cuda")
    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int8": torch.int8}
    key = ("bf16" if cuda else "fp32") if dtype == "auto" else canonical_dtype(dtype)
    if key not in names:
        raise ValueError(f"dtype must be one of auto, {', '.join(names)}; got {dtype!r}")
    size = n or DEFAULT_GEMM_N["cuda" if cuda else "cpu"]
    if key == "int8":  # int8 x int8 -> int32 (torch._int_mm: the W8A8 formats' GEMM), OP/s
        a = torch.randint(-127, 128, (size, size), device=dev, dtype=torch.int8)
        b = torch.randint(-127, 128, (size, size), device=dev, dtype=torch.int8)
        ts = _time_rounds(lambda: torch._int_mm(a, b), dev, rounds)
        return 2 * size**3 / statistics.median(ts)
    a = torch.randn(size, size, device=dev).to(names[key])
    b = torch.randn(size, size, device=dev).to(names[key])
    ts = _time_rounds(lambda: torch.matmul(a, b), dev, rounds)
    return 2 * size**3 / statistics.median(ts)


def _versions(device: str) -> dict[str, Any]:
    import torch

    v: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                         "cuda_runtime": torch.version.cuda, "driver": None, "triton": None}
    try:
        import triton

        v["triton"] = triton.__version__
    except Exception:  # noqa: BLE001 - triton is optional
        pass
    if device.startswith("cuda"):
        try:
            import subprocess

            v["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10, check=True).stdout.strip().splitlines()[0]
        except Exception:  # noqa: BLE001 - no nvidia-smi: leave the driver unknown
            pass
    return v


def _cgroup_memory_room() -> int | None:
    """Bytes this process's memory cgroup still allows (limit - usage), or None without a limit: cgroup v2
    (``memory.max`` / ``memory.current``) or v1 (``memory/memory.limit_in_bytes`` / ``memory.usage_in_bytes``),
    in the group /proc/self/cgroup names, then at the mount's root (a container sees its own group there)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    groups = {controllers: path.lstrip("/") for _, controllers, path in (ln.split(":", 2) for ln in lines)}
    root = Path("/sys/fs/cgroup")
    candidates = []  # (directory, limit file, usage file), the process's own group first
    for mount, controller, limit, usage in ((root, "", "memory.max", "memory.current"),
                                            (root / "memory", "memory", "memory.limit_in_bytes",
                                             "memory.usage_in_bytes")):
        own = [mount / groups[controller]] if groups.get(controller) else []
        candidates += [(d, limit, usage) for d in own + [mount]]
    for d, limit_name, usage_name in candidates:
        try:
            limit = (d / limit_name).read_text().strip()
        except OSError:
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as ~2^63
            return None
        try:
            return int(limit) - int((d / usage_name).read_text())
        except (OSError, ValueError):
            return None
    return None


def host_memory_available() -> int | None:
    """Bytes of host memory a new allocation can take now: Linux's ``MemAvailable`` (/proc/meminfo, free plus
    reclaimable page cache), capped by the memory cgroup's headroom (:func:`_cgroup_memory_room`, v2 or v1) when
    the process runs under a limit. None where neither can be read (not Linux)."""
    avail: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        room = _cgroup_memory_room()
    except ValueError:
        room = None
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail


def _device_name_and_capacity(device: str) -> tuple[str, float | None]:
    import torch

    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        return props.name, float(props.total_memory)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        capacity: float | None = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        capacity = None
    return f"{name} ({os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads)", capacity


def probe(device: str = "auto", rounds: int = 5, size_bytes: int | None = None,
          gemm_n: int | None = None) -> HardwareSpec:
    """Measure the present device: read and copy bandwidth, dense GEMM rate per dtype.

    - Bandwidth: a float32 reduction (read) and a copy (counted as 2 bytes moved per byte) over
      ``size_bytes`` (default 256 MiB on CPU, 4 GiB on CUDA: many times the last-level cache).
    - GEMM: ``n x n x n`` matmuls in bf16, fp16 and fp32; fp8 e4m3 via ``torch._scaled_mm`` and int8
      via ``torch._int_mm`` where this build and device support them (otherwise the reason is recorded).
    - One warm-up, then ``rounds`` timed rounds; medians reported. CUDA timing uses ``torch.cuda.Event``.

    Returns a ``source="measured"`` :class:`HardwareSpec` whose ``memory_bandwidth`` is the median read
    bandwidth and whose ``details`` hold every round, the device name, versions and the UTC date.
    """
    _check_probe_args(rounds, size_bytes)
    if gemm_n is not None and gemm_n < 16:
        raise ValueError(f"gemm_n must be >= 16, got {gemm_n!r}")
    dev = _resolve_device(device)
    kind = "cuda" if dev.startswith("cuda") else "cpu"
    size = size_bytes or DEFAULT_SIZE_BYTES[kind]
    n = gemm_n or DEFAULT_GEMM_N[kind]
    name, capacity = _device_name_and_capacity(dev)
    bw = _read_and_copy(dev, size, rounds, copy=True)
    rates, gemm_notes = _gemm_rates(dev, n, rounds)
    date = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    details = {"device": dev, "device_name": name, "date": date, "rounds": rounds, "warmup_rounds": 1,
               "statistic": "median", "gemm_n": n, "gemm": gemm_notes, **bw, "versions": _versions(dev)}
    return HardwareSpec(name=f"measured: {name}", memory_bandwidth=bw["read_bytes_per_s"], peak_flops=rates,
                        memory_capacity=capacity, source="measured",
                        citation=f"roofline probe on {name}, {date}", details=details)
