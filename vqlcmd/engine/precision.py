"""The training precision: DeepSpeed's ``bf16.enabled`` as true, false or ``"auto"``.

``"auto"`` trains in bf16 where the hardware multiplies bf16 natively and in fp32 elsewhere:
CUDA devices that support bf16 (Ampere and newer), and CPUs with AVX512-BF16 or AMX-BF16
instructions, on which oneDNN's bf16 GEMMs have a native path. On the 2-core AVX512-BF16
development CPU the digits training step took 243 ms in bf16 against 362 ms in fp32
(docs/archive/quickstart.md). A CPU without those instructions has no such path, so "auto" keeps fp32
there rather than guess. DeepSpeed itself only takes a bool, so the engine resolves the value
before it builds the DeepSpeed engine and records the resolved one in the run's config.
"""
from __future__ import annotations

import torch


def cpu_has_native_bf16() -> bool:
    caps = torch.cpu.get_capabilities() if hasattr(torch.cpu, "get_capabilities") else {}
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def resolve_bf16(value, device: torch.device) -> tuple[bool, str]:
    """(train in bf16?, why) for a ``bf16.enabled`` setting on ``device``."""
    if value != "auto":
        return bool(value), "set in the config"
    if device.type == "cuda":
        # native only (Ampere and later), of this device: torch.cuda.is_bf16_supported() asks the current GPU
        # and by default also counts the emulated bf16 of a V100 or T4
        ok = torch.cuda.get_device_capability(device)[0] >= 8
        return ok, f"auto: {torch.cuda.get_device_name(device)} {'supports' if ok else 'lacks'} bf16"
    if device.type == "cpu":
        ok = cpu_has_native_bf16()
        return ok, f"auto: this CPU {'has' if ok else 'lacks'} AVX512-BF16/AMX-BF16"
    return False, f"auto: no bf16 rule for device {device.type}"
