"""Attention backends over the paged KV cache (registered as plugins)."""

if __name__ == "kernels":
    # Python started from the checkout's root sees this folder as a top-level `kernels` package, the name
    # of the hub-kernels library that transformers probes for on import. Look like an empty namespace
    # package to that probe (no __file__, no version) so transformers does not take it for the library.
    __file__ = None
else:
    from jitney.core.hooks import hookimpl
    from jitney.kernels.base import AttentionBackend, StepAttention, StepInputs
    from jitney.kernels.torch_paged import TorchPagedAttention

    __all__ = ["AttentionBackend", "StepAttention", "StepInputs", "TorchPagedAttention"]

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
