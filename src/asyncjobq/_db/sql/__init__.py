"""Every SQL statement asyncjobq runs, named for what it does (River's style), split by role.

Statements are composed with psycopg.sql; the schema is always an Identifier and user data is
always a bound parameter. `statements(schema)` builds the set once per schema. Each role has its
module: enqueue.py (producers), claim.py (the worker's claim, completion and heartbeat),
maintenance.py (reaper, leader, pruner, vacuum, periodic scheduler), admin.py (install, admin
calls), doctor.py (doctor's checks and the fixes it advises), browse.py (the jobs list and its
actions, for the dashboard), testing.py (asyncjobq.testing's schema, listing and drain claim),
workflow.py (jobs with parents).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from .admin import AdminStatements
from .browse import BrowseStatements
from .claim import WorkerStatements
from .common import CLAIM_COLUMNS, HISTORY_COLUMNS, INFO_COLUMNS, IndexDefinition, Statement
from .doctor import DoctorStatements
from .enqueue import EnqueueStatements
from .maintenance import MaintenanceStatements
from .testing import TestingStatements
from .workflow import WorkflowStatements

__all__ = ["CLAIM_COLUMNS", "HISTORY_COLUMNS", "INFO_COLUMNS", "IndexDefinition", "Statement",
           "Statements", "statements"]


@dataclass(frozen=True)
class Statements(EnqueueStatements, WorkerStatements, MaintenanceStatements, AdminStatements,
                 DoctorStatements, BrowseStatements, TestingStatements, WorkflowStatements):
    schema: str
    outcomes: int = 0
    part: int | None = None


@cache
def statements(schema: str, outcomes: int = 0, part: int | None = None
               ) -> Statements:
    """The statements of `schema`; `outcomes`: the worker's flush for batches of any outcomes
    (claim.py ANY_OUTCOMES), of outcomes done without a result or failed (PLAIN_OUTCOMES), or
    done without a result only (DONE_OUTCOMES, or LOCKED_DONE_OUTCOMES: its rows locked
    first) (WorkerStatements._OUTCOME_CTES); `part`: the generation whose partition the
    worker's claims and completions name (Role)."""
    return Statements(schema, outcomes, part)
