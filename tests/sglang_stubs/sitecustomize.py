"""Test environment only (this CPU): what SGLang 0.5.23 needs to import on CPU torch from PyPI.

PyPI's torchvision is a CUDA build: its import registers fake kernels for ``torchvision::nms`` and ``qnms``, op
schemas that only its CUDA extension defines, and fails on CPU torch. Defining the two schemas first lets the
import pass; nothing here calls them. Users on GPUs have the real packages and no need for this directory.
"""

from __future__ import annotations

try:
    import torch

    _lib = torch.library.Library("torchvision", "DEF")  # noqa: F841 (kept alive: the schemas live with it)
    _lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
except Exception:  # torch missing or the schemas already defined: nothing to stand in for
    pass

import os  # noqa: E402

if os.environ.get("NIXL_KV_SGLANG_TEST_HOLD"):  # a test's fault injection (nixl_kv_hold.py), never a user's
    import nixl_kv_hold  # noqa: F401
