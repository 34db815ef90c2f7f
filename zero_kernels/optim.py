"""``FusedAdam`` / ``FusedAdamW``: drop-in replacements for ``torch.optim.Adam`` / ``AdamW``.

The optimizer owns validation, parameter groups and state (torch's layout and keys); the math is
one function with one contract (``zero_kernels.reference``), run by the backend chosen in
``zero_kernels.backends``. A step launches one kernel per (parameter group, device, grad dtype,
16-bit dtype), whatever the number of parameters.
"""
from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from . import _param_edits, backends, codecs, optim_coded
from ._launch_plan import (GroupPlan, Launch, is_low_precision, local, packed_steps, shared_steps, signature,
                           state_error)
from ._traced_step import TracedStep
from .codecs import BLOCK
from .optim_checks import (OVERLAP_FIX, check_amp_args, check_distinct, check_grads, check_group_keys,
                           check_no_shared_memory, check_scalars, internal_overlap, param_dtype_problem,
                           storage_key)
from .hparams import (check_coded_amsgrad, check_param_format, scalar_lr, validate_hparams as _validate_hparams,
                      validate_state_format)
from .reference import compute_coeffs

__all__ = ["FusedAdam", "FusedAdamW"]

_FP32_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


def _scalar(x: float | Tensor) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def _advance(steps: Tensor, found_inf: Tensor | None, index: Tensor | None = None) -> Tensor:
    """A launch's packed step counters advanced in place, by 1 - found_inf on the device (torch's
    fused path): one op, whatever the number of parameters ([Note: launch plans]); with ``index`` only
    those elements of ``steps`` (returned as a new 1-D tensor, in the launch's order)."""
    inc = 1.0 if found_inf is None else 1.0 - found_inf.to(steps.device, torch.float32).reshape(())
    if index is None:
        return steps.add_(inc)
    steps.index_add_(0, index, torch.ones(index.numel(), device=steps.device) * inc)
    return steps.index_select(0, index)


