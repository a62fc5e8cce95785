"""A DLPack producer over a numpy array whose exported fields a test can set at will.

It lets the tests reach what real producers here cannot make: GPU devices,
read-only and copied flags, unknown dtypes and versions, legacy capsules.
"""

from __future__ import annotations

import ctypes
from ctypes import (
    POINTER,
    Structure,
    c_int32,
    c_int64,
    c_uint8,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
)

import numpy as np

KDL = {"int": 0, "uint": 1, "float": 2, "bfloat": 4, "complex": 5, "bool": 6}
READ_ONLY, IS_COPIED = 1, 2
_VERSIONED_NAME = b"dltensor_versioned"
_LEGACY_NAME = b"dltensor"


class DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32),
                ("dtype", DLDataType), ("shape", POINTER(c_int64)),
                ("strides", POINTER(c_int64)), ("byte_offset", c_uint64)]


class DLManagedTensor(Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class DLPackVersion(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", c_void_p), ("deleter", c_void_p),
                ("flags", c_uint64), ("dl_tensor", DLTensor)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [c_void_p, ctypes.c_char_p, c_void_p]


class FakeTensor:
    """Exports `array`'s memory with the given DLPack fields (defaults: what numpy says)."""

    def __init__(self, array: np.ndarray, *, device=(1, 0), dtype=None, flags=0,
                 legacy=False, version=(1, 0), strides="auto", byte_offset=0):
        self.array = array
        self.device = device
        kind = {"i": "int", "u": "uint", "f": "float", "c": "complex", "b": "bool"}
        self.dtype = dtype or (KDL[kind[array.dtype.kind]], array.dtype.itemsize * 8, 1)
        self.flags = flags
        self.legacy = legacy
        self.version = version
        self.strides = strides
        self.byte_offset = byte_offset
        self._keep = []

    def _fill(self, t: DLTensor) -> None:
        a = self.array
        shape = (c_int64 * max(a.ndim, 1))(*a.shape)
        t.data = a.ctypes.data - self.byte_offset
        t.device = DLDevice(*self.device)
        t.ndim = a.ndim
        t.dtype = DLDataType(*self.dtype)
        t.shape = ctypes.cast(shape, POINTER(c_int64))
        self._keep.append(shape)
        if self.strides is None:
            t.strides = None
        else:
            elems = self.strides if self.strides != "auto" else [
                s // a.itemsize for s in a.strides]
            strides = (c_int64 * max(a.ndim, 1))(*elems)
            t.strides = ctypes.cast(strides, POINTER(c_int64))
            self._keep.append(strides)
        t.byte_offset = self.byte_offset

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if self.legacy or max_version is None:
            managed = DLManagedTensor()
            self._fill(managed.dl_tensor)
            name = _LEGACY_NAME
        else:
            managed = DLManagedTensorVersioned()
            managed.version = DLPackVersion(*self.version)
            managed.flags = self.flags
            self._fill(managed.dl_tensor)
            name = _VERSIONED_NAME
        self._keep.append(managed)
        # No destructor: the memory belongs to this object and its array.
        return _capsule_new(ctypes.addressof(managed), name, None)

    def __dlpack_device__(self):
        return self.device


class LegacyOnly(FakeTensor):
    """A producer older than DLPack 1.0: __dlpack__ takes no max_version."""

    def __dlpack__(self, stream=None):  # noqa: D105
        return super().__dlpack__()


class RequiresGrad(LegacyOnly):
    """Like torch before its C exchange API: refuses to export while it requires grad."""

    requires_grad = True

    def __dlpack__(self, stream=None):  # noqa: D105
        if self.requires_grad:
            raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")
        return super().__dlpack__()

    def detach(self):
        """The same memory, not requiring grad."""
        view = RequiresGrad(self.array)
        view.requires_grad = False
        return view
