"""Workflows (0012_workflows.sql): what producers run to enqueue jobs with parents, what a
worker reads for a child's parents' results, and what `get` reads of a job's family. Releasing
and cancelling children is not here: a trigger on jobs does it, in the transaction that ends
their parent."""

from __future__ import annotations

from functools import cached_property

from .common import Role, Statement, _q


class WorkflowStatements(Role):

    @cached_property
    def workflow_enqueue(self) -> Statement:
        # A workflow's jobs and edges in one call (0012_workflows.sql, enqueue_workflow): the
        # ids in order, or the parent ids named that do not exist (unknown, nothing written).
        # Edges to parents named by id are looked at when the transaction commits.
        return _q("SELECT id, unknown FROM {s}.enqueue_workflow(%s::jsonb, %s::jsonb)",
                  self.schema)

    @cached_property
    def job_parent_results(self) -> Statement:
        # A child's parents and, for those done, what their handlers returned. Each looked up
        # by its id: joined, the planner hashed all of jobs_history when its statistics were
        # older than the history (10 ms a child at 50,000 rows, benchmarks/workflows.py).
        return _q(
            "SELECT d.parent_id, (SELECT h.result FROM {s}.jobs_history h"
            "   WHERE h.id = d.parent_id AND h.status = 'done')"
            " FROM {s}.job_deps d WHERE d.child_id = %(id)s ORDER BY d.parent_id",
            self.schema,
        )

    @cached_property
    def job_family(self) -> Statement:
        # A job's parents (true) and children (false), for `get` and the dashboard.
        return _q(
            "SELECT true, parent_id FROM {s}.job_deps WHERE child_id = %(id)s"
            " UNION ALL SELECT false, child_id FROM {s}.job_deps WHERE parent_id = %(id)s"
            " ORDER BY 1, 2",
            self.schema,
        )
