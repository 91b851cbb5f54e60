"""The built-in attention backends, registered through the same entry point a third-party package uses."""

from jitney.core.hooks import hookimpl
from jitney.kernels.torch_paged import TorchPagedAttention


def _triton(device):
    # Imported on first use: Triton reads TRITON_INTERPRET when its kernels are defined.
    from jitney.kernels.triton_paged import TritonPagedAttention

    return TritonPagedAttention()


def _cpu(device):
    from jitney.kernels.cpu_paged import CpuPagedAttention

    return CpuPagedAttention()


@hookimpl
def jitney_register_attention_backends(register):
    register("torch", lambda device: TorchPagedAttention())
    register("triton", _triton)
    register("cpu", _cpu)
