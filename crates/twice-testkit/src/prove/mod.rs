//! Prove that your own handler's effects happen once, under every fault twice guards against.
//!
//! [`Prove`] runs a [`Handler`] of yours on your real store (SQLite, PostgreSQL or MariaDB)
//! behind twice's [`Processor`](twice::Processor), on an embedded broker with a
//! [`ManualClock`](twice::ManualClock), through a seeded schedule of faults, one
//! [`Scenario`] after another over a handful of generated messages each:
//!
//! | scenario | what happens |
//! |---|---|
//! | [`Scenario::ConcurrentCopies`] | each message twice, taken by two processors at the same instant |
//! | [`Scenario::NewMessageId`] | the same event again under a new message id (the business-key backstop) |
//! | [`Scenario::CrashAfterCommit`] | the processor dies after the commit, before the completion; another takes the redelivery when the lock runs out |
//! | [`Scenario::CrashBeforeCommit`] | the processor dies at the end of the handler, before the commit |
//! | [`Scenario::LockLoss`] | the lock runs out while the handler runs (renewal off); another processor takes the message |
//! | [`Scenario::TransientError`] | the first call to each fake service the message has an effect on takes effect and answers 503 (with no such service, the handler's attempt fails once after its work) |
//! | [`Scenario::DeadLetterResubmit`] | the message is dead-lettered after its work was rolled back, and sent again from the dead-letter queue with the same id |
//! | [`Scenario::CrashBeforeClaim`] | the processor dies after receiving the message, before its claim; another takes the redelivery when the lock runs out |
//! | [`Scenario::CommitUnknown`] | the connection is cut during the COMMIT (after the server got it for one message, before for the others): the processor does not know whether its work committed. Not applicable on SQLite, which has no connection to cut |
//! | [`Scenario::SessionOrder`] | the messages of one session sent in a shuffled order, a later one first, to a session processor; then one sent again after a later one was handled |
//!
//! Then it checks the history (deliveries, handler runs, commits, settlements) and the effects
//! you declared: rows of your tables counted by a SQL query ([`Prove::effect_once`]), and calls
//! to a [`FakeService`] started by the kit ([`Prove::service_once`]). A broken invariant
//! ([`Invariant`]) is reported with its scenario, its message and the **seed** that replays it;
//! a fault that was not actually exercised, a handler that panics or an effect query that
//! fails is an error of the run, never a pass. A scenario that cannot apply to your store is
//! reported as not applicable, with the reason ([`ScenarioRun::not_applicable`]).
//!
//! ```
//! use twice::{handler_fn, Message, Outcome};
//! use twice_testkit::prove::{Prove, Scenario};
//!
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() {
//! let db = twice_testkit::db::SqliteDatabase::create().unwrap();
//! let pool = db.pool(4).await.unwrap();
//! sqlx::query("CREATE TABLE shipments (order_id INTEGER NOT NULL)").execute(&pool).await.unwrap();
//!
//! // The handler under test: one shipment per order, written in the claim's transaction.
//! let ship = || {
//!     handler_fn(|ctx, tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>| {
//!         Box::pin(async move {
//!             let order: i64 = std::str::from_utf8(ctx.body()).unwrap().parse().unwrap();
//!             sqlx::query("INSERT INTO shipments (order_id) VALUES (?1)")
//!                 .bind(order)
//!                 .execute(&mut **tx)
//!                 .await?;
//!             Ok(Outcome::Complete)
//!         })
//!     })
//! };
//! let report = Prove::new(ship, pool)
//!     .messages(|_rng, i| Message::new(i.to_string()).with_message_id(format!("order-{i}")))
//!     .effect_once(
//!         "shipments per order",
//!         "SELECT order_id, COUNT(*) FROM shipments GROUP BY order_id",
//!         |m| Some(String::from_utf8_lossy(&m.body).into_owned()),
//!     )
//!     .scenarios(&[Scenario::CrashAfterCommit, Scenario::CrashBeforeCommit])
//!     .run(7)
//!     .await;
//! assert!(report.passed(), "{report}");
//! # }
//! ```
//!
//! The seed decides the messages (through your generator), how many each scenario gets and
//! which of them meets the fault; [`Prove::run`] with the same seed on a fresh store replays
//! the same schedule. Every scenario processes its messages one at a time, and waits on
//! conditions (the broker's counts, the history), never on wall-clock time.
//!
//! Messages your generator marks as poison ([`Prove::poison`]) must end in the dead-letter
//! queue with no effect. Give every generated message a message id and a business key of its
//! own, both derived from the index the generator is given.

mod check;
mod commit_unknown;
mod cut;
mod env;
mod inbox;
mod probe;
mod run;
mod service;
mod session;
mod store;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use sqlx::{Pool, Transaction};
use twice::{Handler, Inbox, Message, Mode};
use twice_sqlx::{InboxOptions, SqlxInbox, SqlxOutbox, StoreError};

pub use service::{Call, FakeService, Keys, ServiceClient};
pub use store::Store;

/// A small deterministic random number generator (SplitMix64), handed to the message
/// generator: the same seed gives the same numbers on every machine.
#[derive(Clone, Debug)]
pub struct Seeded(u64);

impl Seeded {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next number.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `low..=high`.
    pub fn between(&mut self, low: u64, high: u64) -> u64 {
        let span = high.saturating_sub(low).saturating_add(1);
        if span == 0 { self.next_u64() } else { low + self.next_u64() % span }
    }

    /// True with probability `percent` in 100.
    pub fn percent(&mut self, percent: u64) -> bool {
        self.next_u64() % 100 < percent
    }
}

/// One schedule of faults the kit runs the handler through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Scenario {
    /// Each message sent twice, the copies taken by two processors at the same instant.
    ConcurrentCopies,
    /// Each message sent again under a new message id, with the same body.
    NewMessageId,
    /// The processor dies after one message's commit, before its completion.
    CrashAfterCommit,
    /// The processor dies at the end of one message's handler, before the commit.
    CrashBeforeCommit,
    /// One message's lock runs out while its handler runs (renewal off).
    LockLoss,
    /// One message's first attempt meets a transient error after its effects.
    TransientError,
    /// One message is dead-lettered, then sent again from the dead-letter queue.
    DeadLetterResubmit,
    /// The processor dies after receiving one message, before its claim (before the message's
    /// transaction begins).
    CrashBeforeClaim,
    /// The connection is cut during each message's COMMIT: after the server got it for one
    /// message (it committed), before for the others (it rolled back). Needs a store reached
    /// over TCP (PostgreSQL, MariaDB): on SQLite it is not applicable.
    CommitUnknown,
    /// The messages of one session sent out of order (a later one first) to a session
    /// processor, and one of them sent again after a later one was handled.
    SessionOrder,
}

