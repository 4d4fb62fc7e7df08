"""GPU kernels of omni_rt (imported as `omni_rt.kernels`), each beside the plain-PyTorch function it equals.

- `moe_decode`: fused MoE expert computation for decode (Triton), plus the loop and grouped-GEMM paths
  and `install(model, backend)` to swap a model's expert function from outside.
- `moe_prefill`: MoE for prefill-sized calls (16-512 rows, Triton): sort by expert on the device, then
  grouped GEMMs that read each selected expert once (1.04x its bytes floor at Thinker shapes on an H200).
- `packed`: one GEMM for q/k/v and for a dense MLP's gate/up, weights packed in place (plain PyTorch).
- `norm_rope`, `router`, `snake`, `decode_attention`: fused decode kernels (Triton) for RMSNorm, q/k norm +
  RoPE + KV-cache write, the MoE router, Code2Wav's SnakeBeta and attention over the slot cache, each
  beside the model code it equals; `code2wav_step`: Code2Wav's streaming step in fewer launches; `fused.install_all(model)` patches a model with all of them from
  outside (`fused.uninstall_all` undoes it). Shared: `_common` (no Triton), `_triton` (rounding, math).
"""
