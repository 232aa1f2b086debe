"""CTranslate2 model files (``model.bin``, format version ≤ 6): every variable as a torch tensor.

Layout (CTranslate2 ``python/ctranslate2/specs/model_spec.py`` ``_serialize``), little-endian:
``uint32 version``, ``string spec name``, ``uint32 revision``, ``uint32 n``, then ``n`` variables
(``string name``, ``uint8 rank``, ``uint32 dims[rank]``, ``uint8 dtype``, ``uint32 n_bytes``, data),
then ``uint32 n_aliases`` and ``(string alias, string target)`` pairs; a string is ``uint16 length``
+ bytes ending in NUL. Read without ctranslate2 itself (it is the parity reference, not a dependency).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ...progress import progress

# CTranslate2 DataType enum → numpy dtype (int8 weights of quantized models keep their scale separately)
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}


def read_ctranslate2(path: str | Path) -> tuple[str, dict[str, Tensor]]:
    """``(spec name, {variable name: tensor})``; float16/bfloat16 variables become float32, aliases
    point at their targets' tensors. Raises ``FileNotFoundError`` / ``ValueError`` (not a CTranslate2 file)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"CTranslate2 model file {str(path)!r} does not exist")
    buf = memoryview(path.read_bytes())
    pos = 0

    def take(fmt: str):
        nonlocal pos
        values = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return values

    def string() -> str:
        nonlocal pos
        (n,) = take("H")
        text = bytes(buf[pos : pos + n]).rstrip(b"\0").decode("utf-8")
        pos += n
        return text

    (version,) = take("I")
    if not 1 <= version <= 6:
        raise ValueError(f"{str(path)!r} is not a CTranslate2 model (format version {version})")
    spec = string() if version >= 2 else ""
    take("I")  # revision
    (n,) = take("I")
    variables: dict[str, Tensor] = {}
    for _ in progress(range(n), f"reading {Path(path).name}", unit="tensor"):
        name = string()
        (rank,) = take("B")
        dims = take("I" * rank)
        (dtype,) = take("B")
        (n_bytes,) = take("I")
        raw = buf[pos : pos + n_bytes]
        pos += n_bytes
        if _DTYPES.get(dtype) == "bfloat16":
            t = torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).float()
        else:
            t = torch.from_numpy(np.frombuffer(raw, dtype=_DTYPES[dtype]).copy())
            if dtype == 4:
                t = t.float()
        variables[name] = t.reshape(dims)
    if pos < len(buf):
        (n_alias,) = take("I")
        for _ in range(n_alias):
            alias, target = string(), string()
            variables[alias] = variables[target]
    return spec, variables