impl Scenario {
    /// Every scenario, in the order [`Prove::run`] runs them.
    pub const ALL: [Scenario; 10] = [
        Scenario::ConcurrentCopies,
        Scenario::NewMessageId,
        Scenario::CrashAfterCommit,
        Scenario::CrashBeforeCommit,
        Scenario::LockLoss,
        Scenario::TransientError,
        Scenario::DeadLetterResubmit,
        Scenario::CrashBeforeClaim,
        Scenario::CommitUnknown,
        Scenario::SessionOrder,
    ];

    /// A name for reports and queue names.
    pub fn name(self) -> &'static str {
        match self {
            Scenario::ConcurrentCopies => "concurrent-copies",
            Scenario::NewMessageId => "new-message-id",
            Scenario::CrashAfterCommit => "crash-after-commit",
            Scenario::CrashBeforeCommit => "crash-before-commit",
            Scenario::LockLoss => "lock-loss",
            Scenario::TransientError => "transient-error",
            Scenario::DeadLetterResubmit => "dead-letter-resubmit",
            Scenario::CrashBeforeClaim => "crash-before-claim",
            Scenario::CommitUnknown => "commit-unknown",
            Scenario::SessionOrder => "session-order",
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What must hold of a handler's effects, whatever the faults.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Invariant {
    /// An effect happened more than once for one message or business key.
    DoubleEffect,
    /// A message was completed (or dead-lettered without being poison) while its effect is
    /// missing, or was completed before its effect had committed.
    LostMessage,
    /// An effect is there from work that was rolled back: more rows than committed attempts,
    /// or an effect of a message that was never completed.
    EffectOfRolledBackWork,
    /// A poison message was completed, or was neither completed nor dead-lettered.
    PoisonNotDeadLettered,
}

impl fmt::Display for Invariant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Invariant::DoubleEffect => "double effect",
            Invariant::LostMessage => "lost message",
            Invariant::EffectOfRolledBackWork => "effect of rolled-back work",
            Invariant::PoisonNotDeadLettered => "poison not dead-lettered",
        })
    }
}

