-- pgwork schema 16 -> 17. Applied by `pgwork migrate` in one transaction under its advisory lock;
-- the result equals a fresh install (tests/test_schema.py checks that). The functions it changes
-- live in pgwork/sql/code/, applied by migrate after this file.
--
-- What it removes (issue 41: Postgres CPU per delivery):
--   * pgwork.next_ready, the lane's next ready row, which only the claim called: a SQL function
--     with a subquery is never inlined, and PostgreSQL 15 planned its body again on every
--     claim. claim_work now reads it in a subquery of its own plan.
--   * The claim becomes one statement (pgwork/sql/code/claim.sql, new: pgwork.claim_lanes and
--     pgwork.claim_rows, which take what the first step locked as parameters instead of two
--     transaction-local settings); nothing to do here, the code files make them.
-- No table is changed; nothing an app runs waits on this step.

-- No client calls it: only claim_work did, and the daemons of schema 16 step aside before this
-- runs (the migration handshake).
-- squawk-ignore ban-drop-function
DROP FUNCTION IF EXISTS pgwork.next_ready(text, text, bigint[]);
