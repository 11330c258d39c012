"""Which models each framework's export runs, whatever the layout (`model_refusal`): the models
torchtitan ships, what Megatron-LM's and Megatron-DeepSpeed's blocks cannot express, and
Megatron-DeepSpeed's DeepSpeed-MoE."""

from __future__ import annotations

from shardwise.arch import ModelSpec
from shardwise.layout import TrainSpec

FRAMEWORKS = ("megatron", "torchtitan", "deepspeed")
VERSIONS = {"megatron": "Megatron-LM main d98e8a6", "torchtitan": "torchtitan 0.3.0",
            "deepspeed": "DeepSpeed 0.19.8 with Megatron-DeepSpeed 4efb479"}

# torchtitan ships these models as `--module llama3 --config <name>` (models/llama3/
# config_registry.py); each has the preset's shape.
_TITAN_CONFIGS = {"llama3-8b": ("llama3", "llama3_8b"), "llama3-70b": ("llama3", "llama3_70b"),
                  "llama3-405b": ("llama3", "llama3_405b")}


def titan_model_refusal(model: ModelSpec, train: TrainSpec) -> str | None:
    """What no layout fixes: torchtitan 0.3.0 ships no such model, or trains it otherwise."""
    if model.name not in _TITAN_CONFIGS:
        return (f"torchtitan 0.3.0 ships no {model.name} model (its llama3 configs fit "
                f"{', '.join(_TITAN_CONFIGS)}); plan with --impl megatron-te for Megatron-LM")
    if model.name == "llama3-405b" and train.fp8 != "rowwise":
        return ("torchtitan 0.3.0's llama3_405b config trains its linear layers in Float8 "
                "(rowwise) under torch.compile (models/llama3/config_registry.py): plan it "
                "with --fp8 rowwise --compile, or with --impl megatron-te for Megatron-LM")
    return None


def moe_refusal(model: ModelSpec) -> str | None:
    """What Megatron-DeepSpeed's MoE (DeepSpeed-MoE) cannot train of `model` as planned."""
    return ("Megatron-DeepSpeed's MoE is DeepSpeed-MoE (capacity-factor token dropping and "
            "experts replicated over tensor-parallel ranks by default, megatron/arguments.py:"
            "910-919 @4efb479), which the megatron-deepspeed stack does not model; plan "
            "with --impl megatron-te for Megatron-LM")


def model_refusal(framework: str, model: ModelSpec, train: TrainSpec) -> str | None:
    """What no layout fixes: the framework does not run this model as planned (the stack's
    dtypes are checked by `TrainSpec.validate`)."""
    if framework == "torchtitan":
        return titan_model_refusal(model, train)
    if framework in ("megatron", "deepspeed"):
        name = VERSIONS[framework]
        if model.alibi:
            return (f"{model.name} adds ALiBi attention biases, which {name} has no option for "
                    "(its positions are learned or rotary): an export would train another model")
        if model.parallel_residual:
            return (f"{model.name} runs attention and MLP side by side on one normalised input "
                    f"(GPT-NeoX's use_parallel_residual), which {name}'s block does not: an "
                    "export would train another model")
    if framework == "deepspeed" and model.is_moe:
        return moe_refusal(model)
    return None
