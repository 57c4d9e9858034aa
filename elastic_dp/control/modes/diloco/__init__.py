"""DiLoCo / local SGD, driver side (``--mode diloco``)."""

from elastic_dp.control.modes.diloco.mode import DiLoCoMode

__all__ = ["DiLoCoMode"]
