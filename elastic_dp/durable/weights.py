"""The run's weights files (``initial.safetensors``, ``final.safetensors``): a state dict
written whole, or part by part as the parts come (ZeRO stage 3 gathers one unit at a time),
in the safetensors format either way."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Iterator

import torch
from safetensors.torch import save as save_bytes

from elastic_dp.durable.storage import Storage


def save_tensors(storage: Storage, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Write ``tensors`` as the safetensors file ``name`` of ``storage``, whole or not at all."""
    # clones: tied weights share storage, which safetensors refuses to save
    storage.write(name, save_bytes({k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}))


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}

TensorSpecs = list[tuple[str, torch.dtype, list[int]]]
"""A file's tensors in their order: (name, dtype, shape)."""


def save_tensor_parts(storage: Storage, name: str, specs: TensorSpecs, parts: Iterable[dict[str, torch.Tensor]]) -> None:
    """Write the safetensors file ``name`` of ``storage`` from ``parts`` (their tensors in
    ``specs``' order) as they come, holding one tensor's bytes at a time; whole or not
    at all. The header, written first, is the format's: its length (8 bytes, little
    endian), then JSON giving each tensor's dtype, shape and byte range, padded to 8."""
    header, offset = {}, 0
    for key, dtype, shape in specs:
        size = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)

    def pieces() -> Iterator[bytes]:
        yield struct.pack("<Q", len(text)) + text
        expected = iter(specs)
        for part in parts:
            for key, tensor in part.items():
                want = next(expected, None)
                if want is None or want[0] != key or tensor.dtype != want[1] or list(tensor.shape) != list(want[2]):
                    raise ValueError(f"{name}: got {key} {tensor.dtype} {list(tensor.shape)} where the specs have {want}")
                yield tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        if next(expected, None) is not None:
            raise ValueError(f"{name}: the parts ended before the specs' tensors")

    storage.write_pieces(name, pieces())
