"""Element types of the KV cache. Data moves as bytes: a dtype only fixes the element width."""

from __future__ import annotations

from enum import Enum

import numpy as np


class DataType(str, Enum):
    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"
    UINT8 = "uint8"
    FLOAT8 = "float8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def storage(self) -> np.dtype:
        """An unsigned integer numpy dtype of the same width, used to hold and compare raw elements."""
        return np.dtype(f"u{self.itemsize}")


_ITEMSIZE = {
    DataType.FLOAT32: 4,
    DataType.FLOAT16: 2,
    DataType.BFLOAT16: 2,
    DataType.INT8: 1,
    DataType.UINT8: 1,
    DataType.FLOAT8: 1,
}
