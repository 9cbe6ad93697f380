//! System tests: real PostgreSQL, the real binaries, real HTTP.
//!
//! # Where does my test go
//!
//! | file | what belongs there |
//! |---|---|
//! | `harness/` | the harness itself: cluster settings, stacks, the files in `sql/` (`mod.rs`), the roles (`roles.rs`), process supervision (`processes.rs`) |
//! | `oracle.rs` | the harness's oracles (the ledger's peek at the slot) can pass and fail |
//! | `upgrade.rs` | `sql/` applied over databases made by the previous release (`tests/fixtures/sql-*`), with data |
//! | `services/orders.rs` | the Orders API as its clients see it (no relay) |
//! | `services/billing.rs` | the Billing inbox and invoices API (no relay) |
//! | `services/payments.rs` | the payment provider's `POST /charges`: one charge per `Idempotency-Key`, expiry, its test hooks |
//! | `services/charges.rs` | Billing charging each invoice once at the provider: lost answers, 5xx, a crash between charge and record, declines |
//! | `cli/` | `cdc-relay` as an operator types it: `setup`, `status`, start-up errors and exit codes (one file a topic) |
//! | `identity.rs` | which relation is the outbox and whether the stream carries it: renames and swaps, publication membership (left, flapped, two publications, other tables), a slot older than its publication |
//! | `row_shape.rs` | what a row may hold and how the table is declared: the payload column's type, a non-UTF-8 database, replica identity |
//! | `dropped_column.rs` | a configured column dropped while rows are committed: stop while it is missing, dead letters once it is back or the table recreated |
//! | `routes.rs` | several endpoints from one slot (`run --routes`): fan-out, unrouted events, one endpoint down, `routes check`, dead letters per endpoint |
//! | `relay.rs` | the relay end to end on a healthy stack: delivery, wire format, acknowledgement, restarts, WAL retention, memory |
//! | `stream/` | unusual replication streams (`transactions`, `decoding`) and `payloads`, checked event by event |
//! | `http_manners.rs` | the sink client toward real HTTP infrastructure (issue 14): Retry-After pauses, connection age and idle timeout, SIGTERM during backoff, at most 2 requests/s to a dead sink from a relay that starts or takes over |
//! | `sink_failures.rs` | the sink misbehaves: poison and dead letters (whatever bytes the answer holds), circuit breaker, storm guard, configuration faults, the dead-letter commands |
//! | `backfill.rs` | `cdc-relay backfill`: re-sending after a lost slot, refused bounds, dry run, stopping early and resuming |
//! | `prune.rs` | outbox retention (issue 17): `cdc-relay prune` deletes only old, proven-delivered rows; dead letters, refusal, partitions, a slot without its birth row; `prune/periodic.rs`: `run --prune-older-than` and the idle budget |
//! | `dead_letters.rs` | `dead-letter replay`: each aggregate's order, a refused batch split down, removed only once committed, one replay at a time |
//! | `dead_letter_list.rs` | `dead-letter list` over many rows: every row once, a page at a time, within a memory bound |
//! | `dead_letter_store.rs` | the dead-letter row builder and store against the real table, with arbitrary content |
//! | `failover.rs` | trusting the slot's position: several hosts, a slot that jumped ahead, recreate-and-backfill, the progress record, `--standby-url` naming a primary; `failover/drill.rs`: the failover drill (primary SIGKILLed under load, standby promoted, per-failover ledger) |
//! | `shards/` | hash-sharded slots (issue 16): `setup`/`status`/`run --shards`, shards spread over relays with a spare taking over (`mod.rs`); the coverage proof refusing a split that loses or doubles rows (`coverage.rs`); resharding under load through `--stop-at-lsn`, and two splits never streaming at once (`resharding.rs`) |
//! | `infra_faults.rs` | PostgreSQL or the network misbehaves: walsender killed, restarts, link faults (and `/readyz` on a silent stream), standby takeover, invalidated slot, reconnects |
//! | `redaction.rs` | secrets in URLs (a sink's `user:password@`, a `?token=`) on every output surface: logs, admin endpoint, `status`, `routes check`, refusals, rows, `application_name` |
//! | `observability.rs` | what an operator watches: `/metrics` (gauges against the real state), `/readyz`, logs without secrets, the dashboards and alerts in `deploy/` |
//! | `slot_monitor.rs` | what the slot monitor reads every interval, at a cost that does not grow with the tables it describes |
//! | `tls.rs` | TLS to PostgreSQL and to the sink |
//! | `http2.rs` | HTTP/2 sinks: draining with streams in flight, large answer heads, stream resets, a silent connection, one connection per burst |
//! | `clock.rs` | the relay's clock stepped against the database's (libfaketime): the skew measured and named, latency on the server's clock, Billing's 401 named as the clock |
//! | `standby.rs` | what failover tests stand on: the server's library path, `PgCluster::kill`, a streaming standby, promotion, failover-slot sync (17+) |
//! | `signatures.rs` | the signature headers on the wire, secret rotation by SIGHUP (relay and Billing), the secret syntax both refuse alike |
//! | `interop.rs` | receivers built on the official Standard Webhooks verifiers (Python, Node.js): a run and a rotation drill |
//! | `listeners.rs` | connection floods on every listener (Orders, Billing, the relay's admin endpoint): caps, timeouts, real requests still served |
//! | `pooler.rs` | PgBouncer (Debian's package, session and transaction mode) in front of the database: `run`, `setup`, `status` name it and exit 2 |
//! | `slot_creation.rs` | a slot creation held by an open transaction: what `setup`/`run --create-slot` wait for, `--slot-create-timeout`, no orphan, "being created by pid N" in `setup` and `status` |
//! | `slot_persistence.rs` | where a slot resumes after a clean PostgreSQL restart, with and without a CHECKPOINT first (measured per version) |
//! | `trace_context.rs` | one order followed through every hop (issue 32): W3C trace context from the Orders request through the outbox row and the relay's attempts into Billing, exported over OTLP to a real receiver; retries, a redelivery after SIGKILL, a dead collector |
//! | `batches.rs` | batched delivery (`--batch-max-events`) into the real Billing: a backlog in batches, a refused event split out and dead-lettered alone |
//! | `chaos.rs` | the compressed chaos schedule (CI's variant of `--bin chaos`) |
//!
//! # How a test reads
//!
//! Start with `Scenario::start` (stack, setup, inbox, relay streaming)
//! unless the test is about that preamble. Wait only through
//! `harness::wait_until`, which says what it waits for. Prove that something
//! did NOT happen with `oracle::settle` (the slot's confirmed position passed
//! the current WAL position) or, while events are pending, with the relay's
//! own counters; never with a sleep. Sleep only when time passing is the
//! subject, and say so. End with an oracle: the `Ledger`,
//! `Scenario::expect_exactly`, or the proof-wide ledger for any inbox
//! (`Scenario::assert_balanced`, or `Scenario::assert_held` when the relay
//! stopped on purpose: the slot still holds every row not done).

mod backfill;
mod batches;
mod catalog_lock;
mod chaos;
mod cli;
mod clock;
mod dead_letter_list;
mod dead_letter_store;
mod dead_letters;
mod dropped_column;
mod failover;
mod gaps;
mod harness;
mod http2;
mod http_manners;
mod identity;
mod infra_faults;
mod interop;
mod listeners;
mod observability;
mod oracle;
mod parking;
mod partitions;
mod persistence;
mod pg_tls;
mod pooler;
mod prune;
mod redaction;
mod relay;
mod rotation;
mod routes;
mod row_shape;
mod services;
mod shards;
mod signatures;
mod sink_failures;
mod slot_creation;
mod slot_monitor;
mod slot_persistence;
mod standby;
mod stream;
mod tls;
mod trace_context;
mod upgrade;
mod withheld;
