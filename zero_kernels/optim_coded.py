"""Coded optimizer states of FusedAdam / FusedAdamW ([Note: state formats] in hparams.py): creating and
checking them, converting checkpoints between formats, and the step on the backends that run them.

[Note: coded state dicts]
With any non-default state format, ``opt.state[p]`` (and ``opt.state_dict()["state"][i]``, the codes renamed as
below) holds plain tensors only (``torch.load(weights_only=True)`` reads them), laid out by ``codecs.init_coded_state``:

    step                fp32 0-d, on the parameter's device
    exp_avg             fp32 | bf16 | uint8 codes | float8_e4m3fn codes, shaped like the parameter
    exp_avg_scale       fp32 [ceil(numel / 256)] block scales; only with uint8 / float8_e4m3fn codes
    exp_avg_sq          as exp_avg (uint8: unsigned log codes of sqrt(v))
    exp_avg_sq_scale    as exp_avg_scale
    master_param        fp32 master of a 16-bit parameter, or
    master_remainder    int16 remainder of a bf16 parameter (store_param_remainders=True)

The bf16 stochastic-rounding seed of a parameter is its position in the optimizer's parameter order
(its id in ``state_dict()``), so a reloaded optimizer draws the same random bits.

``state_dict()`` saves blockwise codes (uint8, float8_e4m3fn) under ``exp_avg_codes`` / ``exp_avg_sq_codes``
(``saved_form``; fp32 and bf16 moments, which are values, keep their names): ``torch.optim.AdamW``'s
load_state_dict casts every state tensor to the parameter's dtype, so codes under the moments' own names would
be loaded as moments (uint8 codes as 0-255, fp8 codes unscaled) without a word; under these names torch's first
step raises KeyError 'exp_avg'.
``load_state_dict`` maps them back (``live_form``), and still reads codes saved under the plain names.
With uint8 codes the state dict names their code (``"u8_code"``: codecs.U8_CODE) at its top level and in each
of its ``param_groups``: torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (DCP) keep only
``state`` and ``param_groups``, so the groups' tag is what reaches the load's check through
them; the load takes it out of the groups before torch's load (the live groups never hold it). DCP's
``flatten_optimizer_state_dict=True`` rebuilds each state by the live names, so it loses the codes (saved names):
the load refuses the empty states it brings, naming the option.

Loading a state dict saved in another format (torch.optim.AdamW or an fp32 FusedAdamW into a coded
optimizer, or a coded one into an fp32 optimizer) CONVERTS each state exactly as the codecs define:
decode to fp32 (``codecs.decode_moment``, ``join_remainder``), then encode into this optimizer's format
(``codecs.encode_moment`` with the saved step and the parameter's seed, ``split_remainder``); one
UserWarning says how many states were converted. A saved fp32 master that does not round to the model's
bf16 parameter cannot become a remainder: that raises before anything is loaded (load the model's
state dict first). Shapes that do not match raise before anything is loaded too.

Backends: ``reference`` runs ``codecs.adam_step_coded`` per tensor (the definition); ``triton`` runs
``kernels/adam_coded.py``; ``cpu`` runs the C++ kernel ``csrc/cpu_adam_coded.cpp`` and ``cuda`` the C++/CUDA
one (``fused_adam_coded_cuda``, when the extension was built with it; otherwise asking for it raises). Every
kernel is one fused pass, bitwise equal to the reference, and shares one host side (steps, coefficients,
stochastic-rounding keys, layout groups: ``zero_kernels._coded_host``). ``auto`` picks triton, then the CUDA
kernel, on CUDA, and the C++ kernel on CPU; when the extension is unavailable it runs the reference after
the fp32 path's one fallback warning (``_ext.warn_fallback_once``), or after a warning on CUDA.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from . import _coded_host, backends, codecs
from ._launch_plan import local, packed_steps, state_values, states_unchanged
from .hparams import StateFormat, as_float, scalar_lr

__all__ = ["new_state", "state_problem", "convert_state", "convert_state_dict", "is_coded_state", "saved_form",
           "live_form", "resolve_backend",
           "CodedWork", "CodedPlan", "coded_plans", "step_coded", "run_coded", "group_hparams"]

_MOMENTS = ("exp_avg", "exp_avg_sq")
_STREAM = {"exp_avg": 0, "exp_avg_sq": 1}
_CODES = {"exp_avg": "exp_avg_codes", "exp_avg_sq": "exp_avg_sq_codes"}   # saved names of blockwise codes


def saved_form(state: dict[str, Any]) -> dict[str, Any]:
    """One parameter's state as ``state_dict()`` saves it: blockwise codes under their saved names
    ([Note: coded state dicts]); a new dict when renamed (torch's state_dict shares the live ones)."""
    coded = [k for k in _MOMENTS if isinstance(state.get(k), Tensor) and state[k].dtype in codecs.BLOCKWISE]
    if not coded:
        return state
    return {(_CODES[k] if k in coded else k): v for k, v in state.items()}


def live_form(where: str, saved: dict[str, Any]) -> dict[str, Any]:
    """The reverse of saved_form (codes saved under the plain names by earlier builds pass as they are).
    Raises ValueError when a moment is saved under both names, or values under the codes' name."""
    if not any(c in saved for c in _CODES.values()):
        return saved
    out = dict(saved)
    for k, c in _CODES.items():
        if c not in out:
            continue
        t = out.pop(c)
        if k in out:
            raise ValueError(f"{where}: both {k!r} and {c!r} are saved; a state holds one of them. Nothing was loaded.")
        if not isinstance(t, Tensor) or t.dtype not in codecs.BLOCKWISE:
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{where}: {c!r} holds {got}, not uint8 or float8_e4m3fn codes. Nothing was loaded.")
        out[k] = t
    return out
_C_KERNELS = ("cpu", "cuda")


def _init(p: Tensor, fmt: StateFormat) -> dict[str, Tensor]:
    return codecs.init_coded_state(p.detach(), exp_avg_dtype=fmt.exp_avg_dtype, exp_avg_sq_dtype=fmt.exp_avg_sq_dtype,
                                   store_param_remainders=fmt.store_param_remainders, min_8bit_size=fmt.min_8bit_size)


def new_state(p: Tensor, fmt: StateFormat) -> dict[str, Tensor]:
    """A fresh coded state for ``p`` ([Note: coded state dicts]), step on the parameter's device."""
    state = _init(p, fmt)
    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
    return state


def state_problem(where: str, state: dict[str, Any], p: Tensor, fmt: StateFormat) -> str | None:
    """Why ``state`` is not the coded state ``fmt`` gives ``p`` (keys, dtypes, shapes, devices), or None."""
    def layout(dtype, remainders):
        try:
            return codecs.state_layout(tuple(p.shape), dtype, exp_avg_dtype=fmt.exp_avg_dtype,
                                       exp_avg_sq_dtype=fmt.exp_avg_sq_dtype, store_param_remainders=remainders,
                                       min_8bit_size=fmt.min_8bit_size)
        except ValueError:              # remainders of a parameter that is not bf16 (any more)
            return None
    want = layout(p.dtype, fmt.store_param_remainders)
    if want is None or state.keys() != want.keys():
        for dt, name, rem in ((torch.float32, "float32", False), (torch.bfloat16, "16-bit", False),  # 16-bit: with
                              (torch.bfloat16, "bfloat16", fmt.store_param_remainders)):         # its master
            was = layout(dt, rem)
            if was is not None and state.keys() == was.keys():
                return (f"{where} is {p.dtype} now, but its coded state was made for a {name} parameter (the model "
                        f"was cast after the optimizer's first step?): cast it back, or make a new optimizer over "
                        "the cast model and load this one's state_dict() into it (the states convert)")
        if want is None:
            return (f"{where} is {p.dtype}: store_param_remainders=True keeps bfloat16 parameters only; cast it to "
                    "bfloat16, or make a new optimizer without remainders and load this one's state_dict() into it")
        return f"{where}: state keys {sorted(state)}, expected {sorted(want)} for {fmt}"
    for k, (dt, shape) in want.items():
        t = state[k]
        if not isinstance(t, Tensor) or (k != "step" and (t.dtype != dt or tuple(t.shape) != shape)):
            got = (t.dtype, tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__
            return f"{where}: state {k!r} is {got}, expected {(dt, shape)}"
        if k != "step" and (t.device != p.device or not t.is_contiguous()):
            return f"{where}: state {k!r} must be contiguous on {p.device}, got {t.device}"
    return None


def is_coded_state(saved: dict[str, Any]) -> bool:
    """A saved state that an fp32 optimizer must convert: codes with scales, or a remainder."""
    return "master_remainder" in saved or any(k.endswith("_scale") for k in saved)


def _check_saved(where: str, saved: dict[str, Any], p: Tensor) -> None:
    for k, t in saved.items():
        if k == "step":
            continue
        if isinstance(t, dict) and not t and k in _MOMENTS:
            raise ValueError(f"{where}: state {k!r} is an empty dict: torch.distributed.checkpoint's "
                             "flatten_optimizer_state_dict=True rebuilds each state by the optimizer's live state "
                             f"names, and blockwise codes are saved as {_CODES[k]!r} ([Note: coded state dicts]), so "
                             "it lost them; save and load with flatten_optimizer_state_dict=False (the default). "
                             "Nothing was loaded.")
        if not isinstance(t, Tensor):
            raise ValueError(f"{where}: state {k!r} is a {type(t).__name__}, not a tensor. Nothing was loaded.")
        want = (-(-p.numel() // codecs.BLOCK),) if k.endswith("_scale") else tuple(p.shape)
        if tuple(t.shape) != want:
            raise ValueError(f"{where}: state {k!r} has shape {tuple(t.shape)}, expected {want} for the parameter "
                             f"of shape {tuple(p.shape)}; was the state saved for another model? Nothing was loaded.")
        if k in _MOMENTS and t.dtype in codecs.BLOCKWISE and k + "_scale" not in saved:
            raise ValueError(f"{where}: state {k!r} holds {t.dtype} codes but no {k}_scale. Nothing was loaded.")


def _same_layout(saved: dict[str, Any], target: dict[str, Tensor], key: str) -> bool:
    return saved[key].dtype == target[key].dtype and ((key + "_scale") in saved) == ((key + "_scale") in target)


def _convert_master(where: str, saved: dict[str, Any], p: Tensor, target: dict[str, Tensor]) -> bool:
    """Fill target's master_param / master_remainder from the saved one; True when converted."""
    if "master_remainder" in target:
        if "master_remainder" in saved:
            target["master_remainder"].copy_(saved["master_remainder"])
            return False
        if "master_param" not in saved:
            return False                                  # torch's checkpoint: the bf16 parameter is the master
        hi, rem = codecs.split_remainder(saved["master_param"].to(p.device, torch.float32))
        same = (hi.view(torch.int16) == p.detach().view(torch.int16)) | (torch.isnan(hi) & torch.isnan(p.detach()))
        if not bool(same.all()):
            raise ValueError(f"{where}: the saved fp32 master_param does not round to the model's bf16 parameter, so "
                             "it cannot be stored as a remainder of it; load the model's state dict (saved with this "
                             "optimizer state) before the optimizer's. Nothing was loaded.")
        target["master_remainder"].copy_(rem)
        return True
    if "master_param" in target:
        if "master_param" in saved:
            target["master_param"].copy_(saved["master_param"])
            return False
        if "master_remainder" in saved:
            target["master_param"].copy_(codecs.join_remainder(p.detach(), saved["master_remainder"].to(p.device)))
            return True
    if p.dtype == torch.float32 and ("master_param" in saved or "master_remainder" in saved):
        # Saved for a 16-bit parameter that is fp32 now (``model.float()``): its master goes along as
        # master_param, which the loading optimizer adopts into the parameter (FusedAdam._adopt_master_after_cast)
        # instead of keeping the 16-bit rounding.
        if "master_param" in saved:
            target["master_param"] = saved["master_param"].to(p.device, torch.float32, copy=True)
        else:
            target["master_param"] = codecs.join_remainder(p.detach().to(torch.bfloat16),
                                                           saved["master_remainder"].to(p.device))
        return True
    return False


def convert_state(where: str, saved: dict[str, Any], p: Tensor, fmt: StateFormat, seed: int) -> tuple[dict, int]:
    """(the state ``fmt`` gives ``p``, filled from ``saved``; how many tensors were converted between formats).
    See [Note: coded state dicts]; raises ValueError (nothing loaded) on shapes that cannot be this parameter's."""
    _check_saved(where, saved, p)
    target = new_state(p, fmt)
    step = saved.get("step", 0)
    target["step"].fill_(float(step))
    converted = 0
    for key in _MOMENTS:
        if key not in saved:
            continue
        if _same_layout(saved, target, key):
            target[key].copy_(saved[key])
            if key + "_scale" in target:
                target[key + "_scale"].copy_(saved[key + "_scale"])
            continue
        x = codecs.decode_moment(saved, key).to(p.device, torch.float32)
        sr = dict(seed=seed, step=int(float(step)), stream=_STREAM[key])
        codecs.encode_moment(target, key, x, "stochastic", sr)
        converted += int(saved[key].dtype != torch.float32 or target[key].dtype != torch.float32)
    converted += _convert_master(where, saved, p, target)
    return target, converted


def convert_state_dict(state_dict: dict[str, Any], param_groups: list[dict], fmt: StateFormat) -> dict[str, Any]:
    """``state_dict`` with every saved state in ``fmt`` (a new dict; the caller's is not modified), its codes
    under the live names (``live_form``). An fp32 optimizer (``fmt`` not coded) converts only saved coded states.
    Raises ValueError before anything is loaded."""
    saved = {i: live_form(f"state_dict['state'][{i}]", st) if isinstance(st, dict) else st
             for i, st in state_dict["state"].items()}
    groups = [dict(g) for g in state_dict["param_groups"]]
    tags = {g.pop("u8_code", None) for g in groups} | {state_dict.get("u8_code")}   # DCP keeps the groups' only
    if codecs.holds_u8_moments(st for st in saved.values() if isinstance(st, dict)):
        for tag in sorted(tags - {None}) or [None]:
            why = codecs.u8_code_problem(tag)
            if why is not None:
                raise ValueError(f"state_dict: {why}. Nothing was loaded.")
    state_dict = {**state_dict, "param_groups": groups}
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    params = [p for g in param_groups for p in g["params"]]
    if len(ids) != len(params):
        return {**state_dict, "state": saved}              # torch's load_state_dict raises its own error
    if fmt.coded and any(g.get("amsgrad", False) for g in state_dict["param_groups"]):
        raise ValueError("the state dict's param_groups have amsgrad=True, which coded states do not support "
                         "(max_exp_avg_sq has no coded format); set amsgrad=False in it. Nothing was loaded.")
    out, n = dict(saved), 0
    for seed, (p, sid) in enumerate(zip(params, ids)):
        st = saved.get(sid)
        if st is not None and (fmt.coded or is_coded_state(st)):
            out[sid], k = convert_state(f"state_dict['state'][{sid}]", st, p, fmt, seed)
            n += k
    if n:
        warnings.warn(f"load_state_dict converted {n} optimizer state tensors from the checkpoint's format to this "
                      f"optimizer's ({fmt}) by decoding to fp32 and encoding with zero_kernels.codecs; the states are "
                      "those codecs' rounding of the saved ones", UserWarning, stacklevel=3)
    return {**state_dict, "state": out}


@dataclass
class CodedWork:
    """One kernel group of a step: a parameter group's parameters with a gradient on one device."""
    device: torch.device
    params: list[Tensor]
    seeds: list[int]                    # stochastic-rounding seeds: positions in the optimizer's order
    states: list[dict[str, Tensor]]
    steps: Tensor | None                # 1-D buffer; states[k]["step"] is steps[k] (packed_steps)
    cache: dict = field(default_factory=dict)   # the host side's per-plan arguments (_coded_host.prepare)


@dataclass
class CodedPlan:
    """[Note: launch plans] for coded states: a group's CodedWork, kept while the group's signature, the
    optimizer's epoch and every state tensor (identity) stay as they were when it was built."""
    signature: list
    epoch: int
    work: list[CodedWork]
    cacheable: bool                     # False with a non-contiguous parameter (updated through a copy)
    state_values: list = field(default_factory=list)

    def snapshot(self) -> None:
        self.state_values = state_values([st for w in self.work for st in w.states])

    def matches(self, sig: list, epoch: int) -> bool:
        return (self.epoch == epoch and self.signature == sig
                and states_unchanged([st for w in self.work for st in w.states], self.state_values))


def coded_plans(param_groups: list[dict], state: dict, fmt: StateFormat, build: dict[int, list],
                epoch: int) -> dict[int, CodedPlan]:
    """A CodedPlan for each group index of ``build`` (-> its signature): every existing state of those groups
    checked first (RuntimeError, nothing changed), then the missing states created and each work item's step
    counters packed into one buffer (the states' ``step`` become its views, as the fp32 path's)."""
    order = {id(p): i for i, p in enumerate(p for g in param_groups for p in g["params"])}
    work: dict[int, list[tuple[torch.device, list[Tensor]]]] = {}
    for gi in build:
        by_device: dict[torch.device, list[Tensor]] = {}
        for pi, p in enumerate(param_groups[gi]["params"]):
            if p.grad is None:
                continue
            st = state.get(p)
            why = state_problem(f"param_groups[{gi}]['params'][{pi}]", st, p, fmt) if st else None
            if why is not None:
                raise RuntimeError(f"{why}. No parameter was updated.")
            by_device.setdefault(p.device, []).append(p)
        work[gi] = list(by_device.items())
    plans = {}
    for gi, items in work.items():
        plan = CodedPlan(build[gi], epoch, [], cacheable=all(p.is_contiguous() for _, ps in items for p in ps))
        for dev, ps in items:
            for p in ps:
                if not state.get(p):
                    state[p] = new_state(p, fmt)
            sts = [state[p] for p in ps]
            steps = packed_steps([st["step"] for st in sts], dev)
            if sts and sts[0]["step"]._base is not steps:       # a new buffer: its views become the steps
                for k, st in enumerate(sts):
                    st["step"] = steps[k]
            plan.work.append(CodedWork(dev, ps, [order[id(p)] for p in ps], sts, steps))
        plan.snapshot()
        plans[gi] = plan
    return plans


def _cuda_kernel_missing() -> str | None:
    """Why the C++ coded CUDA kernel cannot run (None when it can)."""
    from . import _ext
    mod = _ext.cpu_module()
    if mod is None or not hasattr(mod, "fused_adam_coded_cuda"):
        return ("the C++ cuda kernel for coded optimizer states (exp_avg_dtype / exp_avg_sq_dtype / "
                "store_param_remainders) is not in this build of the extension")
    return None


def resolve_backend(request: str, device: torch.device) -> str:
    """The backend that runs coded states on ``device`` ([Note: coded state dicts], last paragraph)."""
    if request == "cuda":
        name = backends.resolve(request, device)          # ValueError: not a CUDA tensor / no CUDA build
        why = _cuda_kernel_missing()
        if why is not None:
            raise NotImplementedError(f"backend='cuda': {why}; use backend='triton' or 'reference'")
        return name
    if request != "auto":
        return backends.resolve(request, device)
    if device.type == "cuda":
        if backends.why_unavailable("triton", device) is None:
            return "triton"
        if backends.why_unavailable("cuda", device) is None and _cuda_kernel_missing() is None:
            return "cuda"
        warnings.warn(f"coded optimizer states on {device}: neither triton nor the C++ cuda kernel can run them, "
                      "the pure-torch reference does (slow); pass backend='reference' to silence this",
                      UserWarning, stacklevel=4)
        return "reference"
    return backends.resolve("auto", device)                # cpu, or the reference after the fallback warning


def step_coded(backend: str, w: CodedWork, group: dict[str, Any], grad_scale: Tensor | None,
               found_inf: Tensor | None) -> None:
    """One step of one work item's coded states on ``backend``; ``grad_scale`` is GradScaler's loss scale (the
    gradients are divided by it), ``found_inf`` nonzero skips the step."""
    if w.device.type == "meta":       # shapes only (torch.optim.AdamW steps meta parameters too): no values to code
        if w.steps is not None:
            w.steps.add_(1)
        return
    gs = None if grad_scale is None else grad_scale.to(w.device, torch.float32).reshape(1).reciprocal()
    fi = None if found_inf is None else found_inf.to(w.device, torch.float32).reshape(1)
    run_coded(backend, [p.detach() for p in w.params], [local(p.grad) for p in w.params], w.states, w.seeds, None,
              group_hparams(group, bool(group["decoupled_weight_decay"])), grad_scale=gs, found_inf=fi,
              step_buffer=w.steps, cache=w.cache)


def group_hparams(group: dict[str, Any], adamw: bool) -> dict[str, Any]:
    """The keyword arguments of :func:`run_coded` ``hp`` from a param group (lr, betas, eps, weight_decay,
    maximize) and Adam (L2) vs AdamW (decoupled)."""
    beta1, beta2 = (as_float(b) for b in group["betas"])
    return dict(lr=scalar_lr(group["lr"]), beta1=beta1, beta2=beta2, eps=float(group["eps"]),
                weight_decay=float(group["weight_decay"]), adamw=adamw, maximize=bool(group["maximize"]))


def run_coded(backend: str, params: list[Tensor], grads: list[Tensor], states: list[dict[str, Tensor]],
              seeds: list[int], index_offsets: list[int] | None, hp: dict[str, Any], *,
              grad_scale: Tensor | None, found_inf: Tensor | None, step_buffer: Tensor | None = None,
              cache: dict | None = None) -> None:
    """``codecs.adam_step_coded`` of every (param, grad, state, seed, index offset) on ``backend``; ``hp``: lr,
    beta1, beta2, eps, weight_decay, adamw, maximize; ``grad_scale`` multiplies the gradients; ``step_buffer``,
    ``cache``: see ``_coded_host.prepare``."""
    offsets = index_offsets or [0] * len(params)
    if backend == "triton":
        from .kernels.adam_coded import adam_step_coded_triton   # triton is optional: imported when used
        adam_step_coded_triton(params, grads, states, seeds, grad_scale=grad_scale, found_inf=found_inf,
                               index_offsets=offsets, step_buffer=step_buffer, cache=cache, **hp)
        return
    if backend in _C_KERNELS:
        from . import _ext
        fn = _ext.fused_adam_coded_cpu if backend == "cpu" else _ext.fused_adam_coded_cuda
        _coded_host.run_extension(fn, params, grads, states, seeds, grad_scale=grad_scale, found_inf=found_inf,
                                  index_offsets=offsets, step_buffer=step_buffer, cache=cache, **hp)
        return
    for p, g, st, seed, off in zip(params, grads, states, seeds, offsets):
        codecs.adam_step_coded(p, g, st, seed=seed, index_offset=off, grad_scale=grad_scale, found_inf=found_inf,
                               **hp)
