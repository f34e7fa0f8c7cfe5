"""This node's GPUs as NVML sees them: the inventory (index, UUID, name) and, per check, each
device's health signals (lost, critical Xid events, uncorrectable ECC errors, row remapping,
slowdown reasons).

The one module of elasticd that imports ``pynvml`` (nvidia-ml-py), and only inside
``open_nvml``: a host without it, or without NVIDIA's driver, still runs the daemon;
``open_nvml`` then raises ``NvmlUnavailable`` with the reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elasticd.core.gpuhealth import GpuReading

log = logging.getLogger(__name__)


class NvmlUnavailable(Exception):
    """NVML could not be used here (no library, no driver, init failed): str() says why."""


@dataclass(frozen=True)
class Device:
    index: int
    uuid: str  # "GPU-..." as NVML gives it; "" for a device already lost at open
    name: str


# Clock event (throttle) reasons that mean the GPU is being slowed down for its health, by
# name; pynvml's constant names (the same bits under both the old and the new names).
SLOWDOWNS = (
    ("hw slowdown", "HwSlowdown"),
    ("hw thermal", "HwThermalSlowdown"),
    ("hw power brake", "HwPowerBrakeSlowdown"),
    ("sw thermal", "SwThermalSlowdown"),
    ("sw power", "SwPowerCap"),
)


def open_nvml() -> Nvml:
    """Initialise NVML, take the inventory and register for critical Xid events."""
    try:
        import pynvml
    except ImportError as e:
        raise NvmlUnavailable(f"pynvml is not importable (pip install nvidia-ml-py): {e}") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise NvmlUnavailable(f"nvmlInit failed: {e}") from None
    try:
        return Nvml(pynvml)
    except pynvml.NVMLError as e:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
        raise NvmlUnavailable(f"NVML's device list failed: {e}") from None


class Nvml:
    """An initialised NVML: ``devices`` as found at open; ``read()`` checks them all."""

    def __init__(self, nv: Any) -> None:
        self._nv = nv
        self._lock = threading.Lock()
        self._closed = False
        self._lost_at_open: set[int] = set()
        self._handles: dict[int, Any] = {}
        self._warned: set[tuple[str, int]] = set()
        devices = []
        for index in range(nv.nvmlDeviceGetCount()):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                devices.append(
                    Device(index, nv.nvmlDeviceGetUUID(handle), nv.nvmlDeviceGetName(handle))
                )
                self._handles[index] = handle
            except nv.NVMLError_GpuIsLost:
                devices.append(Device(index, "", ""))
                self._lost_at_open.add(index)
            except nv.NVMLError as e:  # e.g. no permission: not this host's to watch
                log.warning("NVML device %d left out: %s", index, e)
        self.devices: tuple[Device, ...] = tuple(devices)
        self._index_of = {
            _address(handle): index for index, handle in self._handles.items()
        }  # an event's device
        self._events = self._register_xids()
        self._new_clocks = hasattr(nv, "nvmlDeviceGetCurrentClocksEventReasons")
        self._slowdowns = tuple(
            (name, getattr(nv, "nvmlClocksThrottleReason" + bit)) for name, bit in SLOWDOWNS
        )

    def _register_xids(self) -> Any:
        """An event set with every device that supports it registered for critical Xid
        events; None when NVML has no event sets here. A device that cannot be registered
        simply reports no Xids."""
        nv = self._nv
        try:
            events = nv.nvmlEventSetCreate()
        except nv.NVMLError as e:
            log.info("NVML event sets unavailable, no Xid events: %s", e)
            return None
        for index, handle in self._handles.items():
            try:
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, events)
            except nv.NVMLError as e:
                log.info("GPU %d gives no Xid events: %s", index, e)
        return events

    def read(self) -> tuple[GpuReading, ...]:
        """Every device's reading now. Never blocks on events: the event set is drained
        with timeout 0. One caller at a time (a lock); NVML itself may hang in it."""
        with self._lock:
            if self._closed:
                raise NvmlUnavailable("NVML is closed")
            xids = self._drain_xids()
            return tuple(
                self._read_one(device, tuple(xids.get(device.index, ()))) for device in self.devices
            )

    def _drain_xids(self) -> dict[int, list[int]]:
        nv = self._nv
        found: dict[int, list[int]] = {}
        if self._events is None:
            return found
        while True:
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError_Timeout:
                return found
            except nv.NVMLError as e:  # a lost GPU among them: the device queries say which
                self._warn_once("nvmlEventSetWait_v2", e)
                return found
            index = self._index_of.get(_address(data.device))
            if index is not None and data.eventType & nv.nvmlEventTypeXidCriticalError:
                found.setdefault(index, []).append(int(data.eventData))

    def _read_one(self, device: Device, xids: tuple[int, ...]) -> GpuReading:
        if device.index in self._lost_at_open:
            return GpuReading(device.index, device.uuid, lost=True, xids=xids)
        nv = self._nv
        handle = self._handles[device.index]
        try:
            ecc = self._query(
                device.index,
                nv.nvmlDeviceGetTotalEccErrors,
                handle,
                nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                nv.NVML_VOLATILE_ECC,
            )
            rows = self._query(device.index, nv.nvmlDeviceGetRemappedRows, handle)
            pages = self._query(device.index, nv.nvmlDeviceGetRetiredPagesPendingStatus, handle)
            reasons = self._query(device.index, self._clock_reasons, handle) or 0
        except nv.NVMLError_GpuIsLost:
            return GpuReading(device.index, device.uuid, lost=True, xids=xids)
        return GpuReading(
            device.index,
            device.uuid,
            xids=xids,
            ecc_uncorrected=None if ecc is None else int(ecc),
            rows_pending=bool(rows and rows[2]) or pages == nv.NVML_FEATURE_ENABLED,
            remap_failed=bool(rows and rows[3]),
            slowdown=tuple(name for name, bit in self._slowdowns if reasons & bit),
        )

    def _clock_reasons(self, handle: Any) -> int:
        nv = self._nv
        if self._new_clocks:
            try:
                return nv.nvmlDeviceGetCurrentClocksEventReasons(handle)
            except nv.NVMLError_FunctionNotFound:  # a driver from before the new name
                self._new_clocks = False
        return nv.nvmlDeviceGetCurrentClocksThrottleReasons(handle)

    def _query(self, index: int, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), or None where the device does not answer it (GpuIsLost propagates)."""
        nv = self._nv
        try:
            return fn(*args)
        except nv.NVMLError_GpuIsLost:
            raise
        except (nv.NVMLError_NotSupported, nv.NVMLError_FunctionNotFound):
            return None
        except nv.NVMLError as e:
            self._warn_once(f"{fn.__name__} on GPU {index}", e)
            return None

    def _warn_once(self, what: str, e: Exception) -> None:
        """Log an unexpected NVML error once, not at every read."""
        key = (what, getattr(e, "value", 0))
        if key not in self._warned:
            self._warned.add(key)
            log.warning("NVML %s failed: %s", what, e)

    def close(self) -> None:
        """Free the event set and shut NVML down; a second close does nothing, nor one while
        a read still hangs in NVML (the process exits without it)."""
        if not self._lock.acquire(timeout=1.0):
            log.warning("NVML still busy in a read: not shut down")
            return
        try:
            if not self._closed:
                self._closed = True
                self._shut_down()
        finally:
            self._lock.release()

    def _shut_down(self) -> None:
        nv = self._nv
        try:
            if self._events is not None:
                nv.nvmlEventSetFree(self._events)
        except nv.NVMLError as e:
            log.warning("NVML event set free failed: %s", e)
        try:
            nv.nvmlShutdown()
        except nv.NVMLError as e:
            log.warning("NVML shutdown failed: %s", e)


def _address(handle: Any) -> int | None:
    """A device handle's address: the event data's device is a new ctypes object."""
    return ctypes.cast(handle, ctypes.c_void_p).value
