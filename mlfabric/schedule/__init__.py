"""Schedule IR (ops, schedules, builder helper) and its validator."""

from .ir import (
    DEFAULT_CHANNEL,
    MAX_OP_TAG,
    REDUCE_OPS,
    Copy,
    Cost,
    DepMode,
    Nop,
    Op,
    Recv,
    Reduce,
    Schedule,
    ScheduleBuilder,
    Send,
    Slice,
)
from .validate import ScheduleError, ValidationReport, validate

__all__ = [
    "DEFAULT_CHANNEL", "MAX_OP_TAG", "REDUCE_OPS", "Copy", "Cost", "DepMode", "Nop", "Op",
    "Recv", "Reduce", "Schedule", "ScheduleBuilder", "ScheduleError", "Send", "Slice",
    "ValidationReport", "validate",
]
