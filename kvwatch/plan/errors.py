"""Every error a plan input can raise: the command prints the message (file, line, key) and exits 1."""

from __future__ import annotations

from kvwatch.config import ConfigError
from kvwatch.plan.calibration import CalibrationError
from kvwatch.plan.candidate import CandidateError
from kvwatch.plan.fit import FitError
from kvwatch.plan.inputs import PlanInputError
from kvwatch.plan.sources import SourceError
from kvwatch.report.inputs import ReportError

PLAN_ERRORS: tuple[type[Exception], ...] = (
    CalibrationError,
    CandidateError,
    ConfigError,
    FitError,
    PlanInputError,
    ReportError,
    SourceError,
    OSError,
)
