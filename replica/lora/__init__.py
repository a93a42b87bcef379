"""LoRA adapters served beside the base model (docs/engine.md, "LoRA adapters").

``request`` (LoRARequest, what a caller names an adapter with), ``adapter`` (a PEFT
adapter directory read and checked against the model), ``slots`` (the adapters resident
in the model's projections for a step, applied with the segmented LoRA matmul of
``kernels/reference_lora.py`` or ``kernels/triton/lora.py``), ``manager`` (which adapters
are loaded and which hold a slot). Imports torch; knows nothing of schedulers.
"""
