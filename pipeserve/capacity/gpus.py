"""Datasheet figures of the GPUs the roofline knows, and overrides for a measured machine.

Compute rates are dense (no 2:4 sparsity) tensor-core peaks; datasheets print the sparse figure
first, which is exactly twice these. Memory sizes are the datasheets' "GB", which for these parts
are GiB (an A100-80G shows 81920 MiB in nvidia-smi, an H200 143771 MiB).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

TB = 1e12
GIB = 1024**3


@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth: float  # bytes/s, peak DRAM bandwidth
    bf16_flops: float  # FLOP/s, dense bf16/fp16 tensor cores with fp32 accumulate
    int8_ops: float | None  # op/s, dense int8 tensor cores (None: no int8 tensor cores)
    fp8_flops: float | None  # FLOP/s, dense fp8 tensor cores (None: no fp8; fp8 weights run at bf16)
    memory: float  # bytes of device memory

    @staticmethod
    def get(name: str) -> GPU:
        """A datasheet entry by name; case, spaces, '-' and '_' are ignored ("h100 sxm", "RTX-4090")."""
        key = _key(name)
        for gpu in GPUS.values():
            if _key(gpu.name) == key:
                return gpu
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")

    def with_overrides(
        self, bandwidth: float | None = None, flops: float | None = None, memory: float | None = None
    ) -> GPU:
        """A measured machine: `flops` replaces the bf16 rate and scales int8/fp8 by the same ratio
        (a measured bf16 matmul rate says how far below the datasheet this part runs)."""
        gpu = self
        if flops is not None:
            ratio = flops / self.bf16_flops
            gpu = replace(
                gpu,
                bf16_flops=flops,
                int8_ops=None if self.int8_ops is None else self.int8_ops * ratio,
                fp8_flops=None if self.fp8_flops is None else self.fp8_flops * ratio,
            )
        if bandwidth is not None:
            gpu = replace(gpu, bandwidth=bandwidth)
        if memory is not None:
            gpu = replace(gpu, memory=memory)
        if gpu != self:
            gpu = replace(gpu, name=f"{self.name} (overridden)")
        return gpu

    def gemm_rate(self, compute: str) -> float:
        """Tensor-core rate for GEMMs of a weight format; a part without that format falls back
        to bf16 (weights dequantized in the kernel)."""
        rate = {"bf16": self.bf16_flops, "int8": self.int8_ops, "fp8": self.fp8_flops}[compute]
        return self.bf16_flops if rate is None else rate


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum())


GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in (
        # NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): SXM, 40GB HBM2
        # 1,555 GB/s, 80GB HBM2e 2,039 GB/s; BF16 312 TFLOPS, INT8 624 TOPS dense; no FP8.
        GPU("A100-40G", 1555e9, 312 * TB, 624 * TB, None, 40 * GIB),
        GPU("A100-80G", 2039e9, 312 * TB, 624 * TB, None, 80 * GIB),
        # NVIDIA H100 Tensor Core GPU datasheet: SXM 3.35 TB/s, PCIe 2 TB/s, 80GB;
        # SXM BF16 989 / FP8 1,979 / INT8 1,979 dense; PCIe BF16 756 / FP8 1,513 / INT8 1,513.
        GPU("H100-SXM", 3.35 * TB, 989 * TB, 1979 * TB, 1979 * TB, 80 * GIB),
        GPU("H100-PCIe", 2.0 * TB, 756 * TB, 1513 * TB, 1513 * TB, 80 * GIB),
        # NVIDIA H200 product page / datasheet (SXM): 141GB HBM3e at 4.8 TB/s, Hopper compute as H100 SXM.
        GPU("H200", 4.8 * TB, 989 * TB, 1979 * TB, 1979 * TB, 141 * GIB),
        # NVIDIA HGX H20 product brief (2023, China export part): 96GB HBM3 at 4.0 TB/s;
        # BF16 148 TFLOPS, FP8 296 TFLOPS, INT8 296 TOPS dense.
        GPU("H20", 4.0 * TB, 148 * TB, 296 * TB, 296 * TB, 96 * GIB),
        # NVIDIA L40S datasheet: 48GB GDDR6 at 864 GB/s; BF16 362.05, FP8 733, INT8 733 dense.
        GPU("L40S", 864e9, 362.05 * TB, 733 * TB, 733 * TB, 48 * GIB),
        # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: 24GB GDDR6X at 1,008 GB/s;
        # FP16/BF16 with FP32 accumulate 165.2, FP8 with FP32 accumulate 330.3, INT8 660.6 dense.
        GPU("RTX4090", 1008e9, 165.2 * TB, 660.6 * TB, 330.3 * TB, 24 * GIB),
        # NVIDIA A10 datasheet: 24GB GDDR6 at 600 GB/s; BF16 125 TFLOPS, INT8 250 TOPS dense; no FP8.
        GPU("A10", 600e9, 125 * TB, 250 * TB, None, 24 * GIB),
    )
}
