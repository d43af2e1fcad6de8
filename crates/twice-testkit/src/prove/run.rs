//! Running the scenarios: an embedded broker on a manual clock, processors of the user's
//! handler started, crashed and stopped as each scenario says, one message at a time.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use sqlx::Transaction;
use tokio::sync::watch;
use twice::{
    Handler, Inbox, ManualClock, Message, Mode, Processor, ProcessorOptions, RetryPolicy,
    SequenceNumber, SessionProcessor, SessionProcessorOptions, SharedClock,
};
use twice_broker::config::QueueProperties;
use twice_broker::{Broker, BrokerOptions};
use twice_sqlx::{SqlxInbox, StoreError};

use super::check::{EffectInfo, Observed, Sent, check};
use super::env::{Env, POLLS, Running, id_of};
use super::inbox::Faulted;
use super::probe::{Action, CompletionCheck, Event, Probe, Recorded, Watched, commit_hook};
use super::session::out_of_order;
use super::{Effect, Prove, Report, Scenario, ScenarioRun, Seeded, Source, Store};

/// The lock of the scenarios' queues; the clock is advanced past it to expire a lock.
const LOCK: Duration = Duration::from_secs(30);
/// How long a handler held by the concurrent-copies scenario waits for the other copy to
/// reach its handler too, in polls, where the claim (or the store) holds the other copy back
/// until the first ends; where nothing should, the other copy's start is awaited as long as
/// any step, and its end ten times this.
const RENDEZVOUS_POLLS: usize = 200;

/// The derived seed of message `index` (SplitMix64 of the pair).
fn mix(seed: u64, index: u64) -> u64 {
    Seeded::new(seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15)).next_u64()
}

