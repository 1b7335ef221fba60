"""What a kernel variant needs of the machine, and the error where a variant named explicitly cannot run."""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Needs:
    """A variant tied to a backend: which, whether Pallas interpret mode runs it anywhere (tests),
    and the hardware named in messages."""

    backend: str
    interpretable: bool
    hardware: str

    def check(self, name: str, interpret: bool) -> None:
        backend = jax.default_backend()
        if backend != self.backend and not (interpret and self.interpretable):
            hint = "; Kernels(interpret=True) runs it on any backend, slowly (tests)" if self.interpretable else ""
            raise ValueError(f"the {name!r} kernel runs on {self.hardware} only, and this JAX's backend is {backend!r}; "
                             f"'auto' picks what this backend runs{hint}")


GPU = Needs("gpu", False, "NVIDIA GPUs")
TRITON = Needs("gpu", True, "NVIDIA GPUs")  # Pallas Triton: interpret mode runs it anywhere
HOPPER = Needs("gpu", True, "NVIDIA Hopper GPUs")  # Pallas Mosaic GPU
HOPPER_NATIVE = Needs("gpu", False, "NVIDIA Hopper GPUs")
TPU = Needs("tpu", True, "TPUs")


def is_hopper() -> bool:
    """Whether the first device is an NVIDIA Hopper GPU (compute capability 9.0)."""
    devices = jax.devices()
    return devices[0].platform == "gpu" and getattr(devices[0], "compute_capability", "") == "9.0"
