//! The broker's operations, each declared once: its arguments, the type of its answer, and
//! what the runtime does with it.
//!
//! [`commands!`] turns the one list below into the [`Command`] enum the [`crate::Broker`]
//! handles send, the dispatch the runtime runs for each, and [`Command::fail`], which answers
//! a command the runtime cannot serve. A new operation is one engine method, one entry here and
//! one method on the handle.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::oneshot;
use twice::{EntityInfo, LockToken, Message, Properties, SequenceNumber, SessionId, Timestamp};

use super::reply::{Delivered, Done, Reply, plain};
use super::turn::Parked;
use super::{Runtime, StorageStats};
use crate::config::{EntityDefinition, Rule, SubscriptionProperties};
use crate::engine::{
    AcceptedSession, Counters, Engine, EntityCounts, ReceiveMode, RuleChange, SendOutcome,
    SessionLock,
};
use crate::error::Error;

/// Declares the operations: `|rt, now|` names the runtime and the time of the turn for the
/// bodies; each entry is a variant (with a `reply` field added, carrying its answer type) and
/// its body. An `answer` body evaluates to the result, which is replied at the end of the turn;
/// a `reply` body takes the reply itself and evaluates to the [`Done`] to queue, or `None` when
/// it parked the reply.
macro_rules! commands {
    (
        |$rt:ident, $now:ident|
        $(
            $(#[$meta:meta])*
            $name:ident { $($field:ident: $ty:ty),* $(,)? } -> $out:ty
                => $kind:ident($reply:ident) $body:block
        )*
    ) => {
        /// A request to the runtime task.
        #[derive(Debug)]
        pub(crate) enum Command {
            $(
                $(#[$meta])*
                $name { $($field: $ty,)* reply: Reply<$out> },
            )*
            /// Stops the runtime once every command before it is answered and durable.
            Shutdown { reply: oneshot::Sender<()> },
        }

        impl Command {
            /// Answers the command with `e`, without running it (a shutdown is acknowledged).
            pub(crate) fn fail(self, e: Error) {
                match self {
                    $(Command::$name { reply, .. } => {
                        let _ = reply.send(Err(e));
                    })*
                    Command::Shutdown { reply } => {
                        let _ = reply.send(());
                    }
                }
            }
        }

        /// Runs one command on the runtime and queues its reply for the end of the turn.
        fn dispatch($rt: &mut Runtime, $now: Timestamp, cmd: Command) {
            match cmd {
                $(
                    Command::$name { $($field,)* reply: $reply } => {
                        command_arm!($kind, $rt, $reply, $body)
                    }
                )*
                Command::Shutdown { reply } => $rt.shutdown.push(reply),
            }
        }
    };
}

/// One arm of [`dispatch`]: see [`commands!`].
macro_rules! command_arm {
    (answer, $rt:ident, $reply:ident, $body:block) => {{
        let result = $body;
        $rt.turn.push(plain($reply, result));
    }};
    (reply, $rt:ident, $reply:ident, $body:block) => {{
        if let Some(done) = $body {
            $rt.turn.push(done);
        }
    }};
}

commands! {
    |rt, now|

    CreateEntity { definition: EntityDefinition } -> () => answer(reply) {
        rt.engine.create_entity(now, definition).map(|_| ())
    }
    UpdateEntity { definition: EntityDefinition } -> () => answer(reply) {
        rt.engine.update_entity(now, definition)
    }
    DeleteEntity { path: String } -> () => answer(reply) {
        let eng = &mut rt.engine;
        eng.resolve(&path).and_then(|e| {
            if e.is_dead_letter() {
                return Err(Error::InvalidOperation(
                    "a dead-letter queue is deleted with its entity".to_owned(),
                ));
            }
            eng.delete_entity(now, e)
        })
    }
    GetEntity { path: String } -> EntityDefinition => answer(reply) {
        let eng = &rt.engine;
        eng.resolve(&path).and_then(|e| eng.definition(e))
    }
    ListEntities {} -> Vec<EntityDefinition> => answer(reply) {
        let eng = &rt.engine;
        let defs = eng.entities().into_iter().filter_map(|(e, _)| eng.definition(e).ok());
        Ok(defs.collect())
    }
    Reset {} -> usize => answer(reply) {
        rt.engine.reset(now)
    }
    ApplyDefinitions { definitions: Vec<EntityDefinition> } -> () => answer(reply) {
        rt.engine.apply_definitions(now, &definitions)
    }
    ChangeSubscription {
        topic: String,
        subscription: String,
        change: SubscriptionChange,
    } -> () => answer(reply) {
        let eng = &mut rt.engine;
        let path = format!("{topic}/Subscriptions/{subscription}");
        // A rule added or removed is recorded as that rule; a change of properties, or a
        // replaced rule, restates the subscription.
        let rule_change = match &change {
            SubscriptionChange::Properties(_) | SubscriptionChange::ReplaceRule(_) => None,
            SubscriptionChange::CreateRule(rule) => Some(RuleChange::Added(Box::new(rule.clone()))),
            SubscriptionChange::DeleteRule(name) => Some(RuleChange::Removed(name.clone())),
        };
        eng.resolve(&path).and_then(|e| eng.definition(e)).and_then(|d| {
            let d = change_subscription(d, change)?;
            match rule_change {
                Some(rule) => eng.change_rules(now, d, rule),
                None => eng.update_entity(now, d),
            }
        })
    }
    EntityInfo { path: String } -> EntityInfo => answer(reply) {
        let eng = &rt.engine;
        eng.resolve(&path).and_then(|e| eng.entity_info(e))
    }
    Counts { path: String } -> EntityCounts => answer(reply) {
        let eng = &rt.engine;
        eng.resolve(&path).and_then(|e| eng.counts(e))
    }
    Counters { path: Option<String> } -> Counters => answer(reply) {
        let eng = &rt.engine;
        match path {
            None => Ok(eng.total_counters()),
            Some(p) => eng.resolve(&p).and_then(|e| eng.counters(e)),
        }
    }
    Storage {} -> StorageStats => answer(reply) {
        let mut s = rt.stats;
        if let Some(log) = &rt.log {
            s.fsyncs = log.fsyncs();
            s.bytes_written = log.bytes_written();
            s.segments = log.segments().count() as u64;
        }
        Ok(s)
    }

    Send { path: PathArg, messages: Vec<Arc<Message>> } -> Vec<SendOutcome> => answer(reply) {
        let eng = &mut rt.engine;
        eng.resolve(path.as_str()).and_then(|e| eng.send_shared(now, e, messages))
    }
    /// A send of one message: the same as a batch of one, with nothing to allocate for the
    /// batch on the caller's side (where the broker's task would free it).
    SendOne { path: PathArg, message: Arc<Message> } -> SendOutcome => answer(reply) {
        let eng = &mut rt.engine;
        let r = eng.resolve(path.as_str()).and_then(|e| eng.send_shared(now, e, vec![message]));
        r.and_then(|mut out| {
            out.pop().ok_or_else(|| Error::Corrupt("a send without an outcome".to_owned()))
        })
    }
    Schedule {
        path: String,
        messages: Vec<Message>,
        at: Timestamp,
    } -> Vec<SequenceNumber> => answer(reply) {
        let eng = &mut rt.engine;
        eng.resolve(&path).and_then(|e| eng.schedule(now, e, messages, at))
    }
    CancelScheduled { path: String, sequence_numbers: Vec<SequenceNumber> } -> () => answer(reply) {
        let eng = &mut rt.engine;
        eng.resolve(&path).and_then(|e| eng.cancel_scheduled(now, e, &sequence_numbers))
    }
    Receive {
        path: PathArg,
        mode: ReceiveMode,
        wait: Wait,
        session: Option<SessionLock>,
    } -> Vec<Delivered> => reply(reply) {
        let parks = !wait.max_wait.is_zero();
        let w = if parks { Some(rt.new_waiter()) } else { None };
        let eng = &mut rt.engine;
        let r = match session {
            None => eng.resolve(path.as_str()).and_then(|e| eng.receive(now, e, mode, wait.max, w)),
            Some(lock) => eng.receive_session(now, lock, mode, wait.max, w),
        };
        match r {
            Ok(d) if d.is_empty() && parks => {
                if let Some(w) = w {
                    let deadline = now + wait.max_wait;
                    rt.park(w, Parked::Receive { reply, mode, deadline });
                }
                None
            }
            Ok(d) => {
                let after = rt.relaxed_after(mode, &d);
                Some(Done::Deliveries { reply, result: rt.materialize(d), after })
            }
            Err(e) => Some(plain(reply, Err(e))),
        }
    }
    ReceiveDeferred {
        path: String,
        sequence_numbers: Vec<SequenceNumber>,
        mode: ReceiveMode,
        session: Option<SessionLock>,
    } -> Vec<Delivered> => reply(reply) {
        let eng = &mut rt.engine;
        let r = eng
            .resolve(&path)
            .and_then(|e| eng.receive_deferred(now, e, &sequence_numbers, mode, session));
        match r {
            Ok(d) => {
                let after = rt.relaxed_after(mode, &d);
                Some(Done::Deliveries { reply, result: rt.materialize(d), after })
            }
            Err(e) => Some(plain(reply, Err(e))),
        }
    }
    Peek {
        path: String,
        from: SequenceNumber,
        max: usize,
        session: Option<SessionId>,
    } -> Vec<Delivered> => answer(reply) {
        let eng = &mut rt.engine;
        let r = eng.resolve(&path).and_then(|e| eng.peek(now, e, from, max, session.as_ref()));
        r.and_then(|d| rt.materialize(d))
    }
    Complete { entity: Option<PathArg>, tokens: Vec<LockToken> } -> () => answer(reply) {
        in_entity(&rt.engine, entity, &tokens).and_then(|()| rt.engine.complete(now, &tokens))
    }
    Abandon {
        entity: Option<PathArg>,
        token: LockToken,
        properties: Properties,
    } -> () => answer(reply) {
        in_entity(&rt.engine, entity, &[token])
            .and_then(|()| rt.engine.abandon(now, token, properties))
    }
    DeadLetter {
        entity: Option<PathArg>,
        token: LockToken,
        reason: Option<String>,
        description: Option<String>,
        properties: Properties,
    } -> () => answer(reply) {
        in_entity(&rt.engine, entity, &[token])
            .and_then(|()| rt.engine.dead_letter(now, token, reason, description, properties))
    }
    Defer { entity: Option<PathArg>, token: LockToken, properties: Properties } -> () => answer(reply) {
        in_entity(&rt.engine, entity, &[token])
            .and_then(|()| rt.engine.defer(now, token, properties))
    }
    Release { entity: Option<PathArg>, tokens: Vec<LockToken> } -> () => answer(reply) {
        in_entity(&rt.engine, entity, &tokens).and_then(|()| rt.engine.release(now, &tokens))
    }
    RenewLock { entity: Option<PathArg>, tokens: Vec<LockToken> } -> Vec<Timestamp> => answer(reply) {
        in_entity(&rt.engine, entity, &tokens).and_then(|()| rt.engine.renew_lock(now, &tokens))
    }
    Resubmit {
        path: String,
        sequence_numbers: Vec<SequenceNumber>,
    } -> Vec<SequenceNumber> => answer(reply) {
        let eng = &mut rt.engine;
        eng.resolve(&path).and_then(|e| eng.resubmit(now, e, &sequence_numbers))
    }

    AcceptSession {
        path: String,
        session: Option<SessionId>,
        max_wait: Duration,
    } -> Option<AcceptedSession> => reply(reply) {
        let parks = session.is_none() && !max_wait.is_zero();
        let w = if parks { Some(rt.new_waiter()) } else { None };
        let eng = &mut rt.engine;
        let r = eng.resolve(&path).and_then(|e| eng.accept_session(now, e, session, w));
        match r {
            Ok(None) if parks => {
                if let Some(w) = w {
                    let deadline = now + max_wait;
                    rt.park(w, Parked::Accept { reply, deadline });
                }
                None
            }
            result => Some(Done::Session { reply, result }),
        }
    }
    RenewSessionLock { lock: SessionLock } -> Timestamp => answer(reply) {
        rt.engine.renew_session_lock(now, lock)
    }
    ReleaseSession { lock: SessionLock } -> () => answer(reply) {
        rt.engine.release_session(now, lock)
    }
    GetSessionState { lock: SessionLock } -> Option<Bytes> => answer(reply) {
        rt.engine.session_state(lock)
    }
    SetSessionState { lock: SessionLock, state: Option<Bytes> } -> () => answer(reply) {
        rt.engine.set_session_state(now, lock, state)
    }
    ListSessions { path: String } -> Vec<SessionId> => answer(reply) {
        let eng = &rt.engine;
        eng.resolve(&path).and_then(|e| eng.sessions(now, e)).map(|sessions| {
            sessions.into_iter().filter(|s| s.has_messages).map(|s| s.session_id).collect()
        })
    }
}

/// The entity path of a command. Short paths (nearly all) are held inline, so that the
/// command carries no allocation of the caller's for the broker's task to free: a free of
/// memory another thread allocated is much dearer than one of its own.
#[derive(Clone)]
pub(crate) enum PathArg {
    Inline { len: u8, bytes: [u8; INLINE_PATH] },
    Heap(String),
}

/// The longest path a command holds inline.
const INLINE_PATH: usize = 62;

impl PathArg {
    pub(crate) fn new(path: &str) -> Self {
        match u8::try_from(path.len()) {
            Ok(len) if path.len() <= INLINE_PATH => {
                let mut bytes = [0u8; INLINE_PATH];
                bytes[..path.len()].copy_from_slice(path.as_bytes());
                PathArg::Inline { len, bytes }
            }
            _ => PathArg::Heap(path.to_owned()),
        }
    }

    pub(crate) fn as_str(&self) -> &str {
        match self {
            // The bytes are a prefix of a `str` cut at its end: always valid UTF-8.
            PathArg::Inline { len, bytes } => {
                std::str::from_utf8(&bytes[..usize::from(*len)]).unwrap_or_default()
            }
            PathArg::Heap(s) => s,
        }
    }
}

impl std::fmt::Debug for PathArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

/// How a receive waits.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Wait {
    pub(crate) max: usize,
    pub(crate) max_wait: Duration,
}

/// A change to a subscription that keeps the rest of its definition.
#[derive(Debug)]
pub(crate) enum SubscriptionChange {
    Properties(SubscriptionProperties),
    CreateRule(Rule),
    /// The rule of the same name becomes this one.
    ReplaceRule(Rule),
    DeleteRule(String),
}

impl Runtime {
    /// Applies one command to the engine and queues its reply for the end of the turn.
    pub(super) fn handle(&mut self, now: Timestamp, cmd: Command) {
        if let Some(io) = &self.failed {
            let e = Error::Io(std::io::Error::new(io.kind(), io.to_string()));
            cmd.fail(e);
            return;
        }
        dispatch(self, now, cmd);
    }
}

/// Checks that `tokens` lock messages of the entity a settlement names, if it names one
/// (see [`Engine::check_lock_entity`]).
fn in_entity(eng: &Engine, entity: Option<PathArg>, tokens: &[LockToken]) -> Result<(), Error> {
    let Some(path) = entity else { return Ok(()) };
    eng.resolve(path.as_str()).and_then(|e| eng.check_lock_entity(e, tokens))
}

/// Applies a change to a subscription definition.
fn change_subscription(
    d: EntityDefinition,
    change: SubscriptionChange,
) -> Result<EntityDefinition, Error> {
    let EntityDefinition::Subscription { topic, name, mut properties, mut rules } = d else {
        return Err(Error::InvalidOperation("only subscriptions have rules".to_owned()));
    };
    let rule_path = |rule: &str| format!("{topic}/Subscriptions/{name}/Rules/{rule}");
    match change {
        SubscriptionChange::Properties(p) => properties = p,
        SubscriptionChange::CreateRule(rule) => {
            if rules.iter().any(|r| r.name.eq_ignore_ascii_case(&rule.name)) {
                return Err(Error::EntityAlreadyExists(rule_path(&rule.name)));
            }
            rules.push(rule);
        }
        SubscriptionChange::ReplaceRule(rule) => {
            let Some(slot) = rules.iter_mut().find(|r| r.name.eq_ignore_ascii_case(&rule.name))
            else {
                return Err(Error::EntityNotFound(rule_path(&rule.name)));
            };
            *slot = rule;
        }
        SubscriptionChange::DeleteRule(rule) => {
            let before = rules.len();
            rules.retain(|r| !r.name.eq_ignore_ascii_case(&rule));
            if rules.len() == before {
                return Err(Error::EntityNotFound(rule_path(&rule)));
            }
            // Removing the last rule leaves a subscription that receives nothing, as in
            // Service Bus.
        }
    }
    Ok(EntityDefinition::subscription(topic, name, properties, rules))
}
