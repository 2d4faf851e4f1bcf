"""Which linear layers LoRA adapts: ``model.target_modules`` read into PEFT's module names (no JAX here:
the config check reads it).

    resolve_targets("all-linear")          # ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    resolve_targets(["q_proj", "v_proj"])  # ("q_proj", "v_proj")
    resolve_targets("self_attn")           # a regular expression: the attention's four
    resolve_parameters(["mlp.experts.gate_up_proj", "down_proj"])   # a Qwen3-MoE's experts (PEFT's target_parameters)
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pacs_jax.models.config import LORA_EXPERT_PARAMETERS, LORA_MODULES

ALL_LINEAR = "all-linear"

# a dense decoder layer's MLP (a mixture-of-experts layer has none: its experts are parameters, transformers')
DENSE_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# PEFT's module name -> its parent in a Qwen decoder layer (model.layers.{i}.<parent>.<name>)
PEFT_PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def resolve_targets(target_modules: str | Sequence[str]) -> tuple[str, ...]:
    """The module names (PEFT's, in LORA_MODULES order) that ``target_modules`` asks for: "all-linear"
    (every linear layer of the decoder, not the LM head, as PEFT's), a list of names, or a regular
    expression searched in each module's PEFT path without its layer ("self_attn.q_proj", "mlp.up_proj";
    Tunix's ``module_path``). ValueError listing the module names there are when it names none or an
    unknown one."""
    known = ", ".join(f"{PEFT_PARENTS[m]}.{m}" for m in LORA_MODULES)
    if isinstance(target_modules, str):
        if target_modules == ALL_LINEAR:
            return LORA_MODULES
        if target_modules in LORA_MODULES:
            return (target_modules,)
        try:
            pattern = re.compile(target_modules)
        except re.error as e:
            raise ValueError(f"{target_modules!r} is neither {ALL_LINEAR!r}, a module name nor a regular expression "
                             f"({e}); the modules are {known}") from None
        found = tuple(m for m in LORA_MODULES if pattern.search(f"{PEFT_PARENTS[m]}.{m}"))
        if not found:
            raise ValueError(f"{target_modules!r} matches no module; the modules are {known}")
        return found
    names = tuple(target_modules)
    unknown = [m for m in names if m not in LORA_MODULES]
    if unknown or not names:
        what = f"names no module ({unknown[0]!r})" if unknown else "is empty"
        raise ValueError(f"the list {list(names)} {what}; the modules are {known} ({ALL_LINEAR!r}: all of them)")
    return tuple(m for m in LORA_MODULES if m in names)


def resolve_parameters(target_parameters: str | Sequence[str]) -> tuple[str, ...]:
    """The experts' parameters (LORA_EXPERT_PARAMETERS, in its order) that PEFT's ``target_parameters`` names: a
    list of names (or names with commas, as a command line gives them), each matched by PEFT's rule: a parameter's
    path in a decoder layer ("mlp.experts.gate_up_proj") equal to the name or ending with "." + the name
    ("experts.down_proj", "gate_up_proj"). () for none. ValueError naming the one that matches no parameter."""
    names = tuple(n for n in target_parameters.split(",") if n) if isinstance(target_parameters, str) \
        else tuple(target_parameters)
    found = set()
    for name in names:
        matched = {p for p in LORA_EXPERT_PARAMETERS if isinstance(name, str) and (p == name or p.endswith(f".{name}"))}
        if not matched:
            raise ValueError(f"{name!r} matches no parameter; the experts' are {', '.join(LORA_EXPERT_PARAMETERS)} "
                             "(PEFT's target_parameters of a Qwen3-MoE model: a name or the end of one)")
        found |= matched
    return tuple(p for p in LORA_EXPERT_PARAMETERS if p in found)
