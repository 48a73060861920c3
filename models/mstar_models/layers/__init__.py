"""The layer library the models are built on, one small module per concept, so that a model file is its wiring.

  norm       RMSNorm (Llama's float32 normalise then gain; Gemma's 1 + w; QK-norm over head_dim;
             π0.5's adaptive norm on a condition, with its residual gate)
  linear     a checkpoint weight, several fused into one GEMM (q/k/v, gate/up) under their
             own names (one or more groups a module), stacked tables, the row-parallel linear
  rotary     RoPE frequencies (default, llama3), cos/sin tables (1-D, Qwen3-Omni's M-RoPE),
             the rotate-half and interleaved rotations
  attention  GQA attention over the runtime's paged KV (fused q/k/v, QK-norm, row-parallel o_proj;
             one set of projections per expert for BAGEL's Mixture-of-Transformers)
  mlp        the gated MLP (SwiGLU or GeGLU; gate and up fused, row-parallel down) and the GELU MLP of ViTs
  moe        the sparse MoE block (top-k router, grouped-GEMM experts, a gated shared expert)
  embedding  vocab-parallel token embedding and LM head
  decoder    the pre-norm decoder stack (Llama, Qwen3, Qwen3-Omni's thinker / talker / code predictor, Gemma)
  init       seeded weights for the `init` source, equal at every tensor-parallel degree

Parameter names are always the checkpoint's, so `mstar_runtime.weights` loads a Hugging Face
folder unchanged. Tensor parallelism builds on `mstar_runtime.ops.tp` (groups, collectives,
`MegatronLayout`): a layer built with this rank's sizes and the node's TP group does its own
all-reduce, and every collective is a no-op at tp 1.
"""