/// A broken invariant, where and how.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Failure {
    /// The invariant broken.
    pub invariant: Invariant,
    /// The scenario it broke in.
    pub scenario: Scenario,
    /// The message (or one of the messages) whose effect it is.
    pub message_id: String,
    /// The effect's name, when an effect is concerned.
    pub effect: Option<String>,
    /// The key the effect was counted under.
    pub key: Option<String>,
    /// What the kit saw.
    pub detail: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} in scenario {}: message {:?}",
            self.invariant, self.scenario, self.message_id
        )?;
        if let Some(effect) = &self.effect {
            write!(f, ", effect {effect:?}")?;
        }
        if let Some(key) = &self.key {
            write!(f, ", key {key:?}")?;
        }
        write!(f, ": {}", self.detail)
    }
}

/// What one scenario did.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ScenarioRun {
    /// The scenario.
    pub scenario: Scenario,
    /// The ids of the messages it sent (first copies), in order.
    pub messages: Vec<String>,
    /// The message that met the fault, for the scenarios that fault one.
    pub target: Option<String>,
    /// Whether the fault was seen to happen.
    pub exercised: bool,
    /// Why the scenario does not apply to the store, when it does not (commit-unknown on
    /// SQLite): it did not run, and proves nothing; it is no error either.
    pub not_applicable: Option<String>,
    /// The history of the scenario, one line per event, then the calls each fake service
    /// received during it.
    pub history: Vec<String>,
}

/// What a run found: passed when it has neither failures nor errors.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Report {
    /// The seed that replays this run.
    pub seed: u64,
    /// The round of a [soak](Prove::soak) this run was (0 for [`Prove::run`]); with the seed,
    /// what [`Prove::replay`] takes.
    pub round: u64,
    /// Broken invariants, in the order found.
    pub failures: Vec<Failure>,
    /// Errors of the run itself: bad input (a panicking handler, an effect query that
    /// fails, a generator without message ids), a fault that was not exercised, a scenario
    /// that did not settle. A run with errors proves nothing.
    pub errors: Vec<String>,
    /// The scenarios run.
    pub scenarios: Vec<ScenarioRun>,
    /// The smallest schedule found that still fails, with the invariant it broke: the first
    /// failing scenario run again over fresh messages, one, then two and so on below the
    /// number it failed with (none when every smaller schedule passes).
    pub smallest: Option<(Scenario, Vec<String>, Invariant)>,
}

impl Report {
    /// Whether every invariant held and the run had no error.
    pub fn passed(&self) -> bool {
        self.failures.is_empty() && self.errors.is_empty()
    }

    /// The first broken invariant, if any.
    pub fn first_failure(&self) -> Option<&Failure> {
        self.failures.first()
    }

    /// Whether some failure broke `invariant`.
    pub fn broke(&self, invariant: Invariant) -> bool {
        self.failures.iter().any(|f| f.invariant == invariant)
    }

    /// The scenarios that did not apply to the store, with the reason: they did not run.
    pub fn not_applicable(&self) -> impl Iterator<Item = (Scenario, &str)> {
        self.scenarios.iter().filter_map(|s| Some((s.scenario, s.not_applicable.as_deref()?)))
    }

