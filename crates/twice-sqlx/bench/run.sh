#!/usr/bin/env bash
# The inbox benchmark (numbers for BENCHMARKS.md, never a pass/fail test): processor throughput
# on the embedded broker with and without the claim, on SQLite and PostgreSQL, at
# MaxConcurrentCalls 1 and 16; pgbench running the same SQL at 1 and 16 clients in the same run;
# claim latency on PostgreSQL from an empty inbox to 10 million rows.
#
# Usage: crates/twice-sqlx/bench/run.sh [messages] [latency samples] [sizes]
# Needs PostgreSQL on 127.0.0.1:5432 (database `test`, trust) and pgbench.
set -euo pipefail
cd "$(dirname "$0")/../../.."
messages="${1:-20000}"
samples="${2:-3000}"
sizes="${3:-0,1000000,10000000}"
here=crates/twice-sqlx/bench
psql_() { psql -h 127.0.0.1 -U postgres -d test -qAt "$@"; }

# SKIP_BUILD=1 reuses binaries already built (when another build holds cargo's lock).
if [ -z "${SKIP_BUILD:-}" ]; then
  cargo build --release -p twice-sqlx --all-features \
    --example bench_stores --example bench_claim_latency
fi
bin=target/release/examples

echo "# $(date -u +%Y-%m-%dT%H:%MZ) on $(nproc) cores, $(free -g | awk '/Mem:/ {print $2}') GiB"
echo "## pgbench, the same SQL as the processor's transaction (15 s each)"
for script in claim noclaim; do
  for clients in 1 16; do
    psql_ -c "DROP TABLE IF EXISTS pgb_inbox, pgb_shipments" \
      -c "CREATE TABLE pgb_inbox (consumer text NOT NULL, message_id text NOT NULL, processed_at_ms bigint NOT NULL, PRIMARY KEY (consumer, message_id))" \
      -c "CREATE INDEX pgb_inbox_processed_at ON pgb_inbox (processed_at_ms)" \
      -c "CREATE TABLE pgb_shipments (order_id bigint NOT NULL, message_id text NOT NULL)"
    tps=$(pgbench -h 127.0.0.1 -U postgres -n -c "$clients" -j 2 -T 15 -f "$here/$script.pgbench.sql" test \
      | awk '/^tps/ {print $3}')
    echo "pgbench script=$script clients=$clients tps=$tps"
  done
done
psql_ -c "DROP TABLE IF EXISTS pgb_inbox, pgb_shipments"

echo "## processor on the embedded broker (in memory)"
for store in sqlite postgres; do
  for calls in 1 16; do
    for mode in claim noclaim; do
      echo "$store $("$bin/bench_stores" "$store" "$messages" "$calls" "$mode")"
    done
  done
done

echo "## claim latency on PostgreSQL as the inbox grows"
"$bin/bench_claim_latency" "$samples" "$sizes"