impl<DB, H> Prove<DB, H>
where
    DB: Store,
    H: Handler<Transaction<'static, DB>>,
    SqlxInbox<DB>: Inbox<Tx = Transaction<'static, DB>, Error = StoreError>,
{
    /// Runs every scenario with `seed` and checks the history; see the
    /// [module docs](super). Use a fresh store for each run: effects are counted by key.
    pub async fn run(&self, seed: u64) -> Report {
        self.replay(seed, 0).await
    }

    /// The longer soak: `rounds` runs on the same store, with the seeds `first_seed`,
    /// `first_seed + 1`, …, each round's messages apart from the others' (so one store serves
    /// them all). Returns the report of the first round that fails, or of the last one; a
    /// failing round is replayed with [`Prove::replay`] and its seed and round, on a fresh
    /// store. Prints a line per round to standard error.
    pub async fn soak(&self, first_seed: u64, rounds: u64) -> Report {
        let mut last = None;
        for round in 0..rounds.max(1) {
            let seed = first_seed.wrapping_add(round);
            let report = self.replay(seed, round).await;
            let verdict = if report.passed() { "passed" } else { "FAILED" };
            eprintln!("prove soak: round {}/{} (seed {seed}): {verdict}", round + 1, rounds.max(1));
            if !report.passed() {
                return report;
            }
            last = Some(report);
        }
        last.unwrap_or_else(|| unreachable!("at least one round runs"))
    }

    /// Replays round `round` of a [soak](Prove::soak) with `seed` (round 0 is [`Prove::run`]).
    pub async fn replay(&self, seed: u64, round: u64) -> Report {
        let mut report = Report {
            seed,
            round,
            failures: Vec::new(),
            errors: Vec::new(),
            scenarios: Vec::new(),
            smallest: None,
        };
        if let Err(e) = self.preflight().await {
            report.errors.push(e);
            return report;
        }
        let inbox = match SqlxInbox::new(self.pool.clone(), self.inbox.clone()).await {
            Ok(i) => Arc::new(match &self.outbox {
                Some(outbox) => i.with_outbox(outbox.clone()),
                None => i,
            }),
            Err(e) => {
                report.errors.push(format!("the inbox could not be created: {e}"));
                return report;
            }
        };
        for &scenario in &self.scenarios {
            let (messages, target) = self.schedule(seed, scenario, (round, 0), None);
            let (run, failures, errors) =
                self.scenario(&inbox, seed, scenario, messages, target).await;
            report.failures.extend(failures);
            report.errors.extend(errors.into_iter().map(|e| format!("scenario {scenario}: {e}")));
            report.scenarios.push(run);
        }
        if report.scenarios.iter().all(|s| s.not_applicable.is_some()) {
            report.errors.push(format!(
                "no scenario applies to this store ({}): nothing was proved",
                DB::NAME
            ));
        }
        if report.errors.is_empty()
            && let Some(first) = report.failures.first().cloned()
        {
            // Shrink: the failing scenario again over fresh messages, one, then two, and so
            // on below the number it failed with; the first schedule that fails is reported.
            let failed_with = report
                .scenarios
                .iter()
                .find(|s| s.scenario == first.scenario)
                .map_or(1, |s| s.messages.len() as u64);
            for n in 1..failed_with.max(2) {
                let (messages, target) = self.schedule(seed, first.scenario, (round, n), Some(n));
                let ids: Vec<String> = messages.iter().map(id_of).collect();
                let (_, failures, errors) =
                    self.scenario(&inbox, seed, first.scenario, messages, target).await;
                if errors.is_empty()
                    && let Some(f) = failures.first()
                {
                    report.smallest = Some((first.scenario, ids, f.invariant));
                    break;
                }
            }
        }
        report
    }

    /// Checks the generator and the effect queries before anything runs.
    async fn preflight(&self) -> Result<(), String> {
        let Some(generator) = &self.generator else {
            return Err("no message generator: call .messages(...)".to_owned());
        };
        let (a, b) = (generator(&mut Seeded::new(1), 0), generator(&mut Seeded::new(1), 0));
        if id_of(&a).is_empty() {
            return Err("the generator made a message without a message id".to_owned());
        }
        if id_of(&a) != id_of(&b) || a.body != b.body {
            return Err("the generator is not deterministic: the same seed and index gave \
                        different messages"
                .to_owned());
        }
        let other = generator(&mut Seeded::new(2), 1);
        if id_of(&other) == id_of(&a) {
            return Err(format!(
                "the generator gave two indexes the same message id {:?}: derive it from the \
                 index",
                id_of(&a)
            ));
        }
        if self.scenarios.is_empty() {
            return Err("no scenario to run".to_owned());
        }
        if self.effects.is_empty() {
            return Err(
                "no effect declared: call .effect_once(...) or .service_once(...)".to_owned()
            );
        }
        for e in &self.effects {
            if let Source::Sql(sql) = &e.source {
                DB::effect_counts(&self.pool, sql)
                    .await
                    .map_err(|why| format!("the query of effect {:?} fails: {why}", e.name))?;
            }
        }
        Ok(())
    }

    /// The messages of `scenario` and the index of the one to fault: decided by the seed.
    /// The rounds of a soak and the `shrink` runs are numbered apart; `count` overrides how
    /// many messages.
    fn schedule(
        &self,
        seed: u64,
        scenario: Scenario,
        (round, shrink): (u64, u64),
        count: Option<u64>,
    ) -> (Vec<Message>, usize) {
        let k = Scenario::ALL.iter().position(|s| *s == scenario).unwrap_or(0) as u64;
        let mut rng = Seeded::new(mix(seed, 1000 + k));
        let n = count.unwrap_or_else(|| rng.between(self.messages.0, self.messages.1));
        // Out of order takes two messages.
        let n = if scenario == Scenario::SessionOrder { n.max(2) } else { n };
        let generator = self.generator.as_ref().expect("checked in preflight");
        let messages: Vec<Message> = (0..n)
            .map(|j| {
                let index = round * 1_000_000_000 + shrink * 1_000_000 + k * 1000 + j;
                let mut own = Seeded::new(mix(seed, index));
                generator(&mut own, usize::try_from(index).unwrap_or(usize::MAX))
            })
            .collect();
        let messages = if scenario == Scenario::SessionOrder {
            out_of_order(&mut rng, messages)
        } else {
            messages
        };
        // In a session, the one sent again must have one sent (and handled) after it.
        let last = if scenario == Scenario::SessionOrder { messages.len() - 1 } else { usize::MAX };
        let candidates: Vec<usize> =
            (0..messages.len()).filter(|i| *i != last && !self.is_poison(&messages[*i])).collect();
        let target = if candidates.is_empty() {
            usize::MAX
        } else {
            candidates[usize::try_from(rng.next_u64() % candidates.len() as u64).unwrap_or(0)]
        };
        (messages, target)
    }

    /// The fake services of the effects, with the effects' names.
    fn services(
        &self,
    ) -> impl Iterator<Item = (&str, &Arc<super::FakeService>, Option<&super::CallKey>)> {
        self.effects.iter().filter_map(|e| match &e.source {
            Source::Service { service, by } => Some((e.name.as_str(), service, by.as_ref())),
            Source::Sql(_) => None,
        })
    }

    pub(super) fn is_poison(&self, m: &Message) -> bool {
        self.poison.as_ref().is_some_and(|p| p(m))
    }

    /// The check run as each message is completed: its effects must be there already.
    fn completion_check(&self) -> CompletionCheck {
        let effects: Vec<Effect> = self.effects.clone();
        let pool = self.pool.clone();
        let poison = self.poison.clone();
        Arc::new(move |m| {
            let effects = effects.clone();
            let pool = pool.clone();
            let poison = poison.clone();
            Box::pin(async move {
                if poison.as_ref().is_some_and(|p| p(&m.message)) {
                    return Vec::new();
                }
                let mut missing = Vec::new();
                for e in &effects {
                    let Some(key) = (e.key_of)(&m.message) else { continue };
                    let present = match &e.source {
                        Source::Sql(sql) => match DB::effect_counts(&pool, sql).await {
                            Ok(rows) => rows.iter().any(|(k, n)| *k == key && *n > 0),
                            // The query's failure is reported at the end of the scenario.
                            Err(_) => true,
                        },
                        Source::Service { service, by } => {
                            Source::service_effects(service, by.as_ref())
                                .get(&key)
                                .is_some_and(|n| *n > 0)
                        }
                    };
                    if !present {
                        missing.push((e.name.clone(), key));
                    }
                }
                missing
            })
        })
    }

    async fn start(&self, env: &Env<DB>, p: usize, renewal: bool) -> Result<Running, String> {
        let receiver =
            env.broker.receiver(&env.path).await.map_err(|e| format!("receiver: {e}"))?;
        let crashed = Arc::new(AtomicBool::new(false));
        let transport = Watched {
            inner: receiver,
            probe: Arc::clone(&env.probe),
            p,
            crashed: Arc::clone(&crashed),
        };
        let inbox = Faulted {
            inner: Arc::clone(&env.inbox),
            probe: Arc::clone(&env.probe),
            p,
            crashed: Arc::clone(&crashed),
        };
        let handler = Recorded { inner: (self.factory)(), probe: Arc::clone(&env.probe), p };
        let retry = RetryPolicy::new()
            .immediate_retries(0)
            .backoff(Duration::from_millis(10), Duration::from_millis(100));
        let probe = Arc::clone(&env.probe);
        let on_error =
            move |e: &twice::ProcessError| probe.push(Event::Error { p, text: e.to_string() });
        let on_committed = commit_hook(Arc::clone(&env.probe), p, Arc::clone(&crashed));
        let (stop, mut stopped) = watch::channel(false);
        let stopped = async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        let (counters, task) = if env.sessions {
            let mut options = SessionProcessorOptions::new()
                .max_concurrent_sessions(1)
                .mode(self.mode)
                .retry(retry)
                .clock(SharedClock::from(env.clock.clone()));
            if !renewal {
                options = options.max_auto_lock_renewal_duration(Duration::ZERO);
            }
            let processor = SessionProcessor::from_arcs(
                Arc::new(transport),
                Arc::new(inbox),
                Arc::new(handler),
                options,
            )
            .on_error(on_error)
            .on_committed(on_committed);
            (processor.counters(), tokio::spawn(processor.run(stopped)))
        } else {
            let mut options = ProcessorOptions::new()
                .mode(self.mode)
                .retry(retry)
                .clock(SharedClock::from(env.clock.clone()));
            if !renewal {
                options = options.max_auto_lock_renewal_duration(Duration::ZERO);
            }
            let processor = Processor::from_arcs(
                Arc::new(transport),
                Arc::new(inbox),
                Arc::new(handler),
                options,
            )
            .on_error(on_error)
            .on_committed(on_committed);
            (processor.counters(), tokio::spawn(processor.run(stopped)))
        };
        env.probe.push(Event::ProcessorStarted { p, renewal });
        Ok(Running { p, task, stop, counters })
    }

    /// Kills a processor where it is (its run future dropped).
    async fn kill(env: &Env<DB>, running: Running) {
        running.task.abort();
        let _ = running.task.await;
        env.probe.push(Event::ProcessorStopped { p: running.p, how: "was killed" });
    }

    /// Stops a processor gracefully and waits for its run to end.
    async fn stop(env: &Env<DB>, running: Running) -> Result<(), String> {
        let _ = running.stop.send(true);
        env.until("a processor to stop", || async { running.task.is_finished() }).await?;
        match running.task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("p{} stopped with an error: {e}", running.p)),
            Err(e) => return Err(format!("p{} panicked: {e}", running.p)),
        }
        env.probe.push(Event::ProcessorStopped { p: running.p, how: "stopped" });
        Ok(())
    }

    /// Lets the other copy of `id` run its handler to its end while the first copy (held by
    /// processor `first`) has not committed. Under [`Mode::Claim`] and [`Mode::DedupOnly`]
    /// the claim (or the record) holds the other copy back until the first ends, and so does
    /// SQLite's write lock in every mode: a short wait lets it get there. Otherwise nothing
    /// should hold it back: wait for it to start (as long as any step), then for it to return (a
    /// unique key the first copy holds may still stop it, which a shorter bound allows for).
    async fn rendezvous(&self, env: &Env<DB>, id: &str, first: usize) {
        let serialised = self.mode != Mode::NaturallyIdempotent || DB::NAME == "SQLite";
        // Where nothing holds the other copy back it does start; only its end may be held up.
        let (start, end) = if serialised {
            (RENDEZVOUS_POLLS, RENDEZVOUS_POLLS)
        } else {
            (POLLS, RENDEZVOUS_POLLS * 10)
        };
        let started = |e: &Event| matches!(e, Event::HandlerStarted { p, id: d, .. } if d == id && *p != first);
        let returned = |e: &Event| matches!(e, Event::HandlerReturned { p, id: d, .. } if d == id && *p != first);
        for _ in 0..start {
            if env.probe.saw(started) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if env.probe.saw(started) {
            for _ in 0..end {
                if env.probe.saw(returned) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
    }

    /// Runs one scenario; returns what it did, its failures and its errors.
    async fn scenario(
        &self,
        inbox: &Arc<SqlxInbox<DB>>,
        seed: u64,
        scenario: Scenario,
        messages: Vec<Message>,
        target: usize,
    ) -> (ScenarioRun, Vec<super::Failure>, Vec<String>) {
        let probe = Arc::new(Probe::new(self.completion_check()));
        let clock = ManualClock::default();
        let calls_before: Vec<usize> = self.services().map(|(_, s, _)| s.calls().len()).collect();
        let mut run = ScenarioRun {
            scenario,
            messages: messages.iter().map(id_of).collect(),
            target: messages.get(target).map(id_of),
            exercised: false,
            not_applicable: None,
            history: Vec::new(),
        };
        let mut errors = Vec::new();
        // The commit-unknown scenario's processors reach the store through a proxy.
        let mut cut = None;
        let inbox = if scenario == Scenario::CommitUnknown {
            match self.cut_inbox(&probe).await {
                Ok(Ok(c)) => Arc::clone(&cut.insert(c).inbox),
                Ok(Err(why)) => {
                    run.not_applicable = Some(why);
                    return (run, Vec::new(), Vec::new());
                }
                Err(e) => return (run, Vec::new(), vec![e]),
            }
        } else {
            Arc::clone(inbox)
        };
        let broker = match Broker::open(BrokerOptions::in_memory().clock(clock.clone())).await {
            Ok(b) => b,
            Err(e) => return (run, Vec::new(), vec![format!("the broker did not open: {e}")]),
        };
        let path = format!("prove-{}-{seed}", scenario.name());
        let sessions = scenario == Scenario::SessionOrder;
        let queue =
            QueueProperties::default().with_lock_duration(LOCK).with_requires_session(sessions);
        if let Err(e) = broker.create_queue(&path, queue).await {
            return (run, Vec::new(), vec![format!("the queue could not be created: {e}")]);
        }
        let env = Env { broker, clock, path, inbox, probe: Arc::clone(&probe), sessions };

        let mut sent: Vec<Message> = Vec::new();
        match self.drive(&env, scenario, &messages, target, &mut sent).await {
            Ok(exercised) => run.exercised = exercised,
            Err(e) => errors.push(e),
        }
        if errors.is_empty() && !run.exercised {
            errors.push(format!(
                "the fault was not exercised on {:?}: this run proves nothing about it",
                run.target.as_deref().unwrap_or("any message")
            ));
        }

        let events = probe.events();
        for e in &events {
            if let Event::HandlerPanicked { id, .. } = e {
                let why = events
                    .iter()
                    .find_map(|x| match x {
                        Event::Error { text, .. } if text.contains("panicked") => {
                            Some(text.clone())
                        }
                        _ => None,
                    })
                    .unwrap_or_default();
                errors.push(format!("the handler panicked on {id}: {why}"));
                break;
            }
        }
        let dead_lettered: HashSet<String> = env
            .broker
            .peek(&format!("{}/$DeadLetterQueue", env.path), SequenceNumber::new(0), 1000)
            .await
            .map(|ms| ms.iter().map(|m| m.message_id().as_str().to_owned()).collect())
            .unwrap_or_default();
        let mut counts = Vec::new();
        for e in &self.effects {
            counts.push(match &e.source {
                Source::Sql(sql) => match DB::effect_counts(&self.pool, sql).await {
                    Ok(rows) => rows.into_iter().collect::<HashMap<_, _>>(),
                    Err(why) => {
                        errors.push(format!("the query of effect {:?} fails: {why}", e.name));
                        HashMap::new()
                    }
                },
                Source::Service { service, by } => Source::service_effects(service, by.as_ref()),
            });
        }
        let infos: Vec<EffectInfo> = self
            .effects
            .iter()
            .map(|e| EffectInfo {
                name: e.name.clone(),
                in_database: matches!(e.source, Source::Sql(_)),
            })
            .collect();
        let sent: Vec<Sent> = sent
            .iter()
            .map(|m| Sent {
                id: id_of(m),
                poison: self.is_poison(m),
                keys: self.effects.iter().map(|e| (e.key_of)(m)).collect(),
            })
            .collect();
        let seen = Observed { events: &events, dead_lettered: &dead_lettered, counts: &counts };
        let failures = check(scenario, &infos, &sent, &seen);
        run.history = events.iter().map(ToString::to_string).collect();
        for ((name, service, by), before) in self.services().zip(calls_before) {
            for c in service.calls().iter().skip(before) {
                // Where the path does not name the key, the key the call counts under.
                let key =
                    by.and_then(|by| by(c)).map(|k| format!(" for {k:?}")).unwrap_or_default();
                run.history.push(format!(
                    "{name:?} got POST {}{key} with {} ({}{})",
                    c.path,
                    c.idempotency_key
                        .as_deref()
                        .map_or("no key".to_owned(), |k| format!("key {k}")),
                    if c.effect { "an effect" } else { "a replay" },
                    if c.failed { ", answered 503" } else { "" },
                ));
            }
        }
        env.broker.shutdown().await;
        if let Some(cut) = cut {
            cut.pool.close().await;
            drop(cut.proxy);
        }
        (run, failures, errors)
    }

    /// Sends the scenario's messages one at a time under its fault; returns whether the fault
    /// was exercised. `sent` collects every message sent (copies under new ids included).
    async fn drive(
        &self,
        env: &Env<DB>,
        scenario: Scenario,
        messages: &[Message],
        target: usize,
        sent: &mut Vec<Message>,
    ) -> Result<bool, String> {
        let renewal = scenario != Scenario::LockLoss;
        let mut next_p = 0;
        let mut a = self.start(env, next_p, renewal).await?;
        next_p += 1;
        let mut b = if scenario == Scenario::ConcurrentCopies {
            next_p += 1;
            Some(self.start(env, 1, true).await?)
        } else {
            None
        };
        if scenario == Scenario::SessionOrder {
            let exercised = self.session_order(env, messages, target, sent).await?;
            Self::stop(env, a).await?;
            return Ok(exercised);
        }
        let mut exercised = false;
        // Commit-unknown: for each message whose COMMIT was cut, whether it is the target (the
        // COMMIT reached the server) and whether the processor went on as the outcome asks.
        let mut cuts: Vec<(bool, bool)> = Vec::new();
        for (j, m) in messages.iter().enumerate() {
            let id = id_of(m);
            sent.push(m.clone());
            let poison = self.is_poison(m);
            match scenario {
                Scenario::ConcurrentCopies => {
                    if !poison {
                        env.probe.arm(&id, Action::Hold);
                    }
                    env.send(m.clone()).await?;
                    let held = || async { env.probe.held().is_some_and(|(h, _)| h == id) };
                    env.until("the first copy to be handled", || async {
                        held().await || env.settled().await
                    })
                    .await?;
                    if let Some((_, first)) = env.probe.held().filter(|(h, _)| *h == id) {
                        env.send(m.clone()).await?;
                        let other = |e: &Event| matches!(e, Event::Delivered { p, id: d, .. } if *d == id && *p != first);
                        env.until("the second copy to reach the other processor", || async {
                            env.probe.saw(other)
                        })
                        .await?;
                        exercised = true;
                        self.rendezvous(env, &id, first).await;
                        env.probe.release();
                    } else {
                        env.send(m.clone()).await?;
                    }
                    env.until_settled("both copies to settle").await?;
                }
                Scenario::NewMessageId => {
                    env.send(m.clone()).await?;
                    env.until_settled("the first message to settle").await?;
                    let again = format!("{id}-again");
                    let copy = m.clone().with_message_id(again.as_str());
                    sent.push(copy.clone());
                    env.send(copy).await?;
                    env.until_settled("the copy under a new id to settle").await?;
                    exercised |=
                        env.probe.saw(|e| matches!(e, Event::Delivered { id, .. } if *id == again));
                }
                Scenario::CrashAfterCommit if j == target => {
                    env.probe.arm_crash_on_commit(&id);
                    env.send(m.clone()).await?;
                    let crashed = |e: &Event| matches!(e, Event::Crashed { id: c, .. } if *c == id);
                    env.until("the commit (and the crash)", || async {
                        env.probe.saw(crashed) || env.settled().await
                    })
                    .await?;
                    if env.probe.saw(crashed) {
                        let dead = a.p;
                        Self::kill(env, a).await;
                        a = self.start(env, next_p, renewal).await?;
                        next_p += 1;
                        env.advance(LOCK + Duration::from_secs(1));
                        env.until_settled("the redelivery after the crash to settle").await?;
                        let committed_before =
                            env.probe.saw(|e| matches!(e, Event::Committed { p, id: c } if *p == dead && *c == id));
                        let redelivered = env.probe.saw(
                            |e| matches!(e, Event::Delivered { p, id: c, .. } if *p != dead && *c == id),
                        );
                        exercised = committed_before && redelivered;
                    }
                }
                Scenario::CrashBeforeCommit | Scenario::LockLoss if j == target => {
                    env.probe.arm(&id, Action::Hold);
                    env.send(m.clone()).await?;
                    env.until("the handler to reach its end", || async {
                        env.probe.held().is_some_and(|(h, _)| h == id) || env.settled().await
                    })
                    .await?;
                    if env.probe.held().is_some_and(|(h, _)| h == id) {
                        let old = a.p;
                        let lock_lost_before = a.counters.snapshot().lock_lost;
                        let replaced = self.start(env, next_p, true).await?;
                        next_p += 1;
                        let old_counters = Arc::clone(&a.counters);
                        if scenario == Scenario::CrashBeforeCommit {
                            Self::kill(env, std::mem::replace(&mut a, replaced)).await;
                            env.advance(LOCK + Duration::from_secs(1));
                        } else {
                            // The old processor stops receiving and waits for its handler,
                            // which the lock's expiry stops.
                            let old_running = std::mem::replace(&mut a, replaced);
                            let _ = old_running.stop.send(true);
                            env.advance(LOCK + Duration::from_secs(1));
                            Self::stop(env, old_running).await?;
                        }
                        env.until_settled("the redelivery to settle").await?;
                        let cancelled = env.probe.saw(
                            |e| matches!(e, Event::HandlerCancelled { p, id: c } if *p == old && *c == id),
                        );
                        let uncommitted = !env.probe.saw(
                            |e| matches!(e, Event::Committed { p, id: c } if *p == old && *c == id),
                        );
                        let lock_lost = old_counters.snapshot().lock_lost > lock_lost_before;
                        exercised = cancelled
                            && uncommitted
                            && (scenario == Scenario::CrashBeforeCommit || lock_lost);
                    }
                }
                Scenario::CrashBeforeClaim if j == target => {
                    env.probe.arm_crash_before_claim(&id);
                    env.send(m.clone()).await?;
                    let died = |e: &Event| matches!(e, Event::Fault { id: c, what: "died before its claim", .. } if *c == id);
                    env.until("the processor to die before its claim", || async {
                        env.probe.saw(died) || env.settled().await
                    })
                    .await?;
                    if env.probe.saw(died) {
                        let dead = a.p;
                        Self::kill(env, a).await;
                        a = self.start(env, next_p, renewal).await?;
                        next_p += 1;
                        env.advance(LOCK + Duration::from_secs(1));
                        env.until_settled("the redelivery after the crash to settle").await?;
                        let ran = env.probe.saw(|e| {
                            matches!(e, Event::HandlerStarted { p, id: c, .. } if *p == dead && *c == id)
                        });
                        let claimed_before = env.probe.saw(
                            |e| matches!(e, Event::Claim { p, id: c, .. } if *p == dead && *c == id),
                        );
                        let redelivered = env.probe.saw(|e| {
                            matches!(e, Event::Delivered { p, id: c, delivery } if *p != dead && *c == id && *delivery >= 2)
                        });
                        let claimed_after = env.probe.saw(|e| {
                            matches!(e, Event::Claim { p, id: c, outcome: "claimed" } if *p != dead && *c == id)
                        });
                        let claims = matches!(self.mode, Mode::Claim | Mode::DedupOnly);
                        exercised =
                            !ran && !claimed_before && redelivered && (claimed_after || !claims);
                    }
                }
                Scenario::CommitUnknown => {
                    if let Some(followed) = self.commit_unknown(env, &a, m, j == target).await? {
                        cuts.push((j == target, followed));
                    }
                }
                Scenario::TransientError if j == target => {
                    let services: Vec<_> = self
                        .effects
                        .iter()
                        .filter(|e| (e.key_of)(m).is_some())
                        .filter_map(|e| match &e.source {
                            Source::Service { service, .. } => Some(Arc::clone(service)),
                            Source::Sql(_) => None,
                        })
                        .collect();
                    let failed_before: usize = services.iter().map(|s| s.failed_calls()).sum();
                    if services.is_empty() {
                        env.probe.arm(&id, Action::Fail);
                    }
                    for s in &services {
                        s.fail_next(1);
                    }
                    env.send(m.clone()).await?;
                    env.until_settled("the message after its transient error to settle").await?;
                    for s in &services {
                        s.fail_next(0);
                    }
                    let failed_after: usize = services.iter().map(|s| s.failed_calls()).sum();
                    exercised = if services.is_empty() {
                        env.probe.saw(|e| matches!(e, Event::Fault { id: c, .. } if *c == id))
                    } else {
                        failed_after > failed_before
                    };
                }
                Scenario::DeadLetterResubmit if j == target => {
                    env.probe.arm(&id, Action::DeadLetter);
                    env.send(m.clone()).await?;
                    env.until_settled("the message to be dead-lettered").await?;
                    let dlq = format!("{}/$DeadLetterQueue", env.path);
                    let ours = |e: &Event| matches!(e, Event::Fault { id: c, .. } if *c == id);
                    if env.probe.saw(ours) {
                        let got = env
                            .broker
                            .receive_and_delete(&dlq, 1, Duration::ZERO)
                            .await
                            .map_err(|e| format!("receive from the dead-letter queue: {e}"))?;
                        let Some(dead) = got.into_iter().find(|d| d.message_id().as_str() == id)
                        else {
                            return Err(format!("{id} is not in the dead-letter queue"));
                        };
                        env.send(dead.message.clone()).await?;
                        env.probe.push(Event::Resubmitted { id: id.clone() });
                        env.until_settled("the resubmitted message to settle").await?;
                        exercised = env
                            .probe
                            .count(|e| matches!(e, Event::Delivered { id: c, .. } if *c == id))
                            >= 2;
                    }
                }
                _ => {
                    env.send(m.clone()).await?;
                    env.until_settled("the message to settle").await?;
                }
            }
        }
        Self::stop(env, a).await?;
        if let Some(b) = b.take() {
            Self::stop(env, b).await?;
        }
        if scenario == Scenario::CommitUnknown {
            // Every cut happened and was followed through, the target's among them.
            exercised = cuts.iter().any(|(t, _)| *t) && cuts.iter().all(|(_, ok)| *ok);
        }
        Ok(exercised)
    }
}