    /// Panics with the report unless the run passed.
    ///
    /// # Panics
    ///
    /// When a failure or an error was found.
    pub fn assert_passed(&self) {
        assert!(self.passed(), "{self}");
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ran: Vec<_> = self
            .scenarios
            .iter()
            .filter(|s| s.not_applicable.is_none())
            .map(|s| s.scenario.name())
            .collect();
        if self.passed() {
            write!(f, "prove: passed with seed {} ({})", self.seed, ran.join(", "))?;
            for (scenario, why) in self.not_applicable() {
                write!(f, "\n  not applicable, not run: {scenario}: {why}")?;
            }
            return Ok(());
        }
        if self.round == 0 {
            writeln!(
                f,
                "prove: FAILED with seed {} (replay it with .run({}))",
                self.seed, self.seed
            )?;
        } else {
            writeln!(
                f,
                "prove: FAILED with seed {} in round {} of a soak (replay it with .replay({}, {}))",
                self.seed, self.round, self.seed, self.round
            )?;
        }
        for (scenario, why) in self.not_applicable() {
            writeln!(f, "  not applicable, not run: {scenario}: {why}")?;
        }
        for e in &self.errors {
            writeln!(f, "  error: {e}")?;
        }
        for failure in &self.failures {
            writeln!(f, "  {failure}")?;
        }
        if let Some((scenario, messages, invariant)) = &self.smallest {
            writeln!(
                f,
                "  smallest failing schedule: scenario {scenario} over {messages:?} ({invariant})"
            )?;
        }
        for s in &self.scenarios {
            let prefix = format!("scenario {}:", s.scenario);
            let broken = self.failures.iter().any(|x| x.scenario == s.scenario)
                || self.errors.iter().any(|e| e.starts_with(&prefix));
            if broken {
                writeln!(f, "  history of {}:", s.scenario)?;
                for line in &s.history {
                    writeln!(f, "    {line}")?;
                }
            }
        }
        Ok(())
    }
}

type KeyOf = Arc<dyn Fn(&Message) -> Option<String> + Send + Sync>;
type CallKey = Arc<dyn Fn(&Call) -> Option<String> + Send + Sync>;
type Generator = Arc<dyn Fn(&mut Seeded, usize) -> Message + Send + Sync>;
type IsPoison = Arc<dyn Fn(&Message) -> bool + Send + Sync>;

/// Where an effect is counted.
#[derive(Clone)]
enum Source {
    /// A query returning `(key, count)` rows.
    Sql(String),
    /// The effects a fake service recorded, by request path, or by the key `by` gives a call.
    Service { service: Arc<FakeService>, by: Option<CallKey> },
}

impl Source {
    /// A fake service's effects by key.
    fn service_effects(service: &FakeService, by: Option<&CallKey>) -> HashMap<String, i64> {
        let mut counts = HashMap::new();
        for call in service.calls().iter().filter(|c| c.effect) {
            let key = match by {
                Some(by) => by(call),
                None => Some(call.path.clone()),
            };
            if let Some(key) = key {
                *counts.entry(key).or_default() += 1;
            }
        }
        counts
    }
}

/// An effect that must happen exactly once per key.
#[derive(Clone)]
struct Effect {
    name: String,
    source: Source,
    key_of: KeyOf,
}

/// The kit: a handler factory and a pool, messages, effects, scenarios; see the
/// [module docs](self).
pub struct Prove<DB: Store, H> {
    factory: Arc<dyn Fn() -> H + Send + Sync>,
    pool: Pool<DB>,
    inbox: InboxOptions,
    outbox: Option<SqlxOutbox<DB>>,
    mode: Mode,
    generator: Option<Generator>,
    effects: Vec<Effect>,
    poison: Option<IsPoison>,
    scenarios: Vec<Scenario>,
    messages: (u64, u64),
}

impl<DB: Store, H> fmt::Debug for Prove<DB, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prove")
            .field("inbox", &self.inbox)
            .field("mode", &self.mode)
            .field("effects", &self.effects.iter().map(|e| e.name.as_str()).collect::<Vec<_>>())
            .field("scenarios", &self.scenarios)
            .finish_non_exhaustive()
    }
}

