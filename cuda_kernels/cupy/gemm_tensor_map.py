"""v6's CUtensorMap of the weights: the tile the TMA copies, and the driver call that encodes it.

v6 (gemm_v6_tma_ws.cu) loads w [E, N, Kdim] with the Tensor Memory Accelerator: one
cp.async.bulk.tensor per BLOCK_N x BLOCK_K tile, described by a 128-byte CUtensorMap that the
host encodes once (cuTensorMapEncodeTiled) and the kernel takes by value (a __grid_constant__
parameter). gemm.py passes it after the common kernel arguments (gemm.extra_args).

    v6_tensor_map_fields(w_shape, dkey, cfg)    the encoder's arguments, as a dict (the CPU
                                                emulator of tests/emulator reads them)
    v6_tensor_map(ptr, w_shape, dkey, cfg, dev) the encoded map, cached per pointer and shape
"""
from __future__ import annotations

import numpy as np

from .gemm_configs import _ITEMSIZE


def v6_tensor_map_fields(w_shape, dkey: str, cfg: dict) -> dict:
    """The cuTensorMapEncodeTiled arguments of v6's weight tile, w [E, N, Kdim] viewed 3-D
    (innermost first: Kdim, N, E): a box of BLOCK_K x BLOCK_N x 1 (one expert's BLOCK_N rows,
    BLOCK_K = 64 columns = 128 bytes), 128-byte swizzle (wgmma's layout type 1), zeros outside
    (the ragged N and Kdim tails; 3-D, so a tile never reads the next expert's rows)."""
    E, N, K = (int(x) for x in w_shape)
    item = _ITEMSIZE[dkey]
    return {"dtype": dkey, "rank": 3, "dims": (K, N, E), "strides": (K * item, N * K * item),
            "box": (cfg["BLOCK_K"], cfg["BLOCK_N"], 1), "element_strides": (1, 1, 1),
            "elem_bytes": item, "swizzle_bytes": 128}


# cuda.h's enum values for the map (CUtensorMapDataType, ...Swizzle, ...L2promotion)
_TMAP_DTYPE = {"fp16": 6, "bf16": 9}          # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
_TMAP_SWIZZLE_128B = 3
_TMAP_L2_PROMOTION_256B = 3


def _encode_tensor_map(fields: dict, ptr: int):
    """A CUtensorMap of `fields` at device address `ptr`, as a one-element NumPy array of its
    128 bytes (CuPy passes a size-one NumPy array to a kernel by value). The driver's
    cuTensorMapEncodeTiled, called through ctypes as _launch calls cuLaunchKernelEx: host work
    only, nothing is enqueued, so a capture may follow; interleave none, 128-byte swizzle,
    256-byte L2 promotion, zeros outside the tensor."""
    import ctypes

    from ._launch import _driver

    assert fields["swizzle_bytes"] == 128
    lib = _driver()
    rank = fields["rank"]
    tmap = (ctypes.c_uint64 * 16)()                     # 128 bytes (the driver wants 64-aligned:
    if ctypes.addressof(tmap) % 64:                     # ctypes gives 16; realign in a spare)
        spare = (ctypes.c_uint64 * 24)()
        base = (ctypes.addressof(spare) + 63) // 64 * 64
        tmap = (ctypes.c_uint64 * 16).from_address(base)
        tmap._keep = spare
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    status = lib.cuTensorMapEncodeTiled(
        ctypes.byref(tmap), ctypes.c_int(_TMAP_DTYPE[fields["dtype"]]), u32(rank),
        ctypes.c_void_p(ptr), (u64 * rank)(*fields["dims"]),
        (u64 * (rank - 1))(*fields["strides"]), (u32 * rank)(*fields["box"]),
        (u32 * rank)(*fields["element_strides"]), ctypes.c_int(0),
        ctypes.c_int(_TMAP_SWIZZLE_128B), ctypes.c_int(_TMAP_L2_PROMOTION_256B), ctypes.c_int(0))
    if status != 0:
        raise RuntimeError(f"w: cuTensorMapEncodeTiled failed (CUresult {status}) for {fields} "
                           f"at {ptr:#x}")
    words = np.array(tmap[:], dtype=np.uint64)
    return words.view(np.dtype((np.void, 128)))          # shape (1,): 128 bytes by value


_TENSOR_MAPS: dict = {}


def v6_tensor_map(ptr: int, w_shape, dkey: str, cfg: dict, dev: int):
    """v6's CUtensorMap of the weights [E, N, Kdim] at device address `ptr`, cached per
    (pointer, shape, dtype, BLOCK_N, BLOCK_K, device): the map holds the address, so another
    array at the same address with the same shape reuses it. Host work only (capturable)."""
    key = (int(ptr), tuple(int(x) for x in w_shape), dkey, cfg["BLOCK_N"], cfg["BLOCK_K"], dev)
    tmap = _TENSOR_MAPS.get(key)
    if tmap is None:
        if len(_TENSOR_MAPS) > 256:        # weights come and go: keep the cache bounded
            _TENSOR_MAPS.clear()
        tmap = _TENSOR_MAPS[key] = _encode_tensor_map(
            v6_tensor_map_fields(w_shape, dkey, cfg), int(ptr))
    return tmap
