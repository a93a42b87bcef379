"""LoRA adapters served beside the base model (docs/engine.md, "LoRA adapters").

``request`` (LoRARequest, what a caller names an adapter with), ``adapter`` (a PEFT
adapter directory read and checked against the model), ``sgmv`` (the segmented LoRA
matmul: one batch, rows of several adapters), ``slots`` (the adapters resident in the
model's projections for a step), ``manager`` (which adapters are loaded and which hold a
slot). Imports torch; knows nothing of schedulers.
"""