impl<DB, H> Prove<DB, H>
where
    DB: Store,
    H: Handler<Transaction<'static, DB>>,
    SqlxInbox<DB>: Inbox<Tx = Transaction<'static, DB>, Error = StoreError>,
{
    /// A kit for the handlers `factory` makes (one per simulated processor), on `pool`.
    /// Defaults: the inbox `InboxOptions::new()` (created on the pool if missing),
    /// [`Mode::Claim`], every [`Scenario`], 2 to 4 messages per scenario.
    pub fn new(factory: impl Fn() -> H + Send + Sync + 'static, pool: Pool<DB>) -> Self {
        Self {
            factory: Arc::new(factory),
            pool,
            inbox: InboxOptions::new(),
            outbox: None,
            mode: Mode::Claim,
            generator: None,
            effects: Vec::new(),
            poison: None,
            scenarios: Scenario::ALL.to_vec(),
            messages: (2, 4),
        }
    }

    /// The inbox's options, as your processor has them (its table, its business keys).
    #[must_use]
    pub fn inbox(mut self, options: InboxOptions) -> Self {
        self.inbox = options;
        self
    }

    /// The outbox your inbox has (`SqlxInbox::with_outbox`), for a handler that sends
    /// messages with [`Context::send`](twice::Context::send): its rows are staged in the
    /// claim's transaction as your processor's are. No relay runs: nothing is sent.
    #[must_use]
    pub fn outbox(mut self, outbox: SqlxOutbox<DB>) -> Self {
        self.outbox = Some(outbox);
        self
    }

    /// The processor's mode, as your processor has it.
    #[must_use]
    pub fn mode(mut self, mode: Mode) -> Self {
        self.mode = mode;
        self
    }

    /// The message generator: given a seeded generator and the message's index (distinct in
    /// a run), a message with a message id. Derive the id and the business key from the
    /// index, the rest of the body from the generator.
    #[must_use]
    pub fn messages(
        mut self,
        f: impl Fn(&mut Seeded, usize) -> Message + Send + Sync + 'static,
    ) -> Self {
        self.generator = Some(Arc::new(f));
        self
    }

    /// How many messages each scenario sends (default 2 to 4; at least 1).
    #[must_use]
    pub fn messages_per_scenario(mut self, low: u64, high: u64) -> Self {
        let low = low.max(1);
        self.messages = (low, high.max(low));
        self
    }

    /// Which generated messages are poison: they must be dead-lettered, with no effect.
    #[must_use]
    pub fn poison(mut self, f: impl Fn(&Message) -> bool + Send + Sync + 'static) -> Self {
        self.poison = Some(Arc::new(f));
        self
    }

    /// An effect in your tables that must happen exactly once per key: `sql` returns
    /// `(key, count)` rows (`SELECT order_id, COUNT(*) FROM shipments GROUP BY order_id`),
    /// and `key_of` says which key a message's effect is counted under (`None`: this message
    /// has no such effect). Messages of one business key share a key.
    #[must_use]
    pub fn effect_once(
        mut self,
        name: &str,
        sql: &str,
        key_of: impl Fn(&Message) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.effects.push(Effect {
            name: name.to_owned(),
            source: Source::Sql(sql.to_owned()),
            key_of: Arc::new(key_of),
        });
        self
    }

    /// An effect on a fake external service that must happen exactly once per key: the key
    /// is the request path a message's call goes to (`/charges/order-7`), as `key_of` says.
    /// The transient-error scenario arms the services registered here.
    #[must_use]
    pub fn service_once(
        mut self,
        name: &str,
        service: Arc<FakeService>,
        key_of: impl Fn(&Message) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.effects.push(Effect {
            name: name.to_owned(),
            source: Source::Service { service, by: None },
            key_of: Arc::new(key_of),
        });
        self
    }

    /// As [`Prove::service_once`], for a service whose request path does not name what a call
    /// acts on (`POST /charges`, the order in the body): `key_of_call` gives the key a call's
    /// effect is counted under, from its path and body (`None`: not counted), and `key_of`
    /// the key of a message's effect, to match.
    #[must_use]
    pub fn service_calls_once(
        mut self,
        name: &str,
        service: Arc<FakeService>,
        key_of: impl Fn(&Message) -> Option<String> + Send + Sync + 'static,
        key_of_call: impl Fn(&Call) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.effects.push(Effect {
            name: name.to_owned(),
            source: Source::Service { service, by: Some(Arc::new(key_of_call)) },
            key_of: Arc::new(key_of),
        });
        self
    }

    /// The scenarios to run, in this order (default [`Scenario::ALL`]).
    #[must_use]
    pub fn scenarios(mut self, scenarios: &[Scenario]) -> Self {
        self.scenarios = scenarios.to_vec();
        self
    }
}
