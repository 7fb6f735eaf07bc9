"""Statements are rendered once (src/asyncjobq/_db/sql/common.py, rendered): whitespace outside
quotes squeezed, which only a comment or a dollar quote in a template could make wrong."""

from __future__ import annotations

from functools import cached_property

from psycopg import sql

from asyncjobq._db.sql import Statements, statements
from asyncjobq._db.sql.claim import DONE_OUTCOMES, LOCKED_DONE_OUTCOMES, PLAIN_OUTCOMES
from asyncjobq._db.sql.common import rendered


def test_every_statement_renders_to_one_line_without_comments_or_dollar_quotes() -> None:
    names = {n for cls in Statements.__mro__ for n, v in vars(cls).items()
             if isinstance(v, cached_property)}
    assert len(names) > 50
    for st in (statements("a schema"), statements("a schema", outcomes=PLAIN_OUTCOMES),
               statements("a schema", outcomes=DONE_OUTCOMES),
               statements("a schema", outcomes=DONE_OUTCOMES, part=0),
               statements("a schema", outcomes=LOCKED_DONE_OUTCOMES, part=0)):
        for name in names:
            text = getattr(st, name).as_string(None)
            assert "--" not in text and "/*" not in text and "$$" not in text, name
            assert "\n" not in text.replace("E'\\n'", ""), name
            assert '"a schema"' in text or "{s}" not in text, name
            if name.startswith("job_set_outcome"):  # the done flush updates no row
                assert ("updated AS" in text) == (
                    st.outcomes not in (DONE_OUTCOMES, LOCKED_DONE_OUTCOMES)), name
                # Only the done flush naming a partition deletes without locking first.
                assert ("locked AS" in text) == (
                    st.outcomes != DONE_OUTCOMES or st.part is None), name


def test_rendering_keeps_what_is_quoted() -> None:
    q = rendered(sql.SQL("SELECT  'a  b',\n  \"x  y\", E'\\n'  ,  'it''s  '"))
    assert q.as_string(None) == "SELECT 'a  b', \"x  y\", E'\\n' , 'it''s  '"


def test_a_worker_keeps_its_longest_statements_parsed() -> None:
    """psycopg parses a text longer than its cache limit at every execute: a worker raises
    the limit past its own statements, for the longest schema name allowed."""
    from psycopg import _queries

    from asyncjobq._db.database import LONGEST_CACHED_STATEMENT, cache_long_statements

    st = statements("s" * 48)
    longest = max(len(getattr(st, name).as_string(None).encode())
                  for name in dir(type(st))
                  if name.startswith("job_set_outcome_if_running_many")
                  and isinstance(getattr(type(st), name), cached_property))
    assert longest <= LONGEST_CACHED_STATEMENT, longest
    cache_long_statements()
    assert _queries.MAX_CACHED_STATEMENT_LENGTH >= LONGEST_CACHED_STATEMENT
