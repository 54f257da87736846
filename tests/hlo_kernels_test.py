"""aot/hlo.py on hand-written HLO: kernels walked through command buffers and loops,
classified by kind, and given the phase of the step's named scopes (forward / backward)."""
from micse_jax.aot import hlo, hlo_module

HLO = """HloModule jit_train_step

%fused_dot (p0: bf16[8,8], p1: bf16[8,8]) -> bf16[8,8] {
  %p0 = bf16[8,8] parameter(0)
  %p1 = bf16[8,8] parameter(1)
  ROOT %dot.1 = bf16[8,8] dot(%p0, %p1), metadata={op_name="jit(s)/transpose(jvp(encode))/dot_general"}
}

%fused_add (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %add.3 = f32[8]{0} add(%p0, %p0), metadata={op_name="jit(s)/optimizer/add"}
}

%fused_sort (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %sort.2 = f32[8]{0} sort(%p0), dimensions={0}, to_apply=%cmp
}

%command_buffer (a: bf16[8,8], b: f32[8]) -> (bf16[8,8], f32[8]) {
  %a = bf16[8,8] parameter(0)
  %b = f32[8]{0} parameter(1)
  %gemm_fusion_dot.1 = bf16[8,8] fusion(%a, %a), kind=kCustom, calls=%fused_dot, backend_config={"kind":"__triton_gemm"}
  %loop_add_fusion = f32[8]{0} fusion(%b), kind=kLoop, calls=%fused_add
  ROOT %t = (bf16[8,8], f32[8]{0}) tuple(%gemm_fusion_dot.1, %loop_add_fusion)
}

%body (s: f32[8]) -> f32[8] {
  %s = f32[8]{0} parameter(0)
  ROOT %fusion.9 = f32[8]{0} fusion(%s), kind=kCustom, calls=%fused_sort, metadata={op_name="jit(s)/jvp(loss/ami)/top_k"}
}

ENTRY %main (x: bf16[8,8], y: f32[8]) -> f32[8] {
  %x = bf16[8,8] parameter(0)
  %y = f32[8]{0} parameter(1)
  %call = (bf16[8,8], f32[8]{0}) call(%x, %y), to_apply=%command_buffer
  %gte = f32[8]{0} get-tuple-element(%call), index=1
  %cublas-gemm.1 = bf16[8,8] custom-call(%x, %x), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(s)/momentum_forward/dot"}
  %attn = bf16[8,8] custom-call(%x, %x, %x), custom_call_target="__cudnn$fmhaSoftmax", metadata={op_name="jit(e)/attention"}
  %all-reduce-start = f32[8]{0} all-reduce-start(%gte), to_apply=%sum, metadata={op_name="jit(s)/optimizer/add"}
  %all-reduce-done = f32[8]{0} all-reduce-done(%all-reduce-start)
  %copy.1 = f32[8]{0} copy(%all-reduce-done)
  ROOT %while = f32[8]{0} while(%copy.1), condition=%cond, body=%body
}
"""


def test_kernels_by_kind_and_phase():
  found = {k.name: (k.kind, k.phase) for k in hlo.kernels(hlo_module.parse(HLO))}
  assert found == {
      "gemm_fusion_dot.1": ("GEMM (Triton fusion)", "encode (backward)"),   # phase from the fused dot
      "loop_add_fusion": ("loop fusion", "optimizer"),
      "cublas-gemm.1": ("GEMM (cuBLAS)", "momentum_forward"),
      "attn": ("attention (cuDNN)", hlo.NO_PHASE),
      "all-reduce-start": ("collective (all-reduce)", "optimizer"),              # the -done half is no kernel
      "copy.1": ("copy", hlo.NO_PHASE),
      "fusion.9": ("sort", "loss/ami (forward)"),                          # inside the while body
  }
  s = hlo.summary(hlo_module.parse(HLO))
  assert s["kernels_per_step"] == 7 and s["update_kernels_per_step"] == 2  # optimizer + ema
  assert s["by_kind"]["GEMM (cuBLAS)"] == 1 and s["by_phase"][hlo.NO_PHASE] == 2


def test_phase_names_with_slashes_and_nesting():
  assert hlo.phase_of("jit(step)/jvp(loss/contrastive)/log") == "loss/contrastive (forward)"
  assert hlo.phase_of("jit(step)/transpose(jvp(loss/mlm))/dot") == "loss/mlm (backward)"
  assert hlo.phase_of("jit(step)/jvp(encode)/encoder/layer_0") == "encode (forward)"
  assert hlo.phase_of("jit(step)/encoder/layer_0") is None  # `encoder` is not `encode`
  assert hlo.phase_of("jit(step)/finite/reduce_and") == "finite"
  assert hlo.phase_of(None) is None