class FusedAdam(TracedStep, torch.optim.Optimizer):
    """Adam (``decoupled_weight_decay=False``: L2 added to the gradient) as one fused pass.

    Same constructor, defaults and semantics as ``torch.optim.Adam``. Extra keyword-only:

    master_weights: ``None`` (default) keeps an fp32 master copy (``state["master_param"]``) for
        every bf16/fp16 parameter and rewrites the 16-bit parameter from it in the same kernel
        pass; ``False`` keeps 16-bit states like torch does (runs the reference path);
        ``True`` is the same as ``None``.
    backend: ``"auto"`` | ``"triton"`` | ``"cpu"`` | ``"cuda"`` | ``"reference"``.
    exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders, min_8bit_size: the state formats of
        [Note: state formats] (hparams.py); their state dicts, conversions and backends: [Note: coded
        state dicts] (optim_coded.py). The defaults are fp32 states, as torch.

    ``foreach`` is accepted and ignored (the step is always multi-tensor); ``fused=False``,
    ``foreach=True`` with ``fused=True`` (as torch) and ``differentiable=True`` are refused. ``step``
    lives on the parameter's device (as with torch's fused AdamW) and ``step()`` never reads anything
    back from the device, so every step can be captured in a CUDA graph (``capturable=True`` is
    accepted; capture after a few eager steps,
    with static gradients: ``zero_grad(set_to_none=False)``, as ``torch.cuda.graphs`` requires).

    ``opt.backend``: the backend that runs for each device, e.g. ``{"cuda:0": "triton"}``.
    """

    _decoupled_default = False

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool | None = None,
        master_weights: bool | None = None,
        backend: str = "auto",
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        store_param_remainders: bool = False,
        min_8bit_size: int = BLOCK,
    ) -> None:
        _validate_hparams(lr, betas, eps, weight_decay)
        self._format = validate_state_format(exp_avg_dtype, exp_avg_sq_dtype, store_param_remainders,
                                             min_8bit_size, master_weights=master_weights)
        if differentiable:
            raise ValueError(f"{type(self).__name__} does not support differentiable=True "
                             "(the fused kernel updates in place); use torch.optim.Adam(differentiable=True)")
        if fused is False:
            raise ValueError(f"{type(self).__name__} is always fused; fused=False asks for torch's "
                             "unfused loop: use torch.optim.Adam/AdamW for that")
        if fused and foreach:           # torch.optim.AdamW refuses the pair too
            raise ValueError(f"{type(self).__name__}: `fused` and `foreach` cannot be `True` together (as in "
                             "torch.optim.AdamW); drop foreach=True (the step is always one fused pass)")
        if backend not in backends.BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {backends.BACKENDS}")
        if master_weights not in (None, True, False):
            raise ValueError(f"master_weights must be None, True or False, got {master_weights!r}")
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled_default
        self._backend_request = backend
        self._master_weights = master_weights
        self._resolved: dict[torch.device, str] = {}
        self._plans: dict[int, GroupPlan] = {}   # per group index: [Note: launch plans]
        self._epoch = 0
        self._state_dicts: list[dict] = []
        self._watch = _param_edits.NOTHING   # [Note: parameters edited outside the optimizer]
        self._watch_new = True               # states were made since: watch() again (else renew())
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=False, fused=fused,
                        decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)
        # GradScaler: unscale + inf check happen inside our kernel (see step()).
        self._step_supports_amp_scaling = True

    # ------------------------------------------------------------------ groups and validation
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's checks (duplicates across groups, ...) plus ours, before anything is stored."""
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif not isinstance(params, set):   # torch refuses a set (unordered) itself, below
            params = list(params)
        # Stored as read: a generator (``{"params": layer.parameters()}``) can be read once only, and
        # torch's add_param_group would otherwise find it empty and keep a group of no parameters.
        param_group["params"] = params
        check_group_keys(len(self.param_groups), param_group)
        for i, p in enumerate(params):
            t = p[1] if isinstance(p, tuple) else p
            if not isinstance(t, Tensor):
                continue  # torch raises its own TypeError below
            why = param_dtype_problem(t, type(self).__name__) or (OVERLAP_FIX if internal_overlap(t) else None)
            if why:
                raise ValueError(f"param_groups[{len(self.param_groups)}]['params'][{i}] {why}")
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
        check_distinct(len(self.param_groups), tensors)
        # the earlier parameters over a storage of a new one (usually none: one index lookup per new tensor,
        # linear in all for one group per parameter; the index only preselects, so a stale entry costs a scan;
        # made again after a copy or unpickling, whose storages are new)
        if "_storages" not in self.__dict__:
            self._storages = {storage_key(q) for g in self.param_groups for q in g["params"]} - {None}
        seen = self._storages
        keys = {storage_key(t) for t in tensors} - {None}
        earlier = [(gi, pi, q) for gi, g in enumerate(self.param_groups) for pi, q in enumerate(g["params"])
                   if storage_key(q) in keys] if keys & seen else []
        check_no_shared_memory(len(self.param_groups), tensors, earlier)
        devices = {t.device for t in tensors if isinstance(t, Tensor)}
        if len(devices) > 1:
            raise ValueError(f"one parameter group mixes devices {sorted(map(str, devices))}; a fused "
                             "group runs on one device: put each device's parameters in its own group")
        merged = {**self.defaults, **param_group}
        gi = len(self.param_groups)
        _validate_hparams(merged["lr"], merged["betas"], merged["eps"], merged["weight_decay"],
                          where=f" (param_groups[{gi}])")
        for i, t in enumerate(tensors):
            check_param_format(self._format, f"param_groups[{gi}]['params'][{i}]", t, merged["amsgrad"])
        for dev in devices:
            if dev not in self._resolved:
                self._resolve(dev)
        super().add_param_group(param_group)
        seen |= keys
        self._epoch = getattr(self, "_epoch", 0) + 1

    # ------------------------------------------------------------------ copy, pickle, load
    def __getstate__(self) -> dict[str, Any]:
        """torch's state plus what ``__init__`` set, so that ``copy.deepcopy`` and pickling give a
        working optimizer (launch plans are not carried: they are rebuilt at the next step)."""
        state = super().__getstate__()
        state.update(_backend_request=self._backend_request, _master_weights=self._master_weights,
                     _format=self._format)
        state["state"] = defaultdict(dict, {p: _own_step(st) for p, st in state["state"].items()})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_backend_request", "auto")
        self.__dict__.setdefault("_master_weights", None)
        self.__dict__.setdefault("_format", validate_state_format(torch.float32, torch.float32, False, BLOCK))
        self._resolved: dict[torch.device, str] = {}
        self._plans: dict[int, GroupPlan] = {}
        self._epoch = 0
        self._state_dicts: list[dict] = []
        self._watch = _param_edits.NOTHING
        self._watch_new = True
        self._step_supports_amp_scaling = True
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("decoupled_weight_decay", self._decoupled_default)
            for dev in {p.device for p in group["params"]}:
                self._resolve(dev)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, blockwise codes under their saved names (``exp_avg_codes``, ...: [Note: coded
        state dicts] in optim_coded.py), plus ``"u8_code"`` (codecs.U8_CODE) when a state holds uint8 moment
        codes: the code they are in, checked by load_state_dict before anything is decoded. Done as the first
        state-dict post-hook: the user's post-hooks (``register_state_dict_post_hook``) see the dict returned.
        Each of its ``param_groups`` names the code too (torch's DCP state-dict API keeps only those)."""
        handle = self.register_state_dict_post_hook(_saved_form, prepend=True)
        try:
            return super().state_dict()
        finally:
            handle.remove()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, after checking every saved state tensor against its parameter's shape
        (a mismatch raises before anything is loaded). With master weights, the moments and master
        of 16-bit parameters are fp32 (torch casts floating state to the parameter's dtype): an fp32
        saved state is kept as saved, a 16-bit one (saved by torch.optim, or a 16-bit master) is
        upcast exactly. States saved in another format than this optimizer's are converted first
        ([Note: coded state dicts] in optim_coded.py). The next step adopts the parameters as they are then
        into the loaded masters ([Note: parameters edited outside the optimizer]): a write after the load
        stands, as with torch. A state saved for a 16-bit parameter that is fp32 now (``model.float()`` between
        save and load) brings its fp32 master (or bf16 + remainder), which the parameter takes, as a model cast
        under one optimizer does.

        The checks and conversion run as the LAST load pre-hook and the restoration of the loaded states as the
        FIRST load post-hook: the user's pre-hooks (``register_load_state_dict_pre_hook``) see and may edit the
        dict as given, the user's post-hooks see the states as loaded."""
        loaded: dict[str, Any] = {}
        pre = self.register_load_state_dict_pre_hook(lambda opt, sd: opt._checked_for_load(sd, loaded))
        post = self.register_load_state_dict_post_hook(lambda opt: opt._restore_loaded(loaded), prepend=True)
        try:
            super().load_state_dict(state_dict)
        finally:
            pre.remove()
            post.remove()

    def _checked_for_load(self, state_dict: dict[str, Any], loaded: dict[str, Any]) -> dict[str, Any]:
        """load_state_dict's pre-hook: ``state_dict`` converted to this optimizer's format and checked (raises
        before anything is loaded); what the post-hook needs goes into ``loaded``."""
        coded = self._format.coded
        state_dict = optim_coded.convert_state_dict(state_dict, self.param_groups, self._format)
        saved = state_dict["state"]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for p, sid in zip(params, saved_ids if not coded else ()):
            for k in _FP32_STATE_KEYS:
                v = saved.get(sid, {}).get(k)
                where = f"state_dict['state'][{sid}]"
                why = None if v is None else state_error(where, k, v, p, same_device=False)
                if why is not None:
                    raise ValueError(f"{why}. Nothing was loaded.")
        loaded.update(saved=saved, pairs=list(zip(params, saved_ids)))
        return state_dict

    def _restore_loaded(self, loaded: dict[str, Any]) -> None:
        """load_state_dict's post-hook: the states as this optimizer keeps them (codes, fp32 masters)."""
        coded = self._format.coded
        saved = loaded["saved"]
        self._epoch += 1
        self._watch_new = True
        for p, sid in loaded["pairs"]:
            if coded and sid in saved:      # torch cast the codes to the parameter's dtype: restore them
                self.state[p].update({k: v for k, v in saved[sid].items() if k != "step"})
            if (sid in saved and p.dtype == torch.float32 and not self._uses_master(p)
                    and "master_param" in self.state[p]):      # saved 16-bit, fp32 now: taken at the load, so an
                self._adopt_master_after_cast(p, self.state[p])   # evaluation before the next step sees it
            if coded or not self._uses_master(p) or sid not in saved:
                continue
            for k in _FP32_STATE_KEYS:
                v = saved[sid].get(k)
                if isinstance(v, Tensor):
                    self.state[p][k] = v.to(device=p.device, dtype=torch.float32, copy=True)
        self._watch = _param_edits.all_written(self.state)   # [Note: parameters edited outside the optimizer]

    # ------------------------------------------------------------------ state
    def _uses_master(self, p: Tensor) -> bool:
        return is_low_precision(p.dtype) and self._master_weights is not False

    def _init_state(self, p: Tensor, group: dict[str, Any], where: str) -> dict[str, Any]:
        """The state of ``p``, created or brought to the kernel's layout (fp32 moments and master
        with master weights; contiguous; ``step`` a tensor), after checking shapes and devices."""
        state = self.state[p]
        master = self._uses_master(p)
        sdtype = torch.float32 if (master or p.dtype == torch.float32) else p.dtype
        zeros = lambda: torch.zeros_like(p, dtype=sdtype, memory_format=torch.contiguous_format)  # noqa: E731
        if len(state) == 0:
            # On the parameter's device, as torch's fused AdamW: a device found_inf never syncs.
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            # zeros_like keeps DTensor-ness (FSDP2): states are sharded like their parameter
            state["exp_avg"], state["exp_avg_sq"] = zeros(), zeros()
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = zeros()
        if not torch.is_tensor(state["step"]):
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
            why = state_error(where, k, state[k], p) if k in state else None
            if why is not None:
                raise RuntimeError(f"{why}. No parameter was updated.")
        if not master and "master_param" in state and p.dtype == torch.float32:
            self._adopt_master_after_cast(p, state)
        if master and "master_param" not in state:
            # From the 16-bit values: also right after loading a torch.optim state_dict.
            state["master_param"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format).clone()
        for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
            want = torch.float32 if k == "master_param" else sdtype
            if k in state and (state[k].dtype != want or not local(state[k]).is_contiguous()):
                state[k] = state[k].to(dtype=want, memory_format=torch.contiguous_format)
        return state

    @staticmethod
    @torch.no_grad()
    def _adopt_master_after_cast(p: Tensor, state: dict[str, Any]) -> None:
        """A 16-bit parameter cast to fp32 since its state was made (``model.float()``): it takes its master's
        value wherever it still equals the master's 16-bit rounding (elsewhere it was written since: it is
        kept), and the master is dropped (an fp32 parameter is its own master)."""
        master, p32 = local(state.pop("master_param")), local(p)
        keep = (master.to(torch.bfloat16).float() == p32) | (master.to(torch.float16).float() == p32)
        p32.copy_(torch.where(keep, master, p32))

    def refresh_fp32_params(self) -> None:
        """Bring every master the optimizer keeps (fp32 ``master_param`` or bf16 ``master_remainder``) to its
        16-bit parameter, element by element ([Note: parameters edited outside the optimizer] in
        ``_param_edits.py``). Writes through torch (``model.load_state_dict``, ``torch.nn.init``, ``with
        torch.no_grad(): p.mul_(mask)``, ``p.data = x``) are adopted by the next step without this call; in-place
        writes through ``p.data`` bypass the version counter: call this after them (DeepSpeed's name). Without it
        an fp32 master undoes such a write at the next step; a remainder keeps it, joined to a stale fraction
        of a bf16 ulp."""
        for gi, group in enumerate(self.param_groups):   # every master checked before any is changed
            for pi, p in enumerate(group["params"]):
                st = self.state.get(p, {})
                for k in _param_edits.MASTER_KEYS:
                    if k in st and local(st[k]).shape != local(p).shape:
                        raise RuntimeError(
                            f"refresh_fp32_params: param_groups[{gi}]['params'][{pi}] has shape {tuple(local(p).shape)}, "
                            f"its state {k!r} {tuple(local(st[k]).shape)} (was p.data given another shape?); an "
                            "optimizer cannot carry states across a shape change: build a new one for the new "
                            "shapes. No master was changed.")
                if "master_remainder" in st and p.dtype != torch.bfloat16:
                    raise RuntimeError(
                        f"refresh_fp32_params: param_groups[{gi}]['params'][{pi}] is {p.dtype} now; its master is kept "
                        "as the bf16 parameter's bits plus an int16 remainder (store_param_remainders=True), so the "
                        "parameter must stay bf16. No master was changed.")
        for p, st in self.state.items():
            _param_edits.adopt(p, st)
        self._watch = _param_edits.watch(self.state)

    def _adopt_edits(self) -> None:
        """Adopt the parameters written outside the optimizer since the last step (just before the launches)."""
        changed, self._watch = _param_edits.edited(self._watch)
        for p in changed:
            if p in self.state:
                _param_edits.adopt(p, self.state[p])

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *, grad_scale: Tensor | None = None,
             found_inf: Tensor | None = None) -> float | None:
        """One fused step. ``grad_scale`` (the loss scale: gradients are divided by it) and
        ``found_inf`` (nonzero: skip everything) follow torch's fused AdamW / GradScaler contract;
        they are also read from ``self.grad_scale`` / ``self.found_inf`` set by GradScaler.

        Atomic: every group's gradients, hyper-parameters and states are checked before any
        counter or parameter changes. Nothing is read back from the device (see
        [Note: launch plans] in ``zero_kernels/_launch_plan.py``). Under ``torch.compile`` the
        step is traced into the caller's graph ([Note: the traced step] in ``_traced_step.py``)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = grad_scale if grad_scale is not None else getattr(self, "grad_scale", None)
        found_inf = found_inf if found_inf is not None else getattr(self, "found_inf", None)
        check_amp_args(grad_scale, found_inf)
        if self._format.coded:
            self._step_coded(grad_scale, found_inf)
        elif torch.compiler.is_compiling():   # [Note: the traced step]
            self._traced_step(grad_scale, found_inf)
            return loss
        else:
            unwatched = self._watch is _param_edits.NOTHING and bool(self.state)   # states made by traced steps
            work = self._prepare()
            if unwatched:           # no versions recorded since: every master's parameter may have been written
                self._watch = _param_edits.all_written(self.state)
            self._adopt_edits()
            for group, grads, plan in work:
                self._run_plan(group, plan, grads, grad_scale, found_inf)
        self._watch = _param_edits.watch(self.state) if self._watch_new else _param_edits.renew(self._watch)
        self._watch_new = False
        return loss

    def _prepare(self) -> list[tuple[dict[str, Any], list[Tensor | None], GroupPlan]]:
        """(group, gradients, plan) of every group: all checked before any state or plan is created."""
        self._bump_epoch_if_states_replaced()
        work = []
        for gi, group in enumerate(self.param_groups):
            grads = [p.grad for p in group["params"]]
            sig = signature(group["params"], grads)
            plan = self._plans.get(gi)
            check_scalars(gi, group)
            if plan is None or not plan.matches(sig, self._epoch, group["amsgrad"]):
                check_grads(type(self).__name__, gi, group, grads)
                plan = None
            work.append((gi, group, grads, sig, plan))
        for k, (gi, group, grads, sig, plan) in enumerate(work):
            if plan is None:
                plan = self._build_plan(gi, group, grads, sig)
                self._watch_new = True
                if plan.cacheable:
                    self._plans[gi] = plan
                work[k] = (gi, group, grads, sig, plan)
        self._state_dicts = list(self.state.values())
        return [(group, grads, plan) for _, group, grads, _, plan in work]

    def _build_plan(self, gi: int, group: dict[str, Any], grads: list[Tensor | None], sig: list) -> GroupPlan:
        """Group ``gi``'s launches (see [Note: launch plans]); validates and initialises states."""
        launches: dict[tuple, Launch] = {}
        steps: dict[tuple, list[Tensor]] = {}
        writebacks: list[tuple[Tensor, Tensor]] = []
        params = group["params"]
        for pi, (p, g) in enumerate(zip(params, grads)):
            if g is None:
                continue
            state = self._init_state(p, group, f"param_groups[{gi}]['params'][{pi}]")
            master = local(state.get("master_param"))
            target, p16 = (master, local(p)) if master is not None else (local(p), None)
            if p16 is not None and not p16.is_contiguous():
                tmp = torch.empty(p16.shape, dtype=p16.dtype, device=p16.device)
                writebacks.append((p16, tmp))
                p16 = tmp
            if not target.is_contiguous():
                # Never update a throwaway copy: the contiguous temporary is copied back below.
                tmp = target.contiguous()
                writebacks.append((target, tmp))
                target = tmp
            ref_only = target.dtype != torch.float32  # master_weights=False with 16-bit params
            key = (p.device, g.dtype, None if p16 is None else p16.dtype, ref_only)
            if key not in launches:
                launches[key] = Launch(device=p.device, p16_dtype=key[2], ref_only=ref_only)
                steps[key] = []
            L = launches[key]
            L.index.append(pi)
            L.masters.append(target)
            L.exp_avgs.append(local(state["exp_avg"]))
            L.exp_avg_sqs.append(local(state["exp_avg_sq"]))
            if group["amsgrad"]:
                L.max_exp_avg_sqs.append(local(state["max_exp_avg_sq"]))
            if p16 is not None:
                L.params16.append(p16)
            steps[key].append(state["step"])
        for key, L in launches.items():
            shared = shared_steps(steps[key], L.device)
            if shared is not None:                  # the buffer (or a subset of it) they live in: they stay put
                L.steps, L.step_index = shared
                continue
            L.steps = packed_steps(steps[key], L.device)
            for k, pi in enumerate(L.index):        # a new buffer: its views become the states' steps
                self.state[params[pi]]["step"] = L.steps[k]
        plan = GroupPlan(signature=sig, epoch=self._epoch, amsgrad=bool(group["amsgrad"]),
                         dtensor=any(local(g) is not g for g in grads if g is not None),
                         contiguous_grads=all(s[4] for s in sig if s is not None),
                         launches=list(launches.values()), writebacks=writebacks,
                         states=[self.state[params[pi]] for L in launches.values() for pi in L.index],
                         params=list(params))
        plan.snapshot()
        return plan

    def _run_plan(self, group: dict[str, Any], plan: GroupPlan, grads: list[Tensor | None],
                  grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """The launches of one group: device ops and kernel calls only, no host read-back."""
        for L in plan.launches:
            name = "reference" if L.ref_only else (self._resolved.get(L.device) or self._resolve(L.device))
            self._launch(group, backends.get(name), _advance(L.steps, found_inf, L.step_index), L.masters,
                         plan.grads_for(L, grads), L.exp_avgs, L.exp_avg_sqs, L.max_exp_avg_sqs,
                         L.params16 if L.p16_dtype is not None else None, grad_scale, found_inf)
        for dst, tmp in plan.writebacks:
            dst.copy_(tmp)

    @torch.compiler.disable(reason="zero_kernels: the coded-state step runs eagerly under torch.compile (its "
                            "kernels and codecs are not traced); call it outside a fullgraph=True region")
    def _step_coded(self, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """A step on coded states ([Note: coded state dicts]): every check of every group first; plans as the
        fp32 path's ([Note: launch plans]), rebuilt (and every state checked) when anything moved."""
        self._bump_epoch_if_states_replaced()
        plans, build = {}, {}
        for gi, group in enumerate(self.param_groups):
            grads = [p.grad for p in group["params"]]
            sig = signature(group["params"], grads)
            plan = self._plans.get(gi)
            check_scalars(gi, group)
            check_coded_amsgrad(self._format, f"param_groups[{gi}]: ", group["amsgrad"])
            if isinstance(plan, optim_coded.CodedPlan) and plan.matches(sig, self._epoch):
                plans[gi] = plan
            else:
                check_grads(type(self).__name__, gi, group, grads)
                build[gi] = sig
        if build:
            self._watch_new = True
            for gi, plan in optim_coded.coded_plans(self.param_groups, self.state, self._format, build,
                                                    self._epoch).items():
                plans[gi] = plan
                if plan.cacheable:
                    self._plans[gi] = plan
            self._state_dicts = list(self.state.values())
        self._adopt_edits()
        for gi in sorted(plans):
            for w in plans[gi].work:
                optim_coded.step_coded(self._resolved.get(w.device) or self._resolve(w.device), w,
                                       self.param_groups[gi], grad_scale, found_inf)

    def _bump_epoch_if_states_replaced(self) -> None:
        """A state dict replaced by the user (``opt.state[p] = {...}``): every plan is rebuilt."""
        states = list(self.state.values())
        if len(states) != len(self._state_dicts) or not all(map(operator.is_, states, self._state_dicts)):
            self._epoch += 1

    @staticmethod
    def _launch(group: dict[str, Any], fn: Callable[..., None], steps: Tensor, masters: list[Tensor],
                grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                max_exp_avg_sqs: list[Tensor], params16: list[Tensor] | None, grad_scale: Tensor | None,
                found_inf: Tensor | None) -> None:
        """One kernel call ``fn`` (the fused-Adam contract) with the coefficients of ``steps``, the
        launch's (already advanced) step counters."""
        device = steps.device
        beta1, beta2 = (_scalar(b) for b in group["betas"])
        adamw = bool(group["decoupled_weight_decay"])
        coeffs = compute_coeffs(steps, scalar_lr(group["lr"]), beta1, beta2, group["weight_decay"], adamw,
                                device=device)
        gs = None if grad_scale is None else grad_scale.to(device, torch.float32).reshape(1).reciprocal()
        fi_dev = None if found_inf is None else found_inf.to(device, torch.float32).reshape(1)
        fn(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if group["amsgrad"] else None, params16,
           coeffs, beta1=beta1, beta2=beta2, eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
           adamw=adamw, maximize=bool(group["maximize"]), grad_scale=gs, found_inf=fi_dev)

    def _resolve(self, device: torch.device) -> str:
        pick = optim_coded.resolve_backend if self._format.coded else backends.resolve
        self._resolved[device] = pick(self._backend_request, device)
        return self._resolved[device]

    @property
    def backend(self) -> dict[str, str]:
        """The backend that runs for each device, e.g. ``{"cpu": "cpu"}``."""
        return {str(d): b for d, b in self._resolved.items()}


def _saved_form(opt: FusedAdam, sd: dict[str, Any]) -> dict[str, Any]:
    """FusedAdam.state_dict's post-hook: coded states under their saved names, and the 8-bit code's name."""
    if codecs.holds_u8_moments(sd["state"].values()):
        sd["u8_code"] = codecs.U8_CODE
        for g in sd["param_groups"]:           # torch's DCP state-dict API keeps these ([Note: coded state dicts])
            g["u8_code"] = codecs.U8_CODE
    sd["state"] = {i: _own_step(optim_coded.saved_form(st)) for i, st in sd["state"].items()}
    return sd


def _own_step(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its ``"step"`` in a storage of its own (a new dict; ``state`` itself when it has no tensor
    step). A live step is a view of its launch plan's packed buffer ([Note: launch plans]): pickle writes a view's
    whole storage, so N parameters' state dict would pickle N copies of an N-element buffer."""
    step = state.get("step")
    if not isinstance(step, Tensor):
        return state
    return {**state, "step": step.clone()}


class FusedAdamW(FusedAdam):
    """AdamW (decoupled weight decay, default ``weight_decay=1e-2``) as one fused pass; a drop-in
    for ``torch.optim.AdamW``. See :class:`FusedAdam` for the extra keyword arguments."""

    _decoupled_default = True

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:   # as torch.optim.AdamW: decoupled, whatever a loaded Adam state said
            group["decoupled_weight_decay"] = True

    def __init__(self, params, lr: float | Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 master_weights: bool | None = None, backend: str = "auto",
                 exp_avg_dtype: torch.dtype = torch.float32, exp_avg_sq_dtype: torch.dtype = torch.float32,
                 store_param_remainders: bool = False, min_8bit_size: int = BLOCK) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                         maximize=maximize, capturable=capturable, differentiable=differentiable,
                         fused=fused, decoupled_weight_decay=True, master_weights=master_weights,
                         backend=backend, exp_avg_dtype=exp_avg_dtype, exp_avg_sq_dtype=exp_avg_sq_dtype,
                         store_param_remainders=store_param_remainders, min_8bit_size=min_8bit_size)
