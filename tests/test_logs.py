"""The log line's fast paths give what the general ones gave: a line per attempt is frequent."""

from __future__ import annotations

import json
import logging
import random
import sys
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from pgwork import db, logs

from .helpers import add_in_an_unknown_zone


def _record(created: float, **extra: object) -> logging.LogRecord:
    r = logging.LogRecord("pgwork.worker", logging.INFO, __file__, 1, "attempt %s", ("ok",), None)
    r.created = created
    r.__dict__.update(extra)
    return r


def test_the_timestamp_is_the_utc_instant_cut_to_milliseconds() -> None:
    f = logs.JsonFormatter()
    rng = random.Random(7)
    near = [
        1_796_000_000 + k + d
        for k in range(3)
        for d in (0.0, 0.0004999, 0.0005, 0.9994999, 0.9995, 0.9999996)
    ]
    for t in near + [rng.uniform(0, 4_000_000_000) for _ in range(5000)]:
        want = datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds")
        assert json.loads(f.format(_record(t)))["ts"] == want, t


def test_fields_keep_their_order_and_personal_ones_follow_the_redaction_mode() -> None:
    r = _record(0.0, work_id=1, business_key="k1", recipient="a@example.com", channel="c")
    assert list(json.loads(logs.JsonFormatter().format(r)))[-4:] == [
        "work_id",
        "business_key",
        "recipient",
        "channel",
    ]
    hashed = json.loads(logs.JsonFormatter("hash").format(r))
    assert hashed["business_key"].startswith("h:") and hashed["recipient"].startswith("h:")
    dropped = json.loads(logs.JsonFormatter("drop").format(r))
    assert "business_key" not in dropped and "recipient" not in dropped
    assert dropped["work_id"] == 1 and dropped["channel"] == "c"


def test_passwords_are_redacted_in_any_case() -> None:
    assert db.redact("attempt delivered") == "attempt delivered"
    assert db.redact("postgresql://u:s3cret@h/db") == "postgresql://u:***@h/db"
    for spelling in (
        "password",
        "PASSWORD",
        "PassWord",
        "pAsSwOrD",
        "pa\u017f\u017fword",
    ):  # long s matches s, ignoring case
        assert "s3cret" not in db.redact(f"host=h {spelling}=s3cret dbname=x"), spelling


@pytest.mark.anyio
async def test_a_database_error_is_logged_in_one_short_line(
    dsn: str, conn: psycopg.AsyncConnection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A page that failed on one reminder logged the server's whole CONTEXT, which quotes the
    page's statement: about 12 kB a line. The line says the message and where it was raised."""
    from pgwork.duties import materialise as materialiser

    await add_in_an_unknown_zone(conn)
    async with await db.connect(dsn) as c:
        await materialiser.run_once(c, lookahead=0, page_size=8, aside=materialiser.SetAside())
        with pytest.raises(psycopg.Error) as raised:
            await materialiser.run_once(c, lookahead=0, page_size=8)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("a page failed")]
    assert len(str(raised.value)) > 5000  # what the line carried
    try:
        raise raised.value
    except psycopg.Error:
        failed = logging.LogRecord(
            "t", logging.ERROR, "", 0, "pass failed: %s", (raised.value,), sys.exc_info()
        )
    for fmt in (logs.JsonFormatter(), logs.TextFormatter()):
        for r in (record, failed):
            line = fmt.format(r)
            assert "Mars/Olympus" in line and "not recognized" in line, line
            assert "pgwork.local_to_instant" in line and "WITH params" not in line, line
        assert len(fmt.format(record)) < 600
