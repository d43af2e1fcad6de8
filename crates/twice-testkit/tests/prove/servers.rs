//! The prove kit on PostgreSQL and MariaDB: the planted bugs that SQLite cannot show (it
//! serialises writers at `BEGIN IMMEDIATE`), and the correct handler passing there too.
//!
//! - Work outside the claim's transaction: on SQLite a write through the pool waits for the
//!   handler's own transaction until the busy timeout; on a server it commits at once and
//!   survives the rollback.
//! - Check-then-insert instead of the claim: on SQLite the copies are serialised and the check
//!   holds; under READ COMMITTED (or MariaDB's consistent reads) two copies at once both pass
//!   it.
//! - A COMMIT whose outcome is unknown: only a server connection can be cut during its COMMIT.

use serde::Deserialize;
use twice::{Message, Mode, Outcome, handler_fn};
use twice_testkit::prove::{Invariant, Prove, Scenario, Seeded};
use twice_testkit::require_service;

#[derive(Deserialize)]
struct Order {
    order_id: i64,
}

fn order(_rng: &mut Seeded, i: usize) -> Message {
    Message::new(format!(r#"{{"order_id":{i}}}"#)).with_message_id(format!("order-{i}-placed"))
}

fn order_key(m: &Message) -> Option<String> {
    let o: Order = serde_json::from_slice(&m.body).expect("an order");
    Some(o.order_id.to_string())
}

const SHIPMENTS: &str = "SELECT order_id, COUNT(*) FROM shipments GROUP BY order_id";

/// The tests for one server store; `$p1` is its first bind placeholder.
macro_rules! server_store {
    ($name:ident, $db:ty, $database:ty, $service:literal, $p1:literal) => {
        mod $name {
            use super::*;

            type Tx = sqlx::Transaction<'static, $db>;

            async fn store() -> Option<($database, sqlx::Pool<$db>)> {
                let db = require_service($service, <$database>::create("twice_prove").await)?;
                let pool = db.pool(8).await.expect("pool");
                sqlx::query("CREATE TABLE shipments (order_id BIGINT NOT NULL)")
                    .execute(&pool)
                    .await
                    .expect("shipments");
                Some((db, pool))
            }

            async fn ship(tx: &mut Tx, order_id: i64) -> Result<(), sqlx::Error> {
                sqlx::query(concat!("INSERT INTO shipments (order_id) VALUES (", $p1, ")"))
                    .bind(order_id)
                    .execute(&mut **tx)
                    .await
                    .map(drop)
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_correct_handler_passes() {
                let Some((_db, pool)) = store().await else { return };
                let correct = || {
                    handler_fn(|ctx, tx: &mut Tx| {
                        Box::pin(async move {
                            let o: Order = ctx.json()?;
                            ship(tx, o.order_id).await?;
                            Ok(Outcome::Complete)
                        })
                    })
                };
                let report = Prove::new(correct, pool.clone())
                    .messages(order)
                    .effect_once("shipments per order", SHIPMENTS, order_key)
                    .scenarios(&[
                        Scenario::ConcurrentCopies,
                        Scenario::CrashAfterCommit,
                        Scenario::CrashBeforeCommit,
                        Scenario::LockLoss,
                        Scenario::CrashBeforeClaim,
                        Scenario::CommitUnknown,
                        Scenario::SessionOrder,
                    ])
                    .run(8)
                    .await;
                assert!(report.passed(), "{report}");
                assert!(report.scenarios.iter().all(|s| s.exercised), "{report:?}");
            }

            /// The connection is cut during each COMMIT: after the server got the target's
            /// (it committed; its retry meets the claim), before it got the others' (they
            /// rolled back; their retry claims and commits).
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_commit_of_unknown_outcome_meets_both_outcomes() {
                let Some((_db, pool)) = store().await else { return };
                let correct = || {
                    handler_fn(|ctx, tx: &mut Tx| {
                        Box::pin(async move {
                            let o: Order = ctx.json()?;
                            ship(tx, o.order_id).await?;
                            Ok(Outcome::Complete)
                        })
                    })
                };
                let report = Prove::new(correct, pool.clone())
                    .messages(order)
                    .messages_per_scenario(3, 3)
                    .effect_once("shipments per order", SHIPMENTS, order_key)
                    .scenarios(&[Scenario::CommitUnknown])
                    .run(2)
                    .await;
                assert!(report.passed(), "{report}");
                let run = &report.scenarios[0];
                assert!(run.exercised, "{report:?}");
                let target = run.target.as_deref().expect("a target");
                let history = run.history.join("\n");
                let committed = format!("whether {target} committed");
                assert!(history.contains(&committed), "{history}");
                assert!(history.contains("got the COMMIT: committed"), "{history}");
                assert!(history.contains("never got the COMMIT: rolled back"), "{history}");
                assert!(history.contains(&format!("claim of {target}: a duplicate")), "{history}");
            }

            /// A handler whose insert is not idempotent, run without a claim: the retry after a
            /// COMMIT the server got inserts again. Both rows committed: a double effect, not
            /// work that survived a rollback.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_rerun_after_a_commit_of_unknown_outcome_is_a_double_effect() {
                let Some((_db, pool)) = store().await else { return };
                let plain_insert = || {
                    handler_fn(|ctx, tx: &mut Tx| {
                        Box::pin(async move {
                            let o: Order = ctx.json()?;
                            ship(tx, o.order_id).await?;
                            Ok(Outcome::Complete)
                        })
                    })
                };
                let report = Prove::new(plain_insert, pool.clone())
                    .mode(Mode::NaturallyIdempotent)
                    .messages(order)
                    .effect_once("shipments per order", SHIPMENTS, order_key)
                    .scenarios(&[Scenario::CommitUnknown])
                    .run(3)
                    .await;
                assert!(report.errors.is_empty(), "{report}");
                let f = report
                    .failures
                    .iter()
                    .find(|f| f.invariant == Invariant::DoubleEffect)
                    .unwrap_or_else(|| panic!("not caught:\n{report}"));
                assert_eq!(Some(f.message_id.as_str()), report.scenarios[0].target.as_deref());
                assert!(!report.broke(Invariant::EffectOfRolledBackWork), "{report}");
                println!("{report}");
            }

            /// The handler writes through the pool, not `tx`: its row commits at once and
            /// survives the rollback of the attempt the fault stops.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn work_outside_the_claims_transaction_is_caught() {
                let Some((_db, pool)) = store().await else { return };
                let outside = {
                    let pool = pool.clone();
                    move || {
                        let pool = pool.clone();
                        handler_fn(move |ctx, _tx: &mut Tx| {
                            let pool = pool.clone();
                            Box::pin(async move {
                                let o: Order = ctx.json()?;
                                sqlx::query(concat!(
                                    "INSERT INTO shipments (order_id) VALUES (",
                                    $p1,
                                    ")"
                                ))
                                .bind(o.order_id)
                                .execute(&pool)
                                .await?;
                                Ok(Outcome::Complete)
                            })
                        })
                    }
                };
                let report = Prove::new(outside, pool.clone())
                    .messages(order)
                    .effect_once("shipments per order", SHIPMENTS, order_key)
                    .scenarios(&[Scenario::CrashBeforeCommit, Scenario::LockLoss])
                    .run(5)
                    .await;
                assert!(report.errors.is_empty(), "{report}");
                let f = report
                    .failures
                    .iter()
                    .find(|f| f.invariant == Invariant::EffectOfRolledBackWork)
                    .unwrap_or_else(|| panic!("not caught:\n{report}"));
                assert_eq!(f.effect.as_deref(), Some("shipments per order"));
            }

            /// Check-then-insert in the handler's own `processed` table, the processor in
            /// `Mode::NaturallyIdempotent`: two copies at once both pass the check.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn check_then_insert_instead_of_the_claim_is_caught() {
                let Some((_db, pool)) = store().await else { return };
                sqlx::query("CREATE TABLE processed (id VARCHAR(255) NOT NULL)")
                    .execute(&pool)
                    .await
                    .expect("processed");
                let naive = || {
                    handler_fn(|ctx, tx: &mut Tx| {
                        Box::pin(async move {
                            let id = ctx.message_id().as_str().to_owned();
                            let seen: i64 = sqlx::query_scalar(concat!(
                                "SELECT COUNT(*) FROM processed WHERE id = ",
                                $p1
                            ))
                            .bind(&id)
                            .fetch_one(&mut **tx)
                            .await?;
                            if seen > 0 {
                                return Ok(Outcome::Complete);
                            }
                            let o: Order = ctx.json()?;
                            ship(tx, o.order_id).await?;
                            sqlx::query(concat!("INSERT INTO processed (id) VALUES (", $p1, ")"))
                                .bind(&id)
                                .execute(&mut **tx)
                                .await?;
                            Ok(Outcome::Complete)
                        })
                    })
                };
                let report = Prove::new(naive, pool.clone())
                    .mode(Mode::NaturallyIdempotent)
                    .messages(order)
                    .effect_once("shipments per order", SHIPMENTS, order_key)
                    .scenarios(&[Scenario::ConcurrentCopies])
                    .run(6)
                    .await;
                assert!(report.errors.is_empty(), "{report}");
                assert!(report.broke(Invariant::DoubleEffect), "not caught:\n{report}");
                println!("{report}");
            }
        }
    };
}

server_store!(postgres, sqlx::Postgres, twice_testkit::db::PgDatabase, "PostgreSQL", "$1");
server_store!(mariadb, sqlx::MySql, twice_testkit::db::MariaDatabase, "MariaDB", "?");
