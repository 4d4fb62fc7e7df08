"""GPU kernels of omni_rt (imported as `omni_rt.kernels`), each beside the plain-PyTorch function it equals.

- `moe_decode`: fused MoE expert computation for decode (Triton), plus the loop and grouped-GEMM paths
  and `install(model, backend)` to swap a model's expert function from outside.
"""
