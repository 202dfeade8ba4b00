"""Exceptions raised by the dsv4 binding: one class per ``dsv4_status``."""

from __future__ import annotations

STATUS_NAMES = {
    0: "OK",
    1: "INVALID_ARGUMENT",
    2: "NULL_POINTER",
    3: "STATE",
    4: "CONFIG",
    5: "IO",
    6: "FORMAT",
    7: "TENSOR",
    8: "CAPACITY",
    9: "NO_DEVICE",
    10: "CUDA",
    11: "UNSUPPORTED",
    12: "INTERNAL",
    13: "OUT_OF_MEMORY",
}


class Error(Exception):
    """A failed dsv4 call.

    ``status`` is the ``DSV4_STATUS_*`` code, ``status_name`` its name, ``message`` the
    library's ``dsv4_last_error()`` text naming the argument, field, tensor or file at fault.
    """

    status: int = -1

    def __init__(self, status: int, message: str):
        self.status = status
        self.status_name = STATUS_NAMES.get(status, "UNKNOWN")
        self.message = message
        super().__init__(f"{self.status_name}: {message}")


class InvalidArgumentError(Error, ValueError):
    status = 1


class NullPointerError(Error, ValueError):
    status = 2


class StateError(Error):
    status = 3


class ConfigError(Error):
    status = 4


class IoError(Error, OSError):
    status = 5


class FormatError(Error):
    status = 6


class TensorError(Error, ValueError):
    status = 7


class CapacityError(Error):
    status = 8


class NoDeviceError(Error):
    status = 9


class CudaError(Error):
    status = 10


class UnsupportedError(Error):
    status = 11


class InternalError(Error):
    status = 12


class OutOfMemoryError(Error, MemoryError):
    status = 13


_BY_STATUS = {
    cls.status: cls
    for cls in (
        InvalidArgumentError,
        NullPointerError,
        StateError,
        ConfigError,
        IoError,
        FormatError,
        TensorError,
        CapacityError,
        NoDeviceError,
        CudaError,
        UnsupportedError,
        InternalError,
        OutOfMemoryError,
    )
}


def error_for(status: int, message: str) -> Error:
    """The exception instance for a status code (``Error`` itself for unknown codes)."""
    cls = _BY_STATUS.get(status)
    if cls is None:
        return Error(status, message)
    # Error.__init__ is first in the MRO; the builtin base (ValueError, OSError) gets args too.
    return cls(status, message)


def invalid(message: str) -> InvalidArgumentError:
    """An INVALID_ARGUMENT error raised by the binding itself, before calling the library."""
    return InvalidArgumentError(1, message)
