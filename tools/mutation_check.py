#!/usr/bin/env python3
"""Mutation check: does the test suite catch single-line faults in the Adam kernels and the reference,
the codecs, and the ZeRO layer (zero_kernels/zero/: gradient averaging, norms and clipping, loss
scaling, step counts, coded states, ZeRO++, state dicts; the ``zero.*`` faults)?

Not part of CI and not collected by pytest (it lives in tools/, and runs pytest in subprocesses).

    python tools/mutation_check.py                 # every fault (~20-30 min on 2 cores, + ~15 min zero.*)
    python tools/mutation_check.py -k zero.        # the ZeRO layer's faults only
    python tools/mutation_check.py -k eps -k bf16  # faults whose id contains any of these words
    python tools/mutation_check.py --list          # the fault table, with the occurrence check
    python tools/mutation_check.py --jobs 2        # two mutants at a time (one tree copy each)

What it does:
1. Copies the worktree (kernels/, csrc/, zero_kernels/, tests/, setup.py; never .git) into
   ``<workdir>/tree<k>`` and runs every suite below on the unmutated copy (the baseline). A failing
   baseline stops the script: a mutant "caught" by an already-red suite proves nothing.
2. For each fault of FAULTS: the original substring must occur EXACTLY ONCE in the pristine file,
   otherwise the fault is reported as ERROR (never skipped: the kernels are edited concurrently and
   the table is re-pointed after merges). The copy's file is rewritten with the replacement, the
   suite of the fault runs (``pytest -x``, a timeout per mutant), and the file is restored.
   A C++ mutant is first JIT-built on its own (TORCH_EXTENSIONS_DIR keyed by a hash of csrc/, so
   reruns reuse the builds); a mutant that does not build is an ERROR, not a catch. A Python mutant
   that does not compile is an ERROR as well.
3. Prints a table: fault, file, CAUGHT (the first failing test) / MISSED / ERROR, seconds.
   The exit status is 0 only when every fault is caught.

The tree is never mutated in place; PYTHONPATH points at the copy, ZERO_KERNELS_FORCE_JIT=1 makes
the copy's csrc/ the C++ code under test.

Not in the table, on purpose: faults that only the compiled PTX can show. Under TRITON_INTERPRET=1,
``tl.sqrt_rn`` -> ``tl.sqrt`` and ``tl.div_rn`` -> ``/`` (the approximate GPU square root and
division) or a dropped ``enable_fp_fusion=False`` give the same bits as the unmutated kernel, so
no interpreted test can catch them; tests/test_codegen.py checks the PTX for them instead (no
``.approx``, ``div.full``, ``fma`` or ``.ftz``: its [Note: IEEE numerics in the PTX]). Only faults
that change interpreted, C++ or reference results belong in FAULTS.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import os
import queue
import re
import runpy
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------------------- suites
# Test subsets per implementation (pytest arguments, relative to the tree root). Each is the fast
# part of the suite that exercises that implementation against torch.optim / the reference.
SUITES = {
    # the Triton Adam kernel (interpreted): every triton-parametrised test of test_fused_adam.py
    "triton": ["tests/test_fused_adam.py", "-k", "triton"],
    # the reference (and compute_coeffs, used by every backend) against torch.optim
    "reference": ["tests/test_fused_adam.py", "-k", "reference"],
    # compute_coeffs' traced branch (device steps, torch.compile): the Inductor schedules of test_compile.py
    "compile": ["tests/test_compile.py", "-k", "under_inductor"],
    # the C++ CPU kernel: its own tests (bitwise SIMD paths, reference, torch.optim) + the optimizer
    # (-k matches the module name too: all of test_cpu_kernel.py, the [cpu] cases of test_fused_adam)
    "cpu": ["tests/test_cpu_kernel.py", "tests/test_fused_adam.py", "-k", "cpu and not slow and not flatten"],
    # bucket flatten kernels
    "flatten_triton": ["tests/test_zero.py::test_flatten_kernels_interpreter_bitwise"],
    "flatten_cpu": ["tests/test_cpu_kernel.py", "-k", "flatten"],
    # the coded-state Triton kernel (interpreted) against codecs.adam_step_coded, bit for bit
    "coded": ["tests/test_adam_coded.py", "-x", "-W", "ignore::RuntimeWarning"],
    # the Triton Adam kernel's pointer-table paths on misaligned views, one launch and SPLIT_FULL's two
    "triton_align": ["tests/test_alignment_paths.py", "-x"],
    # the C++ coded-state CPU kernel against codecs.adam_step_coded, bit for bit (every SIMD path)
    "cpu_coded": ["tests/test_cpu_coded.py", "-x"],
    # the per-tensor Triton kernel behind torch.ops.zero_kernels.fused_adam_triton (the traced step)
    "ops_triton": ["tests/test_compile.py", "-k", "triton or operator"],
    # the cap on an 8-bit exp_avg ([Note: the bound on 8-bit m]): reference, C++ and Triton on a block where it binds
    "bound": ["tests/test_optim_coded.py", "-x", "-k", "bound", "-W", "ignore::RuntimeWarning"],
    # the ZeRO++ wire codec: Triton kernels (interpreted) and the torch encoder, against codecs.encode_q8
    "wire": ["tests/test_quant_kernels.py", "tests/test_zeropp.py::test_encode_wire_equals_codec_bit_for_bit",
             "-W", "ignore::RuntimeWarning"],
    # the C++ wire codec (csrc/cpu_quant.cpp) against codecs.encode_q8 / decode_q8 (every SIMD path)
    "wire_cpu": ["tests/test_wire_cpu.py", "-x"],
    # --- the ZeRO layer (zero_kernels/zero/): gloo worlds on this machine against one-process torch AdamW
    # ZeRO-1/2 parity at worlds 1-4 (clip, no_sync, groups, bf16, Adam+amsgrad, tied/unused/rank-unused
    # parameters) plus the focused cases of tests/test_zero_faults.py
    "zero12": ["tests/test_zero_faults.py", "tests/test_zero.py::test_parity_world"],
    "zero_owner": ["tests/test_zero.py::test_one_zero_optimizer_per_model_single_process"],
    # ZeRO-3 parity at world 2 (its units' gathers, checkpointed regions, rank-dependent parameters)
    "zero3": ["tests/test_zero3.py::test_zero3_world[2]"],
    # hybrid sharding (2x2, 4x1, 1x4 meshes and odd sizes) against one-process AdamW
    "zero_hybrid": ["tests/test_hybrid.py::test_hybrid_parity_world4",
                    "tests/test_hybrid.py::test_hybrid_odd_sizes_world4"],
    # loss scaling, GradScaler, non-finite skips (one rank poisoned), static scale bitwise, scale updates
    "zero_scaling": ["tests/test_zero_safety.py::test_mixed_precision_safety_world2",
                     "tests/test_zero_safety.py::test_dynamic_scale_follows_torch_amp_update_scale"],
    # zopt.clip_grad_norm_ against DDP + torch clip, and clipping twice / not at all against torch
    "zero_clip": ["tests/test_zero_clip.py", "-k", "matches_ddp or clipping_twice"],
    # coded ZeRO states: the layout's whole blocks, the slice step against the codec bit for bit, the mixed case
    "zero_coded": ["tests/test_zero_coded.py::test_slices_hold_whole_blocks",
                   "tests/test_zero_coded.py::test_slice_step_is_the_codec[3]",
                   "tests/test_zero_coded.py::test_frozen_pieces_of_a_slice_step_through_fp32"],
    # qgZ reduce-scatter and replica average, qwZ gather, at world 3, against the codec reference and bounds
    "zero_pp": ["tests/test_zeropp.py::test_qgz_reduce_scatter_world3",
                "tests/test_zeropp.py::test_qgz_replica_average_world3",
                "tests/test_zeropp.py::test_qwz_gather_world3"],
    # resharding checkpoints (saved at 1, 2, 4 ranks, loaded at 1-4, stages and bucket sizes changed)
    "zero_ckpt": ["tests/test_checkpoint.py::test_reshard_roundtrip_killed"],
    # FSDP2 dim-0 chunks (the DCP re-layout) against torch.chunk
    "zero_chunks": ["tests/test_dcp.py::test_chunk_ranges_are_torch_chunk"],
}

# ----------------------------------------------------------------------------------------- faults
# (id, file, original substring (must occur exactly once), replacement, suite, property broken).
# Keep the substrings short and specific: when a kernel line changes, re-point the entry here.
K, MT, REF = "kernels/adam.py", "kernels/_multi_tensor.py", "zero_kernels/reference.py"
FL, SIMD, CPP = "kernels/flatten.py", "csrc/cpu_adam_simd.h", "csrc/cpu_adam.cpp"
VEC, CFL = "csrc/cpu_vec.h", "csrc/cpu_flatten.cpp"
KC, KCA = "kernels/_codecs.py", "kernels/adam_coded.py"
CCS, CCV, CQ8 = "csrc/cpu_adam_coded_simd.h", "csrc/cpu_coded_vec.h", "csrc/cpu_q8_simd.h"
CWQ = "csrc/cpu_quant.cpp"
KQ, QWZ = "kernels/quant.py", "zero_kernels/zero/qwz.py"
ZC, ZM, ZB, ZH = "zero_kernels/zero/collectives.py", "zero_kernels/zero/mesh.py", "zero_kernels/zero/buckets.py", \
    "zero_kernels/zero/hooks.py"
ZR, ZS, ZO, ZSC = "zero_kernels/zero/reduce.py", "zero_kernels/zero/step.py", "zero_kernels/zero/optimizer.py", \
    "zero_kernels/zero/scaling.py"
ZCF, ZCD, ZQG, ZSD = "zero_kernels/zero/config.py", "zero_kernels/zero/coded.py", "zero_kernels/zero/qgz.py", \
    "zero_kernels/zero/state_dict.py"
ZUB, ZRL, LAY, CKP = "zero_kernels/zero/unit_bucket.py", "zero_kernels/zero/relayout.py", "zero_kernels/layout.py", \
    "zero_kernels/checkpoint.py"
FAULTS = [
    # --- eps placement: torch adds eps AFTER the bias-corrected sqrt: sqrt(v)/bc2_sqrt + eps
    # (kernels/adam.py: root = sqrt(v), or sqrt(vmax) under AMSGRAD, then one denominator line for both)
    ("tri.eps_in_sqrt", K, "denom = tl.div_rn(root, bc2_sqrt) + eps",
     "denom = tl.sqrt_rn(tl.div_rn(root * root, bc2_sqrt * bc2_sqrt) + eps)", "triton", "eps inside the square root"),
    ("tri.eps_in_sqrt.ams", K, "root = tl.sqrt_rn(vmax)", "root = tl.sqrt_rn(vmax + eps * eps)", "triton",
     "eps inside the sqrt (amsgrad)"),
    ("tri.eps_before_bc2", K, "denom = tl.div_rn(root, bc2_sqrt) + eps",
     "denom = tl.div_rn(root + eps, bc2_sqrt)", "triton", "eps added before the bias correction"),
    ("ref.eps_in_sqrt", REF, "(root / bc2_sqrt + eps)",
     "sqrt_rn(denom_v / (bc2_sqrt * bc2_sqrt) + eps)", "reference", "eps inside the square root"),
    ("cpp.eps_in_sqrt.scalar", SIMD, "std::sqrt(vd) / j.bc2 + h.eps",
     "std::sqrt(vd / (j.bc2 * j.bc2) + h.eps)", "cpu", "eps inside the sqrt (scalar tail)"),
    ("cpp.eps_in_sqrt.vector", SIMD, "V::add(V::div(V::sqrt(vd), bc2), eps)",
     "V::sqrt(V::add(V::div(vd, V::mul(bc2, bc2)), eps))", "cpu", "eps inside the sqrt (SIMD body)"),
    # --- maximize: the gradient is negated (after the unscale, before weight decay)
    ("tri.maximize_dropped", K, "g = -g", "g = g", "triton", "maximize negation deleted"),
    ("ref.maximize_dropped", REF, "gf = -gf", "gf = gf", "reference", "maximize negation deleted"),
    ("cpp.maximize_dropped", CPP, "c.h.gscale = maximize ? -gs : gs;", "c.h.gscale = gs;", "cpu",
     "maximize negation deleted"),
    # --- bias corrections: step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t)
    ("coeffs.no_bc1", REF, "step_size = lr_t / bc1", "step_size = lr_t", "reference",
     "step_size without /bc1 (all backends)"),
    ("coeffs.bc1_step_off_by_one", REF, "bc1 = 1 - torch.ones_like(s).mul(beta1).pow(s)",
     "bc1 = 1 - torch.ones_like(s).mul(beta1).pow(s + 1)", "reference",
     "bc1 uses beta1^(t+1)"),
    ("coeffs.bc2_not_sqrt", REF, "bc2.sqrt()", "bc2", "reference", "bc2_sqrt = 1 - beta2^t (no sqrt)"),
    ("tri.no_bc2", K, "denom = tl.div_rn(root, bc2_sqrt) + eps", "denom = root + eps", "triton",
     "missing /bc2_sqrt"),
    ("ref.no_bc2", REF, "(root / bc2_sqrt + eps)", "(root + eps)", "reference",
     "missing /bc2_sqrt"),
    ("cpp.no_bc2.scalar", SIMD, "std::sqrt(vd) / j.bc2 + h.eps", "std::sqrt(vd) + h.eps", "cpu",
     "missing /bc2_sqrt (scalar tail)"),
    ("cpp.no_bc2.vector", SIMD, "V::add(V::div(V::sqrt(vd), bc2), eps)", "V::add(V::sqrt(vd), eps)",
     "cpu", "missing /bc2_sqrt (SIMD body)"),
    # --- weight decay: AdamW p *= 1 - lr*wd BEFORE the update; Adam g += wd*p (L2)
    ("tri.adamw_decay_after", K, "p = p - tl.div_rn(step_size * m, denom)",
     "p = p - decay * tl.div_rn(step_size * m, denom)",
     "triton", "AdamW decay applied after the update"),
    ("tri.adamw_decay_dropped", K, "p = p * decay", "p = p", "triton", "AdamW decay dropped"),
    ("tri.adam_l2_dropped", K, "g = g + weight_decay * p", "g = g", "triton", "Adam L2 term dropped"),
    ("tri.adam_l2_decoupled", K, "g = g + weight_decay * p", "p = p - step_size * weight_decay * p",
     "triton", "Adam L2 applied as decoupled decay"),
    ("ref.adamw_decay_after", REF, "pf = pf - step_size * mf", "pf = pf - decay * step_size * mf",
     "reference", "AdamW decay applied after the update"),
    ("ref.adamw_decay_dropped", REF, "pf = pf * decay", "pf = pf", "reference", "AdamW decay dropped"),
    ("ref.adam_l2_dropped", REF, "gf = gf + weight_decay * pf", "gf = gf", "reference", "Adam L2 term dropped"),
    ("ref.adam_l2_decoupled", REF, "gf = gf + weight_decay * pf", "pf = pf - step_size * weight_decay * pf",
     "reference", "Adam L2 applied as decoupled decay"),
    ("coeffs.decay_without_lr", REF, "(1 - lr_t * weight_decay)", "(1 - weight_decay)", "reference",
     "AdamW decay = 1 - wd (not scaled by lr)"),
    ("coeffs.traced_decay_without_lr", REF, ".mul(lr_t).mul(weight_decay)", ".mul(weight_decay)", "compile",
     "AdamW decay = 1 - wd in the traced branch (a float lr under torch.compile)"),
    ("coeffs.traced_bc2_stale_base", REF, "bc2 = 1 - torch.ones_like(s).mul(beta2).pow(s)",
     "bc2 = 1 - torch.ones_like(s).mul(0.999).pow(s)", "compile",
     "the traced bias correction ignores the group's beta2 (a stale base)"),
    ("cpp.adamw_decay_after.scalar", SIMD, "p = p - (j.step_size * m) / denom;",
     "p = p - j.decay * (j.step_size * m) / denom;", "cpu", "AdamW decay after the update (scalar)"),
    ("cpp.adamw_decay_after.vector", SIMD, "p = V::sub(p, V::div(V::mul(ss, m), denom));",
     "p = V::sub(p, V::mul(decay, V::div(V::mul(ss, m), denom)));", "cpu",
     "AdamW decay after the update (SIMD)"),
    ("cpp.adamw_decay_dropped.scalar", SIMD, "p = p * j.decay;", "p = p;", "cpu", "AdamW decay dropped (scalar)"),
    ("cpp.adamw_decay_dropped.vector", SIMD, "p = V::mul(p, decay);", "p = p;", "cpu", "AdamW decay dropped (SIMD)"),
    ("cpp.adam_l2_dropped.scalar", SIMD, "if (L2) g = g + h.wd * p;", "if (L2) g = g;", "cpu",
     "Adam L2 term dropped (scalar)"),
    ("cpp.adam_l2_dropped.vector", SIMD, "if (L2) g = V::add(g, V::mul(wd, p));", "if (L2) g = g;", "cpu",
     "Adam L2 term dropped (SIMD)"),
    ("cpp.adam_l2_decoupled.scalar", SIMD, "if (L2) g = g + h.wd * p;",
     "if (L2) p = p - j.step_size * h.wd * p;", "cpu", "Adam L2 as decoupled decay (scalar)"),
    ("cpp.adam_l2_decoupled.vector", SIMD, "if (L2) g = V::add(g, V::mul(wd, p));",
     "if (L2) p = V::sub(p, V::mul(V::mul(ss, wd), p));", "cpu", "Adam L2 as decoupled decay (SIMD)"),
    # --- amsgrad: vmax = max(vmax, v) and the denominator uses vmax
    ("tri.ams_max_to_v", K, "vmax = tl.maximum(vmax, v, propagate_nan=tl.PropagateNan.ALL)", "vmax = v", "triton", "amsgrad max replaced by v"),
    ("tri.ams_max_to_min", K, "vmax = tl.maximum(vmax, v,", "vmax = tl.minimum(vmax, v,", "triton",
     "amsgrad max replaced by min"),
    ("tri.ams_denom_uses_v", K, "root = tl.sqrt_rn(vmax)", "root = tl.sqrt_rn(v)", "triton",
     "amsgrad denominator uses v"),
    ("ref.ams_max_to_v", REF, "vmax = torch.maximum(max_exp_avg_sqs[i].float(), vf)", "vmax = vf",
     "reference", "amsgrad max replaced by v"),
    ("ref.ams_max_to_min", REF, "torch.maximum(max_exp_avg_sqs[i].float(), vf)",
     "torch.minimum(max_exp_avg_sqs[i].float(), vf)", "reference", "amsgrad max replaced by min"),
    ("cpp.ams_max_to_v.scalar", SIMD, "const float vm = zk_max_nan(j.vmax[i], v);", "const float vm = v;", "cpu", "amsgrad max -> v (scalar)"),
    ("cpp.ams_max_to_min.scalar", SIMD, "const float vm = zk_max_nan(j.vmax[i], v);",
     "const float vm = j.vmax[i] < v ? j.vmax[i] : v;", "cpu",
     "amsgrad max -> min (scalar)"),
    ("cpp.ams_denom_uses_v.scalar", SIMD, "vd = vm;", "vd = v;", "cpu", "amsgrad denominator uses v (scalar)"),
    ("cpp.ams_max_to_v.vector", SIMD, "vd = V::max(V::load(j.vmax + i), v);", "vd = v;", "cpu",
     "amsgrad max -> v (SIMD)"),
    # --- bf16 rounding: round to nearest even on the bits: (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    ("tri.bf16_truncate", MT, "rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16", "rounded = bits >> 16",
     "triton", "bf16 truncation instead of RNE"),
    ("tri.bf16_no_tie_bit", MT, "(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16", "(bits + 0x7FFF) >> 16",
     "triton", "bf16 ties rounded down (tie bit dropped)"),
    ("tri.bf16_half_up", MT, "(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16", "(bits + 0x8000) >> 16",
     "triton", "bf16 ties rounded away (+0x8000)"),
    ("cpp.bf16_truncate.scalar", VEC, "u += 0x7FFFu + ((u >> 16) & 1u);", "u += 0u;", "cpu",
     "bf16 truncation (scalar tail and scalar path)"),
    ("cpp.bf16_no_tie_bit.scalar", VEC, "u += 0x7FFFu + ((u >> 16) & 1u);", "u += 0x7FFFu;", "cpu",
     "bf16 tie bit dropped (scalar)"),
    ("cpp.bf16_no_tie_bit.avx2", VEC, "_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb)",
     "_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF))", "cpu", "bf16 tie bit dropped (AVX2)"),
    ("cpp.bf16_no_tie_bit.avx512", VEC, "_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb)",
     "_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF))", "cpu", "bf16 tie bit dropped (AVX-512)"),
    # --- grad scale: g = g * grad_scale first
    ("tri.grad_scale_dropped", K, "g = g * grad_scale", "g = g", "triton", "grad scale not applied"),
    ("tri.grad_scale_divides", K, "g = g * grad_scale", "g = g / grad_scale", "triton",
     "grad scale applied as division"),
    ("ref.grad_scale_dropped", REF, "gf = gf * grad_scale.reshape(())", "gf = gf + 0 * grad_scale.reshape(())",
     "reference", "grad scale not applied"),
    ("ref.grad_scale_divides", REF, "gf = gf * grad_scale.reshape(())", "gf = gf / grad_scale.reshape(())",
     "reference", "grad scale applied as division"),
    ("cpp.grad_scale_dropped", CPP, "float gs = grad_scale.has_value() ? grad_scale->data_ptr<float>()[0] : 1.0f;",
     "float gs = 1.0f;", "cpu", "grad scale not applied"),
    ("cpp.grad_scale_divides", CPP, "? grad_scale->data_ptr<float>()[0] : 1.0f;",
     "? 1.0f / grad_scale->data_ptr<float>()[0] : 1.0f;", "cpu", "grad scale applied as division"),
    # --- 1 - beta1 / 1 - beta2 swapped (each moment separately)
    ("tri.m_uses_beta2", K, "m = m + one_minus_beta1 * (g - m)", "m = m + one_minus_beta2 * (g - m)", "triton",
     "first moment with 1-beta2"),
    ("tri.v_uses_beta1", K, "one_minus_beta2 * g * g", "one_minus_beta1 * g * g", "triton",
     "second moment with 1-beta1"),
    ("ref.m_uses_beta2", REF, "mf = mf + one_minus_beta1", "mf = mf + one_minus_beta2", "reference",
     "first moment with 1-beta2"),
    ("ref.v_uses_beta1", REF, "one_minus_beta2 * gf * gf", "one_minus_beta1 * gf * gf", "reference",
     "second moment with 1-beta1"),
    ("cpp.m_uses_beta2", CPP, "c.h.omb1 = static_cast<float>(1.0 - beta1);",
     "c.h.omb1 = static_cast<float>(1.0 - beta2);", "cpu", "first moment with 1-beta2"),
    ("cpp.v_uses_beta1", CPP, "c.h.omb2 = static_cast<float>(1.0 - beta2);",
     "c.h.omb2 = static_cast<float>(1.0 - beta1);", "cpu", "second moment with 1-beta1"),
    # --- found_inf: a nonzero found_inf skips the whole step
    ("tri.found_inf_ignored", K, "if tl.load(found_inf_ptr) != 0:\n            return\n    t, start",
     "if tl.load(found_inf_ptr) < 0:\n            return\n    t, start", "triton", "found_inf ignored"),
    ("tri.found_inf_ignored.per_tensor", K, "if tl.load(found_inf_ptr) != 0:\n            return\n    start =",
     "if tl.load(found_inf_ptr) < 0:\n            return\n    start =", "ops_triton",
     "found_inf ignored (per-tensor kernel of the traced step)"),
    ("cpp.found_inf_ignored", CPP, "found_inf->data_ptr<float>()[0] != 0.0f", "found_inf->data_ptr<float>()[0] < 0.0f",
     "cpu", "found_inf ignored"),
    # --- bucket flatten: dst = (src * scale) [+ dst]
    ("flat.scale_dropped.full", FL, "x = tl.load(src + offs).to(tl.float32) * scale",
     "x = tl.load(src + offs).to(tl.float32)", "flatten_triton", "scale dropped (full blocks)"),
    ("flat.scale_dropped.masked", FL, "x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32) * scale",
     "x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)", "flatten_triton", "scale dropped (tail)"),
    ("flat.accumulate_overwrites.full", FL, "x = x + tl.load(d + offs).to(tl.float32)", "x = x",
     "flatten_triton", "accumulate replaced by overwrite (full blocks)"),
    ("flat.accumulate_overwrites.masked", FL, "x = x + tl.load(d + offs, mask=mask, other=0.0).to(tl.float32)",
     "x = x", "flatten_triton", "accumulate replaced by overwrite (tail)"),
    ("cflat.scale_dropped.scalar", CFL, "if (SCALE) x = x * scale;", "if (SCALE) x = x;        ", "flatten_cpu",
     "C++ flatten scale dropped (scalar)"),
    ("cflat.scale_dropped.vector", CFL, "if (SCALE) x = V::mul(x, s);", "if (SCALE) x = x;           ",
     "flatten_cpu", "C++ flatten scale dropped (SIMD)"),
    # --- coded states ([Note: state codecs]): each codec rule of the Triton kernel
    ("cod.sr_bits_shift", KC, "r = fmix32(idx ^ key) >> 16", "r = fmix32(idx ^ key) >> 17", "coded",
     "bf16 SR with 15 random bits: biased rounding"),
    ("cod.sr_not_per_element", KC, "idx = ((offs + index_offset)", "idx = ((offs * 0 + index_offset)", "coded",
     "bf16 SR bits not keyed by the element index"),
    ("cod.m8_dither_dropped", KC, "code = (q + r.to(tl.int32)) >> M8_DITHER_BITS",
     "code = (q + (1 << 14)) >> M8_DITHER_BITS", "coded", "8-bit exp_avg rounded to nearest: no stochastic rounding"),
    ("cod.m8_dither_not_per_element", KC, "idx = ((index_offset + offs)", "idx = ((index_offset + offs * 0)",
     "coded", "8-bit exp_avg dither bits not keyed by the element index"),
    ("ccod.m8_dither_dropped", CCS, "Q::srai<15>(Q::addi(q, r))", "Q::srai<15>(Q::addi(q, Q::set1i(1u << 14)))",
     "cpu_coded", "C++ 8-bit exp_avg rounded to nearest: no stochastic rounding"),
    ("cod.m_bound_dropped", K, "    if BOUND_M:\n", "    if False:\n", "bound", "Triton: the 8-bit m cap not applied"),
    ("cod.m_bound_sign", K, "tl.where(m < 0.0, -bound, bound)", "tl.where(m < 0.0, bound, bound)", "bound",
     "Triton: a capped negative m turned positive"),
    ("ccod.m_bound_dropped", CCS, "  if (k.bound_m) mv = Q8 ?", "  if (false) mv = Q8 ?", "bound",
     "C++: the 8-bit m cap not applied"),
    ("ccod.m_bound_range_sign", CCV, "_mm512_range_ps(m, b, 0x02)", "_mm512_range_ps(m, b, 0x06)", "bound",
     "C++ AVX-512: the capped m takes the bound's sign (VRANGEPS sign control)"),
    ("ref.m_bound_dropped", REF, "        if bound_m:\n", "        if False:\n", "bound",
     "reference: the 8-bit m cap not applied"),
    # (the table codec's search, shared by the ZeRO++ wire codec since the step's 8-bit codec became arithmetic)
    ("cod.q8_tie_up", KC, "code = tl.where(mid < y, code + step, code)", "code = tl.where(mid <= y, code + step, code)",
     "wire", "8-bit table code of a value on a midpoint takes the upper entry"),
    ("cod.q8_nan_code", KC, "return tl.where(y != y, 255, code).to(tl.uint8)", "return code.to(tl.uint8)", "wire",
     "NaN coded 0 instead of torch.bucketize's 255"),
    ("cod.scale_low_bit", KC, "x.to(tl.int32, bitcast=True) & 0x7FFFFFFF", "x.to(tl.int32, bitcast=True) & 0x7FFFFFFE",
     "coded", "block scale not the exact absmax"),
    ("cod.f8_ties_up", KC, "+ 0x7FFFF + ((a >> 20) & 1)) >> 20", "+ 0x80000) >> 20", "coded",
     "fp8 ties round up instead of to even"),
    ("cod.f8_scale_480", KCA, "scale = tl.div_rn(scale, F8_MAX)", "scale = tl.div_rn(scale, 480.0)", "coded",
     "fp8 block scale from 480 instead of 448"),
    ("cod.remainder_tie_wraps", KC, "rem = tl.minimum((b - (hi << 16)).to(tl.int32, bitcast=True), 0x7FFF)",
     "rem = (b - (hi << 16)).to(tl.int32, bitcast=True)", "coded", "remainder tie 0x8000 wraps to -0x8000"),
    ("cod.remainder_truncates", KC, "hi = (b + 0x7FFF + ((b >> 16) & 1)) >> 16", "hi = b >> 16", "coded",
     "bf16 parameter truncated instead of rounded to nearest even"),
    ("cod.nan_scale_payload", KC, "return tl.where(m > 0x7F800000, 0x7FC00000, m)", "return m", "coded",
     "NaN block scale keeps the largest payload instead of torch.amax's 0x7FC00000"),
    ("cod.scale_lane", KCA, "keep = lane == 0", "keep = lane == 1", "coded",
     "block scale stored by lane 1 (one slot past its block) instead of lane 0"),
    ("cod.tile_h_stride", KCA, "h = tl.arange(0, QBLOCK // L).to(tl.int64) * L", "h = tl.arange(0, QBLOCK // L).to(tl.int64) * 32",
     "coded", "tile steps of 32 elements instead of L: rows overlap and skip elements"),
    ("cod.store_param_dropped", KCA, "_store_param(p, a_master, a_p16, offs, mask, MASKED, P16_KIND, MASTER_KIND, ALIGNED)\n    _store_moment",
     "_store_moment", "coded", "the parameter not stored before the moments (8-bit / bf16 / fp32 states)"),
    ("cod.full_takes_tail", MT, "whole = n // chunk if ok else 0", "whole = -(-n // chunk) if ok else 0", "coded",
     "a tensor's partial last chunk sent to the FULL launch (128-bit unmasked path past the tensor's end)"),
    ("cod.full_ignores_grad_alignment", KCA, "return aligned_columns(rows, _COLS, (0, 1, 2, 3, 6))",
     "return aligned_columns(rows, _COLS, (0, 2, 3, 6))", "coded",
     "a tensor whose gradient is misaligned sent to the FULL launch"),
    ("cod.pipeline_rows_of_next_tile", KCA, "cur_offs, None, cur_rows,", "cur_offs, None, rows,", "coded",
     "the pipelined FULL launch stores tile i's block scales at tile i + 1's rows"),
    ("ad.rest_launch_full", MT, "launches = ((full, True), (rest, False))", "launches = ((full, True), (rest, True))",
     "triton_align", "SPLIT_FULL: the rest chunks (tails, misaligned tensors) launched on the 128-bit-only kernel"),
    ("ad.full_ignores_p16_alignment", K, "(_MASTER, _GRAD, _EXP_AVG, _EXP_AVG_SQ, _MAX_SQ, _P16)",
     "(_MASTER, _GRAD, _EXP_AVG, _EXP_AVG_SQ, _MAX_SQ)", "triton_align",
     "SPLIT_FULL: a tensor whose bf16 copy is misaligned sent to the FULL launch"),
    ("cod.sr_key_streams_swapped", KCA, "m_key, v_key = sr_key(seed, count, 0), sr_key(seed, count, 1)",
     "m_key, v_key = sr_key(seed, count, 1), sr_key(seed, count, 0)", "coded",
     "the SR keys of exp_avg and exp_avg_sq swapped (kernel-side key derivation)"),
    ("cod.sr_key_step_not_doubled", KC, "fmix32(step.to(tl.uint32) * 2 + STREAM)",
     "fmix32(step.to(tl.uint32) + STREAM)", "coded", "SR key from step + stream instead of 2 * step + stream"),
    ("ccod.sr_key_step_not_doubled", "csrc/cpu_adam_coded.cpp", "zk_scalar::zk_c_fmix32(2u * step + stream)",
     "zk_scalar::zk_c_fmix32(step + stream)", "cpu_coded",
     "C++ SR key from step + stream instead of 2 * step + stream"),
    # --- the C++ coded-state CPU kernel (csrc/cpu_adam_coded*.h)
    ("ccod.fused_v_codes_from_m", CCS, "vcode[u] = zk_v8_code_bits(bs + i, v_key);",
     "vcode[u] = zk_v8_code_bits(bm + i, v_key);", "cpu_coded",
     "C++ 8-bit block (AVX-512 / AVX2 pairs): v codes of the second pass taken from m's buffer"),
    ("ccod.fused_v_codes_from_m.scalar", CCS, "zk_v8_code1(bs + i, v_key, vc + i);",
     "zk_v8_code1(bm + i, v_key, vc + i);", "cpu_coded",
     "C++ 8-bit block (scalar path): v codes of the second pass taken from m's buffer"),
    ("ccod.split_nan_rule_skipped", CCV, "_CMP_UNORD_Q) != 0, 0)) {", "_CMP_UNORD_Q) != 0, 0) && false) {",
     "cpu_coded", "C++ AVX-512 remainder split: a NaN master's bf16 / remainder taken from its bits"),
    ("ccod.bf16_nan_rule_skipped", CCV, "_CMP_UNORD_Q) != 0, 0))  // as split2", "_CMP_UNORD_Q) != 0, 0) && false)  // as split2",
     "cpu_coded", "C++ AVX-512 bf16 copy of two vectors: a NaN master rounded like a number (0x7FFFFFFF -> -0)"),
    ("ccod.pow2_bc2_inverse_dropped", CCS, "V::set1(pow2 ? 1.0f / j.bc2 : 1.0f)", "V::set1(1.0f)", "cpu_coded",
     "C++ coded step, bc2 a power of two: sqrt(v) multiplied by 1 instead of 1 / bc2"),
    ("ccod.pow2_bc2_any_value", CCS, "const bool pow2 = zk_pow2_normal(j.bc2);", "const bool pow2 = j.bc2 > 0.0f;",
     "cpu_coded", "C++ coded step: every bc2 divided by multiplying with its rounded reciprocal (not exact)"),
    ("ccod.v_scale_signed_max", CCS, "as = Q::maxu(as, Q::bi(sq));", "as = Q::maxi(as, Q::bi(sq));", "cpu_coded",
     "C++ 8-bit v scale by a signed max: a sign-bit NaN sqrt(v) does not poison its block"),
    ("ccod.bf16_grad_pair_shifted", CCV, "_mm512_add_epi16(idx, _mm512_set1_epi16(16)), g)",
     "_mm512_add_epi16(idx, _mm512_set1_epi16(15)), g)", "cpu_coded",
     "C++ AVX-512 bf16 gradient pair: the second vector one element early"),
    ("ccod.join_rare_inf_missed", CCV, "_mm512_set1_epi16(0x7F7F)) != 0, 0)) {",
     "_mm512_set1_epi16(0x7F80)) != 0, 0)) {", "cpu_coded",
     "C++ AVX-512: the remainder join's rare rule skipped under hi = +-inf (a positive rem makes it NaN)"),
    ("ccod.tie_parity_dropped", CCV, "_mm512_adds_epu16(lo, _mm512_and_si512(hi, _mm512_set1_epi16(1)))",
     "_mm512_adds_epu16(lo, _mm512_and_si512(hi, _mm512_set1_epi16(0)))", "cpu_coded",
     "C++ AVX-512: bf16 / remainder split rounds ties down, not to even"),
    ("ccod.avx2_tie_parity_dropped", CCV, "_mm256_adds_epu16(lo, _mm256_and_si256(hi, _mm256_set1_epi16(1)))",
     "_mm256_adds_epu16(lo, _mm256_set1_epi16(1))", "cpu_coded",
     "C++ AVX2 16-bit-lane rounding: a tie under an even bf16 rounded up"),
    ("ccod.avx2_split_nan_skipped", CCV, "if (__builtin_expect(nan_any(x0, x1), 0)) {", "if (false) {", "cpu_coded",
     "C++ AVX2 remainder split: a NaN master's bf16 / remainder taken from its bits"),
    ("ccod.avx2_bf16_nan_skipped", CCV, "_mm256_set1_epi16(0x0040)), nan_words(x0, x1));",
     "_mm256_set1_epi16(0x0040)), _mm256_setzero_si256());", "cpu_coded",
     "C++ AVX2 bf16 copy of two vectors: a NaN master rounded like a number"),
    ("ccod.avx2_join_sign_dropped", CCV, "h = _mm256_add_epi16(h, _mm256_cmpgt_epi16(_mm256_setzero_si256(), r));",
     "", "cpu_coded", "C++ AVX2 remainder join: a negative remainder not borrowed from the bf16 word"),
    ("ccod.avx2_code_bytes_order", CCV, "_mm256_packus_epi16(w, w), 0x08)", "_mm256_packus_epi16(w, w), 0x02)",
     "cpu_coded", "C++ AVX2 code pair store: the second 8 codes replaced by the first"),
    ("ccod.b16_v_key_from_m", CCS, "zk_c_sr_bf16(vv, idx, vkey, vb + i);", "zk_c_sr_bf16(vv, idx, mkey, vb + i);",
     "cpu_coded", "C++ fused bf16-moment block: v rounded with m's stochastic-rounding key"),
    ("ccod.b16_index_step", CCS, "++u, idx = Q::addi(idx, Q::set1i(V::W)))", "++u, idx = Q::addi(idx, Q::set1i(V::W - 1)))",
     "cpu_coded", "C++ fused bf16-moment block: stochastic-rounding indices advance by W - 1"),
    ("ccod.sr_carry_dropped", CCS, "Q::shr<16>(Q::addi(Q::bi(v), r))", "Q::shr<16>(Q::bi(v))", "cpu_coded",
     "C++ bf16 moment truncated instead of stochastically rounded"),
    ("ccod.nan_scale_payload", CQ8, "if (u > 0x7F800000u) u = 0x7FC00000u;", "", "cpu_coded",
     "C++ NaN block scale keeps the largest payload"),
    ("ccod.f8_scale_480", CCS, "zk_q8_absmax(x) / 448.0f", "zk_q8_absmax(x) / 480.0f", "cpu_coded",
     "C++ fp8 block scale from 480 instead of 448"),
    ("ccod.avx512_level0_swapped", CCV, "perm32(t.tail[4], j), perm32(t.tail[5], j)",
     "perm32(t.tail[5], j), perm32(t.tail[4], j)", "wire_cpu",
     "C++ AVX-512 8-bit table search (the wire codec's): level-0 candidates swapped"),

    # --- ZeRO++ wire codec (qwZ / qgZ): the Triton kernels and the torch encoder
    ("wire.decode_accumulate_overwrites", KQ, "y = ld(out_ptr, offs, mask, MASKED) + y", "y = y", "wire",
     "qgZ decode-accumulate overwrites instead of adding"),
    ("wire.decode_scale_dropped", KQ, "scale[:, None], table_ptr)", "scale[:, None] * 0 + 1.0, table_ptr)", "wire",
     "decode ignores the block scale"),
    ("wire.encode_scale_stored_wrong", KQ, "st(scales_ptr, rows, scale,", "st(scales_ptr, rows, scale * 2.0,", "wire",
     "encode stores a scale other than the block absmax"),
    ("wire.torch_tie_correction", QWZ, "c -= (mid[c] >= y).long()", "c -= (mid[c] > y).long()", "wire",
     "torch encoder: a value on a midpoint takes the upper code"),
    ("wire.torch_nan_code", QWZ, ".nan_to_num_(255.0)", ".nan_to_num_(0.0)", "wire",
     "torch encoder: NaN coded 0 instead of 255"),
    # --- the C++ wire codec (csrc/cpu_quant.cpp over the shared block codec csrc/cpu_q8_simd.h)
    ("cwire.nan_code", CQ8, "Q::seli(Q::isnan(y), Q::set1i(255), Q::q8_code(lv, y))", "Q::q8_code(lv, y)",
     "wire_cpu", "C++ encoder: NaN coded 0 instead of 255"),
    ("cwire.accumulate_overwrites", CQ8, "ACC ? Q::add(Q::ldf(out + i), x) : x", "x", "wire_cpu",
     "C++ decode-accumulate overwrites instead of adding"),
    ("cwire.partial_padding", CWQ, "if (n < ZK_QBLOCK) std::memset(buf, 0, sizeof(float) * ZK_QBLOCK);", "",
     "wire_cpu", "C++ encoder: a partial block's padding is not zeroed (stale values enter its scale)"),
    ("cwire.bf16_widen", CWQ, "buf[i] = XT == ZK_BF16 ? zk_bf16_to_f32(p[i])", "buf[i] = XT == ZK_BF16 ? 0.0f",
     "wire_cpu", "C++ encoder: bf16 tail elements read as zero"),

    # --- the ZeRO layer: gradient averaging and data movement
    ("zero.owner_check_skipped", "zero_kernels/zero/build.py", "error = owner_error(mp.uniq) or model_error(",
     "error = None or model_error(", "zero_owner",
     "a second ZeroAdamW binds a model the first still manages ([Note: one ZeroAdamW per parameter])"),
    ("zero.owner_release_skipped", "zero_kernels/zero/optimizer.py", "release(self._claimed, self._claim)", "pass",
     "zero_owner", "remove_hooks() leaves the claim: the model can never take a new ZeroAdamW"),
    ("zero.stage3_detached_state_dict_unguarded", "zero_kernels/zero/stage3.py",
     "self._state_dict_hook = self.ctx.model.register_state_dict_pre_hook(_detached_guard)", "pass", "zero_owner",
     "after remove_hooks() at stage 3, model.state_dict() returns the 0-element placeholders without a word"),
    ("zero.rs_divides_twice", ZC, "output.div_(n)", "output.div_(n * n)", "zero12",
     "gloo reduce-scatter divides the sum by the world size twice"),
    ("zero.rs_drops_a_peer", ZC, "for b in bufs[1:]:", "for b in bufs[2:]:", "zero12",
     "gloo reduce-scatter leaves out one peer's copy (world >= 3)"),
    ("zero.replicate_not_averaged", ZM, "t.div_(mesh.replicate_size)", "t.div_(1)", "zero_hybrid",
     "hybrid replicate all-reduce sums the replicas without averaging"),
    ("zero.replicate_wrong_group_size", ZM, "t.div_(mesh.replicate_size)",
     "t.div_(C.group_size(mesh.shard_group))", "zero_hybrid",
     "hybrid replicate average divides by the shard group's size"),
    ("zero.missing_grad_not_zeroed", ZB, "buf[ps.offset:ps.offset + ps.numel].zero_()", "pass", "zero12",
     "a parameter without a gradient sends the stale contents of a recycled buffer"),
    ("zero.no_sync_overwrites", ZH, "dst.add_(g)", "dst.copy_(g)", "zero12",
     "stage 2/3: a no_sync micro-batch's gradient overwrites the accumulated one"),
    ("zero.slice_accumulate_overwrites", ZH, "b.reduce.grad_slice.add_(b.reduce.pending_add)",
     "b.reduce.grad_slice.copy_(b.reduce.pending_add)", "zero12",
     "stage 2/3: a second backward without no_sync replaces the reduced slice instead of adding"),
    ("zero.stage1_views_cast_skipped", ZR, "return buf.copy_(flat)", "return buf", "zero12",
     "stage 1 views path with 16-bit grads: the cast copy into the send buffer is skipped"),
    ("zero.stage1_flags_always_active", ZR, "flags[b.spec.params[li]] = int(p.grad is not None)",
     "flags[b.spec.params[li]] = 1", "zero12",
     "stage 1: a parameter without a gradient counts as active (stepped, decayed)"),
    # --- global norm and clipping
    ("zero.norm_local_only", ZS, "C.all_reduce_tensor(acc, op=dist.ReduceOp.SUM, group=process_group)", "None",
     "zero12", "gradient norm of this rank's slices only (no all-reduce)"),
    ("zero.norm_no_root", ZS, "return acc.pow(1.0 / norm_type)", "return acc", "zero12",
     "gradient norm without the p-th root"),
    ("zero.norm_drops_last_element", LAY, "return min(s, self.numel), min(e, self.numel)",
     "return min(s, self.numel), min(e, self.numel - 1)", "zero12",
     "data bounds (norm, non-finite check) leave out each bucket's last element"),
    ("zero.clip_coef_unclamped", ZO, "torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)",
     "float(max_norm) / (total + 1e-6)", "zero_clip", "clip coefficient not clamped to 1 (small gradients scaled up)"),
    ("zero.clip_norm_still_scaled", ZO, "total = total / ls", "total = total", "zero_scaling",
     "clip norm measured on the loss-scaled gradients"),
    # --- loss scaling and non-finite skips
    ("zero.unscale_multiplies", ZSC, "1.0 / self.loss_scaler.scale", "self.loss_scaler.scale", "zero_scaling",
     "loss-scale unscale multiplies by the scale instead of 1/scale"),
    ("zero.found_inf_ignored", ZO, "if not skip:", "if True:", "zero_scaling",
     "a non-finite step is applied instead of skipped"),
    ("zero.skip_needs_every_rank", ZSC, "all_reduce_everywhere(flag, dist.ReduceOp.MAX, self.mesh)",
     "all_reduce_everywhere(flag, dist.ReduceOp.MIN, self.mesh)", "zero_scaling",
     "non-finite flag reduced with MIN: one rank's inf does not skip the step"),
    # --- step counts and runs
    ("zero.steps_advance_without_grad", ZO, "for i in active.nonzero().flatten().tolist():",
     "for i in range(len(self.steps)):", "zero12",
     "every parameter's step count advances, with a gradient or not"),
    ("zero.runs_merge_step_counts", ZS, "runs[-1][1] == pc.start and runs[-1][2] == st",
     "runs[-1][1] == pc.start", "zero12",
     "adjacent pieces with different step counts merged into one run (one bias correction)"),
    # --- coded states, ZeRO++
    ("zero.coded_alignment_dropped", ZCF,
     "return max(self.alignment_bytes, BLOCK * 4) if blockwise else self.alignment_bytes",
     "return self.alignment_bytes", "zero_coded", "blockwise states without the world x 256 bucket alignment"),
    ("zero.coded_step_off_by_one", ZCD, "float(step - 1)", "float(step)", "zero_coded",
     "coded slice step handed step t instead of t - 1 (bias corrections one step ahead)"),
    ("zero.qgz_not_averaged", ZQG, "return acc.div_(n)", "return acc", "zero_pp",
     "qgZ reduce-scatter sums the decoded peers without averaging"),
    ("zero.qwz_own_slice_exact", QWZ, "if j != rank or not own_exact:", "if j != rank:", "zero_pp",
     "hierarchical qgZ: a rank keeps its own slice exact (ranks disagree bitwise)"),
    # --- state dicts, checkpoints, stage-3 gathers, dim-0 chunks
    ("zero.load_params16_stale", ZSD, "b.owned_params.copy_(b.master)", "b.owned_params.copy_(b.owned_params)",
     "zero_scaling", "load_state_dict: 16-bit working slice not set from the loaded master"),
    ("zero.reshard_piece_offset", CKP, "sp.offset + pc.param_start", "sp.offset + pc.start", "zero_ckpt",
     "resharding load reads a piece at its slice offset instead of its parameter offset"),
    ("zero.s3_gather_stale_own_shard", ZUB, "flat[self.slice_start:self.slice_end].copy_(self.shard)", "None",
     "zero3", "stage-3 gather: this rank's updated shard not copied into the gathered buffer"),
    ("zero.dim0_chunk_floor", ZRL, "c = -(-d0 // world)", "c = d0 // world", "zero_chunks",
     "FSDP2 dim-0 chunk rows rounded down (torch.chunk rounds up)"),
]


@dataclass
class Fault:
    id: str
    file: str
    old: str
    new: str
    suite: str
    what: str


@dataclass
class Result:
    fault: Fault
    status: str       # CAUGHT / MISSED / ERROR
    detail: str
    seconds: float


# ----------------------------------------------------------------------------------------- tree
COPY = ["kernels", "csrc", "zero_kernels", "tests", "setup.py", "README.md"]


def make_tree(dst: str) -> None:
    """A fresh copy of the worktree at a fixed path (fixed paths + preserved mtimes let the C++
    build cache of a previous run be reused). One run at a time per --workdir."""
    if os.path.exists(dst):
        shutil.rmtree(dst)
    os.makedirs(dst)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "build", "*.egg-info")
    for name in COPY:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dst, name), symlinks=True, ignore=ignore)
        elif os.path.exists(src):
            shutil.copy2(src, os.path.join(dst, name))


def csrc_hash(tree: str) -> str:
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(os.path.join(tree, "csrc"))):
        for f in sorted(files):
            if f.endswith((".cpp", ".h", ".cu", ".cuh")):
                h.update(f.encode())
                with open(os.path.join(dirpath, f), "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()[:16]


def ext_dir(tree: str, ext_root: str) -> str:
    """TORCH_EXTENSIONS_DIR of a tree copy with its current csrc/ (one build per content)."""
    return os.path.join(ext_root, f"{os.path.basename(tree)}-{csrc_hash(tree)}")


def mutant_mtime(baseline_dir: str) -> float:
    """The mtime to give a mutated C++ file whose build starts from the baseline's objects (see
    copy_build): newer than every baseline object (ninja rebuilds its dependents) and
    stable across runs (a cached mutant build stays up to date)."""
    newest = max(os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(baseline_dir) for f in fs)
    return newest + 1.0


def copy_build(baseline_dir: str, dst: str) -> None:
    """Start a mutant's build directory from the baseline's objects, so that ninja (header deps
    included) recompiles only the translation units the mutation touches."""
    if not os.path.exists(dst):
        shutil.copytree(baseline_dir, dst, symlinks=True,
                        ignore=shutil.ignore_patterns("lock", "*.so"))


def env_for(tree: str, ext_root: str) -> dict:
    env = dict(os.environ)
    env.update(PYTHONPATH=tree, TRITON_INTERPRET="1", ZK_REQUIRE_CPU="1", ZERO_KERNELS_FORCE_JIT="1",
               TORCH_EXTENSIONS_DIR=ext_dir(tree, ext_root), PYTHONDONTWRITEBYTECODE="1")
    env.pop("ZERO_KERNELS_NO_JIT", None)
    return env


def jit_name(tree: str) -> str:
    """The tree's JIT build directory name (zero_kernels._build.jit_name for the tree's csrc/; the tree's own
    _build.py is run, as setup.py does, so the rule lives in one place)."""
    return runpy.run_path(os.path.join(tree, "zero_kernels", "_build.py"))["jit_name"](tree)

BUILD = ("from zero_kernels import _ext; import sys; m = _ext.cpu_module(); "
         "sys.exit(0 if m is not None else 'build failed: ' + _ext.load_error())")


def build_ext(tree: str, ext_root: str, timeout: float) -> str | None:
    """JIT-build (or reuse) the copy's C++ extension. None on success, else the reason; a failed
    build's directory is removed so that it cannot poison a later run's cache."""
    build_dir = os.path.join(ext_dir(tree, ext_root), jit_name(tree))
    stale = os.path.join(build_dir, "lock")   # torch's build baton, left behind by a killed run
    if os.path.exists(stale):
        os.remove(stale)
    try:
        r = subprocess.run([sys.executable, "-c", BUILD], cwd=tree, env=env_for(tree, ext_root),
                           capture_output=True, text=True, timeout=timeout)
        why = None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1][:200]
    except subprocess.TimeoutExpired:
        why = f"build timed out after {timeout:.0f}s"
    if why is not None:
        shutil.rmtree(os.path.dirname(build_dir), ignore_errors=True)
    return why


FAILED_RE = re.compile(r"^(FAILED|ERROR) (\S+)", re.M)


def run_suite(tree: str, ext_root: str, suite: str, timeout: float) -> tuple[str, str]:
    """('pass'|'fail'|'timeout'|'error', first failing test or a reason)."""
    args = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", "--no-header",
            "-W", "ignore::pytest.PytestUnraisableExceptionWarning"] + SUITES[suite]
    try:
        r = subprocess.run(args, cwd=tree, env=env_for(tree, ext_root), capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"suite timed out after {timeout:.0f}s"
    out = r.stdout + r.stderr
    if r.returncode == 0:
        return "pass", ""
    m = FAILED_RE.search(out)
    if r.returncode == 1 and m:
        return "fail", m.group(2).split("/")[-1]
    tail = " | ".join(out.strip().splitlines()[-3:])
    return "error", f"pytest exit {r.returncode}: {tail[:300]}"


# ----------------------------------------------------------------------------------------- mutate
def occurrences(f: Fault) -> int:
    with open(os.path.join(ROOT, f.file)) as fh:
        return fh.read().count(f.old)


def check_mutant(f: Fault, tree: str, ext_root: str, timeout: float) -> Result:
    t0 = time.time()
    n = occurrences(f)
    if n != 1:
        return Result(f, "ERROR", f"original substring found {n} times in {f.file} (must be exactly 1)", 0.0)
    path = os.path.join(tree, f.file)
    with open(path) as fh:
        original = fh.read()
    st = os.stat(path)
    mutated = original.replace(f.old, f.new, 1)
    is_cpp = f.file.startswith("csrc/")
    try:
        if f.file.endswith(".py"):
            try:
                compile(mutated, path, "exec")
            except SyntaxError as e:
                return Result(f, "ERROR", f"mutant does not compile: {e}", time.time() - t0)
        base_dir = ext_dir(tree, ext_root) if is_cpp else None
        with open(path, "w") as fh:
            fh.write(mutated)
        if is_cpp:
            mtime = mutant_mtime(os.path.join(base_dir, jit_name(tree)))
            os.utime(path, (mtime, mtime))
            copy_build(base_dir, ext_dir(tree, ext_root))
            why = build_ext(tree, ext_root, timeout)
            if why is not None:
                return Result(f, "ERROR", f"mutant does not build: {why}", time.time() - t0)
        status, detail = run_suite(tree, ext_root, f.suite, timeout)
    finally:
        with open(path, "w") as fh:
            fh.write(original)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    kind = {"fail": "CAUGHT", "pass": "MISSED"}.get(status, "ERROR")
    return Result(f, kind, detail, time.time() - t0)


def print_table(results: list[Result]) -> None:
    w_id = max(len(r.fault.id) for r in results)
    w_file = max(len(r.fault.file) for r in results)
    print(f"\n{'fault':<{w_id}}  {'file':<{w_file}}  {'result':<6}  {'s':>5}  caught by / detail  [property]")
    for r in results:
        print(f"{r.fault.id:<{w_id}}  {r.fault.file:<{w_file}}  {r.status:<6}  {r.seconds:5.0f}  "
              f"{r.detail}  [{r.fault.what}]")
    counts = {s: sum(r.status == s for r in results) for s in ("CAUGHT", "MISSED", "ERROR")}
    print(f"\n{len(results)} faults: {counts['CAUGHT']} caught, {counts['MISSED']} missed, "
          f"{counts['ERROR']} errors")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", action="append", default=[], help="only faults whose id contains this (repeatable)")
    ap.add_argument("--list", action="store_true", help="print the fault table and occurrence counts")
    ap.add_argument("--jobs", type=int, default=2, help="mutants run at once (one tree copy each)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant (build and suite each)")
    ap.add_argument("--workdir", default=os.path.join("/tmp", f"zk_mutation_{os.getuid()}"),
                    help="tree copies and the C++ build cache (kept between runs)")
    args = ap.parse_args()

    faults = [Fault(*row) for row in FAULTS]
    bad_suite = [f.id for f in faults if f.suite not in SUITES]
    if bad_suite or len({f.id for f in faults}) != len(faults):
        sys.exit(f"fault table: unknown suite in {bad_suite} or duplicate ids")
    if args.k:
        faults = [f for f in faults if any(k in f.id for k in args.k)]
    if args.list:
        for f in faults:
            print(f"{f.id:<34} {f.file:<26} {f.suite:<14} occurs {occurrences(f)}x  [{f.what}]")
        return 0
    if not faults:
        sys.exit("no fault matches -k")

    ext_root = os.path.join(args.workdir, "ext")
    trees = [os.path.join(args.workdir, f"tree{k}") for k in range(max(1, args.jobs))]
    for t in trees:
        make_tree(t)
    # Baseline: every suite the selected faults use must pass on the unmutated copy.
    t0 = time.time()
    # Every suite needs the extension (conftest requires the cpu backend: ZK_REQUIRE_CPU=1).
    for t in trees:
        why = build_ext(t, ext_root, args.timeout)
        if why is not None:
            sys.exit(f"baseline: the unmutated C++ extension does not build: {why}")
    for suite in sorted({f.suite for f in faults}):
        ts = time.time()
        status, detail = run_suite(trees[0], ext_root, suite, args.timeout)
        print(f"baseline {suite:<15} {status:<7} {time.time() - ts:5.0f}s {detail}", flush=True)
        if status != "pass":
            sys.exit(f"baseline suite {suite!r} does not pass on the unmutated tree: stopping")
    print(f"baseline ok in {time.time() - t0:.0f}s; {len(faults)} faults, {len(trees)} job(s)", flush=True)

    free: queue.Queue[str] = queue.Queue()
    for t in trees:
        free.put(t)

    def work(f: Fault) -> Result:
        tree = free.get()
        try:
            r = check_mutant(f, tree, ext_root, args.timeout)
        finally:
            free.put(tree)
        print(f"  {r.status:<6} {r.seconds:5.0f}s {f.id}: {r.detail}", flush=True)
        return r

    with cf.ThreadPoolExecutor(max_workers=len(trees)) as ex:
        results = list(ex.map(work, faults))
    print_table(results)
    print(f"total {time.time() - t0:.0f}s")
    return 0 if all(r.status == "CAUGHT" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
