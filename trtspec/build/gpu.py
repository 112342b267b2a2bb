"""GPU discovery (NVML, else torch.cuda) and the profiles table used to plan for a GPU that is
not in this machine (``--gpu H200``).

Numbers are the dense figures from NVIDIA's data sheets (SXM parts where there are two).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuProfile:
    name: str
    compute_capability: str  # "9.0"
    memory_gib: float
    bandwidth_gbps: float  # HBM/GDDR GB/s
    bf16_tflops: float  # dense
    fp8: bool
    source: str

    @property
    def sm(self) -> int:
        major, minor = self.compute_capability.split(".")
        return int(major) * 10 + int(minor)

    @property
    def slug(self) -> str:
        return self.name.lower()


PROFILES: dict[str, GpuProfile] = {p.name: p for p in [
    GpuProfile("A100-80GB", "8.0", 80, 2039, 312, False,
               "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
               "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    GpuProfile("A100-40GB", "8.0", 40, 1555, 312, False,
               "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
               "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    GpuProfile("L4", "8.9", 24, 300, 121, True,
               "https://www.nvidia.com/en-us/data-center/l4/"),
    GpuProfile("L40S", "8.9", 48, 864, 362, True,
               "https://www.nvidia.com/en-us/data-center/l40s/"),
    GpuProfile("H100", "9.0", 80, 3350, 989, True,
               "https://www.nvidia.com/en-us/data-center/h100/"),
    GpuProfile("H200", "9.0", 141, 4800, 989, True,
               "https://www.nvidia.com/en-us/data-center/h200/"),
    GpuProfile("B200", "10.0", 180, 8000, 2250, True,
               "https://www.nvidia.com/en-us/data-center/dgx-b200/"),
]}

_ALIASES = {"A100": "A100-80GB", "H100-SXM": "H100", "H100-80GB": "H100", "H200-SXM": "H200"}


def profile(name: str) -> GpuProfile:
    """A profile by name (case-insensitive, common aliases); one-line error for unknown GPUs."""
    wanted = name.strip().upper()
    for key in PROFILES:
        if key.upper() == wanted:
            return PROFILES[key]
    for alias, key in _ALIASES.items():
        if alias.upper() == wanted:
            return PROFILES[key]
    raise ValueError(f"unknown GPU '{name}': use one of {', '.join(PROFILES)}")


@dataclass(frozen=True)
class DetectedGpu:
    index: int
    name: str  # as the driver reports it, e.g. "NVIDIA H200"
    compute_capability: str
    memory_gib: float
    driver: str

    def profile(self) -> GpuProfile | None:
        """The matching profile: by name (longest first, so L40S before L4), sized parts by
        memory (A100 40 vs 80 GB)."""
        upper = self.name.upper()
        for key in sorted(PROFILES, key=len, reverse=True):
            base, _, size = key.partition("-")
            if base in upper and (not size or abs(self.memory_gib - PROFILES[key].memory_gib) < 8):
                return PROFILES[key]
        return None


def detect() -> list[DetectedGpu]:
    """NVIDIA GPUs on this machine: NVML when nvidia-ml-py is installed, else torch.cuda."""
    try:
        import pynvml
    except ImportError:
        return _detect_torch()
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver: NVML raises its own error types
        return []
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            memory = pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30
            gpus.append(DetectedGpu(i, _text(pynvml.nvmlDeviceGetName(h)), f"{major}.{minor}",
                                    memory, driver))
        return gpus
    finally:
        pynvml.nvmlShutdown()


def _detect_torch() -> list[DetectedGpu]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(DetectedGpu(i, p.name, f"{p.major}.{p.minor}", p.total_memory / 2**30,
                               torch.version.cuda or "unknown"))
    return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def d0(num_attention_heads: int, num_key_value_heads: int) -> tuple[int, str]:
    """NVIDIA's starting point for D: 128/G − 1 with G = query heads per KV head.

    From an attention-kernel tile of 128 rows: one verification step scores (D+1)·G query rows
    per KV head, so D+1 = 128/G fills one tile. A starting point for that kernel family, not a
    rule. Clamped to 1..63 (TensorRT-LLM's largest EAGLE tree). Returns (D₀, derivation).
    """
    if num_attention_heads % num_key_value_heads:
        raise ValueError(f"{num_attention_heads} attention heads are not a multiple of "
                         f"{num_key_value_heads} KV heads")
    g = num_attention_heads // num_key_value_heads
    raw = 128 // g - 1
    value = max(1, min(63, raw))
    text = (f"G = num_attention_heads / num_key_value_heads = {num_attention_heads} / "
            f"{num_key_value_heads} = {g}; D₀ = 128/G − 1 = {128 // g} − 1 = {raw}")
    if value != raw:
        text += f", clamped to {value}"
    return value, text


def sweep_around(d0_value: int) -> list[int]:
    """Draft lengths to sweep when a recipe says ``auto``: small D's plus D₀/4, D₀/2, D₀."""
    return sorted({2, 4, max(1, d0_value // 4), max(1, d0_value // 2), d0_value})
