"""Adam without torch.compile's machinery: the default optimizer of the MNIST task.

    python -c "from elastic_mnist import model, optim; print(optim.Adam(model.build_model().parameters()))"

torch.optim's base class wraps `add_param_group` (called by every constructor), `state_dict`,
`load_state_dict` and `zero_grad` in `torch._disable_dynamo`, whose first call imports `torch._dynamo`:
about a second on every worker start, on the path a resume after a kill has to be quick. This class does
torch.optim.Adam's default update (no weight decay, no amsgrad, not maximizing, not capturable, one
tensor at a time as torch does for CPU tensors) with the same operations in the same order, so CPU results
are bit-for-bit equal, and it reads and writes torch.optim.Adam's state_dict format, so checkpoints move
between the two either way. It is a torch.optim.Optimizer subclass, so torch's LR schedulers and
GradScaler accept it, and it overrides every method the base class wraps in `torch._disable_dynamo`
(`add_param_group`, which the base constructor calls, `state_dict`, `load_state_dict`, `zero_grad`):
none of them is ever reached, so nothing imports torch._dynamo (tests/test_optim.py checks it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

# Every group key torch.optim.Adam writes, with its defaults: a state_dict of ours is one of theirs.
# The options past "eps" are fixed here; a state_dict asking for another value is refused on load.
_FIXED_OPTIONS: dict[str, Any] = {
    "weight_decay": 0, "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
    "differentiable": False, "fused": None, "decoupled_weight_decay": False,
}
_IGNORED_OPTIONS = ("foreach",)  # how torch would batch the kernels, not what the update is
_STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


class Adam(torch.optim.Optimizer):
    """torch.optim.Adam(params, lr, betas, eps) with its defaults for every other option."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        if not lr >= 0.0 or not eps >= 0.0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Adam needs lr >= 0, eps >= 0 and 0 <= betas < 1; got lr={lr}, betas={betas}, "
                             f"eps={eps}")
        groups = list(params)
        if not groups:
            raise ValueError("Adam got an empty parameter list: pass model.parameters() of a model with parameters")
        # The base constructor sets the hooks torch's schedulers and profiler expect, then calls our
        # add_param_group for each group.
        super().__init__(groups, {"lr": lr, "betas": (float(betas[0]), float(betas[1])), "eps": eps,
                                  **_FIXED_OPTIONS})

    def add_param_group(self, group: dict[str, Any]) -> None:  # type: ignore[override]
        """A group's own options win over the constructor's; any tensor may sit in one group only."""
        params = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        taken = {id(p) for g in self.param_groups for p in g["params"]}
        for p in params:
            if not isinstance(p, torch.Tensor) or not p.is_leaf:
                raise TypeError(f"Adam optimizes leaf tensors (model.parameters()), got {type(p).__name__}")
            if id(p) in taken:
                raise ValueError("a parameter appears in more than one Adam parameter group")
        self.param_groups.append({"params": params, **{k: group.get(k, v) for k, v in self.defaults.items()}})

    def __repr__(self) -> str:
        sizes = [len(g["params"]) for g in self.param_groups]
        return f"elastic_mnist.worker.optim.Adam(groups of {sizes} tensors, lr={self.param_groups[0]['lr']})"

    # -- the update ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One Adam update of every parameter that has a gradient (torch's order of operations)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, group)
        return loss

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        if grad.is_sparse:
            raise RuntimeError("Adam does not support sparse gradients; use torch.optim.SparseAdam")
        if torch.is_complex(p):
            raise RuntimeError("elastic_mnist.worker.optim.Adam does not support complex parameters; "
                               "use torch.optim.Adam")
        state = self.state[p]
        if not state:
            # The step count lives on the CPU (as in torch when not capturable): reading it costs no device sync.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        # Bias corrections in Python floats from the float32 step, exactly as torch computes them.
        step = state["step"].item()
        step_size = group["lr"] / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        p.addcdiv_(exp_avg, denom, value=-step_size)

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                    continue
                if p.grad.grad_fn is not None:  # a gradient built with create_graph: cut it from its graph
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    # -- state_dict: torch.optim.Adam's format ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """{"state": {index: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{options..., "params":
        [indices]}]}: the live tensors, not copies (as torch returns them; savers copy)."""
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        state = {index[id(p)]: dict(s) for p, s in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state_dict of ours or of torch.optim.Adam. Everything is checked before anything
        changes: a mismatch raises one ValueError and leaves this optimizer as it was."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            raise ValueError("not an optimizer state_dict: expected a dict with 'state' and 'param_groups'")
        saved_groups = state_dict["param_groups"]
        params_of = _match_groups(self.param_groups, saved_groups)
        new_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for index, entry in state_dict["state"].items():
            if index not in params_of:
                raise ValueError(f"optimizer state_dict has state for parameter {index}, which no group lists")
            if entry:  # torch may hold an empty entry for a parameter that never had a gradient
                new_state[params_of[index]] = _loaded_entry(index, entry, params_of[index])
        new_groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": mine["params"]}
                      for mine, saved in zip(self.param_groups, saved_groups)]
        for group in new_groups:
            for key, default in self.defaults.items():
                group.setdefault(key, default)  # older torch wrote fewer options
        self.state, self.param_groups = new_state, new_groups


def _match_groups(groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]) -> dict[Any, torch.Tensor]:
    """Saved parameter index -> this optimizer's tensor, after checking the groups line up."""
    if len(saved_groups) != len(groups):
        raise ValueError(f"optimizer state_dict has {len(saved_groups)} parameter group(s), this optimizer "
                         f"{len(groups)}: it was saved for another model")
    params_of: dict[Any, torch.Tensor] = {}
    for n, (mine, saved) in enumerate(zip(groups, saved_groups)):
        if len(saved["params"]) != len(mine["params"]):
            raise ValueError(f"optimizer state_dict group {n} has {len(saved['params'])} parameters, this "
                             f"optimizer {len(mine['params'])}: it was saved for another model")
        for key, fixed in _FIXED_OPTIONS.items():
            if key not in _IGNORED_OPTIONS and saved.get(key, fixed) not in (fixed, None, False, 0):
                raise ValueError(f"optimizer state_dict group {n} uses Adam option {key}={saved[key]!r}, which "
                                 f"elastic_mnist.worker.optim.Adam does not implement: use torch.optim.Adam for it")
        params_of.update(zip(saved["params"], mine["params"]))
    return params_of


def _loaded_entry(index: Any, entry: dict[str, Any], param: torch.Tensor) -> dict[str, Any]:
    """Copies (never aliases of the caller's tensors) on the parameter's device and dtype; step on the CPU."""
    missing = [k for k in _STATE_KEYS if k not in entry]
    if missing:
        raise ValueError(f"optimizer state_dict entry {index} lacks {missing}: it is not Adam state")
    for key in ("exp_avg", "exp_avg_sq"):
        if tuple(entry[key].shape) != tuple(param.shape):
            raise ValueError(f"optimizer state_dict entry {index} has {key} of shape {tuple(entry[key].shape)}, "
                             f"the parameter has {tuple(param.shape)}: it was saved for another model")
    dtype = param.dtype if param.is_floating_point() else None
    return {
        "step": torch.tensor(float(entry["step"]), dtype=torch.float32),
        "exp_avg": entry["exp_avg"].detach().to(device=param.device, dtype=dtype, copy=True),
        "exp_avg_sq": entry["exp_avg_sq"].detach().to(device=param.device, dtype=dtype, copy=True),
    }
