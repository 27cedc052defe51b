-- Room trends: the statements of trends: each channel's attempts per minute.
-- Each is named once (across pgwork/sql/queries/) and bound in pgwork/store/trends.py.
-- Parameters are psycopg named placeholders; time comes from the database's clock (now()).

-- name: trend_write
-- A daemon's minutes per channel (pgwork/duties/trends.py), a JSON array of
-- {channel, minute (epoch seconds), delivered, failed, dead, fenced, took_sum, took_max}: each
-- value whole, so a write repeated after a lost reply counts nothing twice.
INSERT INTO pgwork.channel_minute AS m
       (channel, minute, written_by, delivered, failed, dead, fenced, took_sum, took_max)
SELECT t.channel, to_timestamp(t.minute), %(written_by)s, t.delivered, t.failed, t.dead, t.fenced,
       t.took_sum, t.took_max
  FROM jsonb_to_recordset(%(minutes)s::jsonb)
       AS t(channel text, minute bigint, delivered bigint, failed bigint, dead bigint, fenced bigint,
            took_sum float8, took_max float8)
ON CONFLICT (channel, minute, written_by) DO UPDATE
   SET delivered = excluded.delivered, failed = excluded.failed, dead = excluded.dead,
       fenced = excluded.fenced, took_sum = excluded.took_sum, took_max = excluded.took_max

-- name: trend_prune
-- Up to %(limit)s minutes older than %(keep_hours)s hours, deleted; rows another daemon's prune
-- holds are skipped (it deletes them). Returns how many went.
WITH old AS (
    SELECT m.channel, m.minute, m.written_by
      FROM pgwork.channel_minute m
     WHERE m.minute < now() - make_interval(hours => %(keep_hours)s)
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM pgwork.channel_minute m
     USING old
     WHERE (m.channel, m.minute, m.written_by) = (old.channel, old.minute, old.written_by)
    RETURNING 1
)
SELECT count(*) AS n FROM gone

-- name: channel_trend
-- A channel's last %(minutes)s minutes (by this database's clock), every daemon's summed, oldest
-- first; minutes with nothing recorded are not returned. Read by key: at most that many minutes
-- times the daemons that wrote them.
SELECT m.minute,
       sum(m.delivered)::bigint AS delivered, sum(m.failed)::bigint AS failed,
       sum(m.dead)::bigint AS dead, sum(m.fenced)::bigint AS fenced,
       (sum(m.took_sum) / nullif(sum(m.delivered + m.failed), 0))::float8 AS took_mean,
       max(m.took_max)::float8 AS took_max
  FROM pgwork.channel_minute m
 WHERE m.channel = %(channel)s
   AND m.minute > date_trunc('minute', now()) - make_interval(mins => %(minutes)s)
 GROUP BY m.minute
 ORDER BY m.minute
