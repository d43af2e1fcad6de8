//! A tiny script language over the engine, for data-driven scenario tests.
//!
//! One command per line (`#` starts a comment). Commands that produce something print
//! `<command> => <result>`; errors always print. Time only moves with `advance`. Messages are
//! named by their message id; `complete a` settles the latest delivery of message `a`.
//!
//! ```text
//! queue q lock=30s max=3 ttl=10m dlq-exp dedup=1m session fwd=x fwd-dlq=y
//! topic t ttl=1h dedup=1m
//! sub t s lock=30s session rule=r1:label=red,prop.k=v rule=r2:true rule=r3:sql=1=1
//! update queue q ...           (same options; changes an existing entity)
//! delete q
//! config {"UserConfig": ...}   (applies a Config.json given on one line)
//! send q a,b,- session=s ttl=5s label=x corr=c ct=t to=x replyto=x prop.k=v size=100 at=+10s
//! schedule q a,b +10s          cancel q 1 2
//! recv q [n] [rad] [wait=w1]   ready                 unwait w1
//! peek q [from] [n] [session=s]
//! complete a b   abandon a [prop.k=v]   deadletter a [reason] [description]
//! defer a   release a   renew a   deferred q 3 4 [rad] [session=s]   resubmit q/$deadletterqueue 3
//! accept q [s] [wait=w1]   srecv s [n] [wait=w]   srenew s   srelease s   sstate s [= v | = -]
//! advance 30s   deadline   counts q   info q   restart
//! ```

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use twice::{
    LockToken, Message, MessageState, Properties, SequenceNumber, SessionId, Timestamp, Value,
};

use crate::config::{
    Config, CorrelationFilter, EntityDefinition, Filter, QueueProperties, Rule,
    SubscriptionProperties, TopicProperties,
};
use crate::engine::{
    Body, Delivery, Engine, EngineOptions, Location, ReceiveMode, Record, SendOutcome, SessionLock,
    SessionSummary, WaiterId,
};
use crate::error::Error;
use crate::sql::SqlFilter;

/// Runs `script` and compares its output with `expect` (both trimmed line by line).
#[track_caller]
pub(crate) fn check(script: &str, expect: &str) {
    let mut world = World::new();
    let got = world.run(script);
    let norm =
        |s: &str| s.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join("\n");
    let (got, want) = (norm(&got), norm(expect));
    assert!(got == want, "\n--- script output ---\n{got}\n--- expected ---\n{want}\n");
}

/// The engine under test, with a log held in memory.
pub(crate) struct World {
    pub(crate) engine: Engine,
    pub(crate) log: Vec<Record>,
    pub(crate) now: Timestamp,
    start: Timestamp,
    tokens: HashMap<String, LockToken>,
    sessions: HashMap<String, SessionLock>,
    waiters: HashMap<String, WaiterId>,
    next_seed: u64,
}

pub(crate) fn location(i: usize) -> Location {
    Location { segment: 0, offset: i as u64, len: 0 }
}

impl World {
    pub(crate) fn new() -> Self {
        let now = Timestamp::from_millis(1_893_456_000_000);
        Self {
            engine: Engine::new(EngineOptions { seed: 1, ..EngineOptions::default() }),
            log: Vec::new(),
            now,
            start: now,
            tokens: HashMap::new(),
            sessions: HashMap::new(),
            waiters: HashMap::new(),
            next_seed: 2,
        }
    }

    /// Writes the engine's new records to the log, telling it where bodies landed.
    pub(crate) fn sync(&mut self) {
        for r in self.engine.take_records() {
            let loc = location(self.log.len());
            if let Some(key) = r.body_key() {
                self.engine.set_location(key, loc);
            }
            self.log.push(r);
        }
    }

    /// Replays the log (through its encodings) into a fresh engine.
    pub(crate) fn restart(&mut self) -> Result<(), Error> {
        self.sync();
        self.next_seed += 1;
        let mut engine =
            Engine::new(EngineOptions { seed: self.next_seed, ..EngineOptions::default() });
        for (i, r) in self.log.iter().enumerate() {
            // Through the log's encoding (postcard) and through JSON, so that the records hold
            // no type a serde format cannot carry.
            let bytes = postcard::to_allocvec(r).map_err(|e| Error::Corrupt(e.to_string()))?;
            let back: Record =
                postcard::from_bytes(&bytes).map_err(|e| Error::Corrupt(e.to_string()))?;
            let json = serde_json::to_string(&back).map_err(|e| Error::Corrupt(e.to_string()))?;
            let back: Record =
                serde_json::from_str(&json).map_err(|e| Error::Corrupt(e.to_string()))?;
            engine.replay(back, location(i))?;
        }
        engine.finish_recovery(self.now)?;
        self.engine = engine;
        self.tokens.clear();
        self.sessions.clear();
        self.waiters.clear();
        self.sync();
        Ok(())
    }

    /// The message of a delivery, from memory or the log.
    pub(crate) fn message_of(&self, d: &Delivery) -> Arc<Message> {
        match &d.body {
            Body::Memory(m) => Arc::clone(m),
            Body::Stored(loc) => {
                let i = usize::try_from(loc.offset).unwrap_or(usize::MAX);
                self.log.get(i).and_then(Record::message).cloned().unwrap_or_default()
            }
        }
    }

    fn rel(&self, t: Timestamp) -> String {
        let ms = t.as_millis() - self.start.as_millis();
        if ms % 1000 == 0 { format!("+{}s", ms / 1000) } else { format!("+{ms}ms") }
    }

    fn fmt_delivery(&self, d: &Delivery) -> String {
        let m = self.message_of(d);
        let id = m.message_id.as_ref().map_or("?", |i| i.as_str());
        let mut s = format!("{id}#{} dc={}", d.meta.sequence_number, d.meta.delivery_count);
        match d.meta.state {
            MessageState::Deferred => s.push_str(" deferred"),
            MessageState::Scheduled => s.push_str(" scheduled"),
            _ => {}
        }
        if let Some(sid) = &m.session_id {
            let _ = write!(s, " s={sid}");
        }
        if let Some(x) = &d.meta.extra {
            if let Some(r) = &x.dead_letter_reason {
                let _ = write!(s, " dl={r:?}");
            }
            if let Some(src) = &x.dead_letter_source {
                let _ = write!(s, " src={src}");
            }
            if !x.properties.is_empty() {
                let props: Vec<_> =
                    x.properties.iter().map(|(k, v)| format!("{k}={}", fmt_value(v))).collect();
                let _ = write!(s, " {{{}}}", props.join(","));
            }
        }
        if let Some(e) = d.meta.expires_at {
            let _ = write!(s, " exp={}", self.rel(e));
        }
        s
    }

    fn fmt_deliveries(&mut self, ds: &[Delivery]) -> String {
        if ds.is_empty() {
            return "none".to_owned();
        }
        let mut parts = Vec::new();
        for d in ds {
            parts.push(self.fmt_delivery(d));
            if let Some(t) = d.meta.lock_token {
                let m = self.message_of(d);
                let id = m.message_id.as_ref().map_or("?", |i| i.as_str()).to_owned();
                self.tokens.insert(id, t);
            }
        }
        parts.join(", ")
    }

    pub(crate) fn run(&mut self, script: &str) -> String {
        let mut out = String::new();
        for line in script.lines() {
            let line = line.split(" #").next().unwrap_or("").trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let result = match self.exec(line) {
                Ok(s) => s,
                Err(e) => format!("err {e:?}"),
            };
            self.sync();
            if !result.is_empty() {
                let _ = writeln!(out, "{line} => {result}");
            }
        }
        out
    }

    fn token(&self, name: &str) -> LockToken {
        // An unknown name gets a token no lock has.
        self.tokens.get(name).copied().unwrap_or_else(|| LockToken::from_uuid(uuid::Uuid::nil()))
    }

    fn session(&self, name: &str) -> SessionLock {
        self.sessions.get(name).copied().unwrap_or(SessionLock(0))
    }

    fn waiter(&mut self, name: &str) -> WaiterId {
        let n = self.waiters.len() as u64 + 1;
        *self.waiters.entry(name.to_owned()).or_insert(WaiterId(n))
    }

    fn waiter_name(&self, id: WaiterId) -> String {
        self.waiters
            .iter()
            .find(|(_, w)| **w == id)
            .map_or_else(|| format!("{id:?}"), |(n, _)| n.clone())
    }

    fn exec(&mut self, line: &str) -> Result<String, Error> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let (cmd, args) = (words[0], &words[1..]);
        let now = self.now;
        let opts = |args: &[&str]| -> HashMap<String, String> {
            args.iter()
                .filter_map(|a| a.split_once('=').map(|(k, v)| (k.to_owned(), v.to_owned())))
                .collect()
        };
        let flags = |args: &[&str]| -> Vec<String> {
            args.iter().filter(|a| !a.contains('=')).map(|a| (*a).to_owned()).collect()
        };
        match cmd {
            "queue" | "topic" | "sub" => {
                let def = definition(cmd, args)?;
                self.engine.create_entity(now, def)?;
                Ok(String::new())
            }
            "update" => {
                let def = definition(args[0], &args[1..])?;
                self.engine.update_entity(now, def)?;
                Ok(String::new())
            }
            "delete" => {
                let e = self.engine.resolve(args[0])?;
                self.engine.delete_entity(now, e)?;
                Ok(String::new())
            }
            "config" => {
                let json = line.trim_start_matches("config").trim();
                let defs = Config::from_json(json)?.entities()?;
                self.engine.apply_definitions(now, &defs)?;
                Ok(String::new())
            }
            "send" => {
                let e = self.engine.resolve(args[0])?;
                let o = opts(&args[2..]);
                let mut msgs = Vec::new();
                for id in args[1].split(',') {
                    msgs.push(self.message(id, &o)?);
                }
                let out = self.engine.send(now, e, msgs)?;
                Ok(out
                    .iter()
                    .map(|o| match o {
                        SendOutcome::Enqueued(s) => s.to_string(),
                        SendOutcome::Duplicate => "dup".to_owned(),
                    })
                    .collect::<Vec<_>>()
                    .join(","))
            }
            "schedule" => {
                let e = self.engine.resolve(args[0])?;
                let o = opts(&args[3..]);
                let mut msgs = Vec::new();
                for id in args[1].split(',') {
                    msgs.push(self.message(id, &o)?);
                }
                let at = now + parse_dur(args[2].trim_start_matches('+'));
                let seqs = self.engine.schedule(now, e, msgs, at)?;
                Ok(seqs.iter().map(ToString::to_string).collect::<Vec<_>>().join(","))
            }
            "cancel" => {
                let e = self.engine.resolve(args[0])?;
                let seqs = seq_args(&args[1..]);
                self.engine.cancel_scheduled(now, e, &seqs)?;
                Ok("ok".to_owned())
            }
            "recv" => {
                let e = self.engine.resolve(args[0])?;
                let f = flags(&args[1..]);
                let o = opts(&args[1..]);
                let n = f.iter().find_map(|a| a.parse().ok()).unwrap_or(1);
                let mode = if f.iter().any(|a| a == "rad") {
                    ReceiveMode::ReceiveAndDelete
                } else {
                    ReceiveMode::PeekLock
                };
                let w = o.get("wait").map(|w| self.waiter(w));
                let ds = self.engine.receive(now, e, mode, n, w)?;
                Ok(self.fmt_deliveries(&ds))
            }
            "ready" => {
                let mut parts = Vec::new();
                for (w, ds) in self.engine.take_ready() {
                    let name = self.waiter_name(w);
                    parts.push(format!("{name}: {}", self.fmt_deliveries(&ds)));
                }
                for (w, s) in self.engine.take_ready_sessions() {
                    let name = self.waiter_name(w);
                    match s {
                        Some(s) => {
                            parts.push(format!(
                                "{name}: session {} until={}",
                                s.session_id,
                                self.rel(s.locked_until)
                            ));
                            self.sessions.insert(s.session_id.to_string(), s.lock);
                        }
                        None => parts.push(format!("{name}: no session")),
                    }
                }
                Ok(if parts.is_empty() { "none".to_owned() } else { parts.join("; ") })
            }
            "unwait" => {
                let w = self.waiter(args[0]);
                Ok(self.engine.cancel_waiter(w).to_string())
            }
            "peek" => {
                let e = self.engine.resolve(args[0])?;
                let f = flags(&args[1..]);
                let o = opts(&args[1..]);
                let from = f.first().and_then(|a| a.parse().ok()).unwrap_or(1);
                let n = f.get(1).and_then(|a| a.parse().ok()).unwrap_or(100);
                let session = o.get("session").map(|s| SessionId::new(s.clone()));
                let ds =
                    self.engine.peek(now, e, SequenceNumber::new(from), n, session.as_ref())?;
                let s = ds.iter().map(|d| self.fmt_delivery(d)).collect::<Vec<_>>().join(", ");
                Ok(if s.is_empty() { "none".to_owned() } else { s })
            }
            "complete" => {
                let tokens: Vec<_> = args.iter().map(|a| self.token(a)).collect();
                self.engine.complete(now, &tokens)?;
                Ok("ok".to_owned())
            }
            "abandon" => {
                let props = props(&opts(&args[1..]));
                self.engine.abandon(now, self.token(args[0]), props)?;
                Ok("ok".to_owned())
            }
            "deadletter" => {
                let reason = args.get(1).map(|s| (*s).to_owned());
                let desc = args.get(2).map(|s| (*s).to_owned());
                self.engine.dead_letter(
                    now,
                    self.token(args[0]),
                    reason,
                    desc,
                    Properties::new(),
                )?;
                Ok("ok".to_owned())
            }
            "defer" => {
                let props = props(&opts(&args[1..]));
                self.engine.defer(now, self.token(args[0]), props)?;
                Ok("ok".to_owned())
            }
            "release" => {
                let tokens: Vec<_> = args.iter().map(|a| self.token(a)).collect();
                self.engine.release(now, &tokens)?;
                Ok("ok".to_owned())
            }
            "renew" => {
                let tokens: Vec<_> = args.iter().map(|a| self.token(a)).collect();
                let untils = self.engine.renew_lock(now, &tokens)?;
                Ok(untils
                    .iter()
                    .map(|t| format!("until={}", self.rel(*t)))
                    .collect::<Vec<_>>()
                    .join(","))
            }
            "deferred" => {
                let e = self.engine.resolve(args[0])?;
                let f = flags(&args[1..]);
                let o = opts(&args[1..]);
                let mode = if f.iter().any(|a| a == "rad") {
                    ReceiveMode::ReceiveAndDelete
                } else {
                    ReceiveMode::PeekLock
                };
                let seqs = seq_args(&args[1..]);
                let session = o.get("session").map(|s| self.session(s));
                let ds = self.engine.receive_deferred(now, e, &seqs, mode, session)?;
                Ok(self.fmt_deliveries(&ds))
            }
            "resubmit" => {
                let e = self.engine.resolve(args[0])?;
                let seqs = self.engine.resubmit(now, e, &seq_args(&args[1..]))?;
                Ok(seqs.iter().map(ToString::to_string).collect::<Vec<_>>().join(","))
            }
            "accept" => {
                let e = self.engine.resolve(args[0])?;
                let f = flags(&args[1..]);
                let o = opts(&args[1..]);
                let w = o.get("wait").map(|w| self.waiter(w));
                let named = f.first().map(|s| SessionId::new(s.clone()));
                match self.engine.accept_session(now, e, named, w)? {
                    Some(s) => {
                        self.sessions.insert(s.session_id.to_string(), s.lock);
                        Ok(format!("{} until={}", s.session_id, self.rel(s.locked_until)))
                    }
                    None => Ok("none".to_owned()),
                }
            }
            "srecv" => {
                let f = flags(&args[1..]);
                let o = opts(&args[1..]);
                let n = f.iter().find_map(|a| a.parse().ok()).unwrap_or(1);
                let mode = if f.iter().any(|a| a == "rad") {
                    ReceiveMode::ReceiveAndDelete
                } else {
                    ReceiveMode::PeekLock
                };
                let w = o.get("wait").map(|w| self.waiter(w));
                let ds = self.engine.receive_session(now, self.session(args[0]), mode, n, w)?;
                Ok(self.fmt_deliveries(&ds))
            }
            "sessions" => {
                let e = self.engine.resolve(args[0])?;
                let list = self.engine.sessions(now, e)?;
                let fmt = |s: &SessionSummary| {
                    let mut out = s.session_id.to_string();
                    if !s.has_messages {
                        out.push_str(" (state only)");
                    }
                    if let Some(b) = &s.state {
                        out.push_str(&format!(" state={}", String::from_utf8_lossy(b)));
                    }
                    out
                };
                Ok(if list.is_empty() {
                    "none".to_owned()
                } else {
                    list.iter().map(fmt).collect::<Vec<_>>().join(", ")
                })
            }
            "srenew" => {
                let t = self.engine.renew_session_lock(now, self.session(args[0]))?;
                Ok(format!("until={}", self.rel(t)))
            }
            "srelease" => {
                self.engine.release_session(now, self.session(args[0]))?;
                Ok("ok".to_owned())
            }
            "sstate" => {
                let lock = self.session(args[0]);
                match args.get(1..) {
                    Some(["=", "-"]) => {
                        self.engine.set_session_state(now, lock, None)?;
                        Ok("ok".to_owned())
                    }
                    Some(["=", v]) => {
                        self.engine.set_session_state(
                            now,
                            lock,
                            Some(Bytes::from(v.to_string())),
                        )?;
                        Ok("ok".to_owned())
                    }
                    _ => Ok(match self.engine.session_state(lock)? {
                        Some(b) => String::from_utf8_lossy(&b).into_owned(),
                        None => "none".to_owned(),
                    }),
                }
            }
            "advance" => {
                self.now = self.now + parse_dur(args[0]);
                self.engine.tick(self.now);
                Ok(String::new())
            }
            "deadline" => Ok(match self.engine.next_deadline() {
                Some(t) => self.rel(t),
                None => "none".to_owned(),
            }),
            "counts" => {
                let e = self.engine.resolve(args[0])?;
                let c = self.engine.counts(e)?;
                Ok(format!(
                    "active={} locked={} deferred={} scheduled={} dlq={}",
                    c.active, c.locked, c.deferred, c.scheduled, c.dead_letter
                ))
            }
            "info" => {
                let e = self.engine.resolve(args[0])?;
                let i = self.engine.entity_info(e)?;
                Ok(format!(
                    "{} lock={}s max={:?} dedup={:?} session={}",
                    i.path,
                    i.lock_duration.as_secs(),
                    i.max_delivery_count,
                    i.duplicate_detection_window.map(|d| d.as_secs()),
                    i.requires_session
                ))
            }
            "restart" => {
                self.restart()?;
                Ok(String::new())
            }
            other => Err(Error::InvalidArgument(format!("unknown script command {other:?}"))),
        }
    }

    fn message(&self, id: &str, o: &HashMap<String, String>) -> Result<Message, Error> {
        let size = o.get("size").and_then(|s| s.parse().ok()).unwrap_or(0);
        let mut m = Message::new(Bytes::from(vec![b'x'; size]));
        if id != "-" {
            m.message_id = Some(id.into());
        }
        for (k, v) in o {
            match k.as_str() {
                "session" => m.session_id = Some(v.as_str().into()),
                "ttl" => m.time_to_live = Some(parse_dur(v)),
                "label" => m.subject = Some(v.clone()),
                "corr" => m.correlation_id = Some(v.clone()),
                "ct" => m.content_type = Some(v.clone()),
                "to" => m.to = Some(v.clone()),
                "replyto" => m.reply_to = Some(v.clone()),
                "at" => {
                    m.scheduled_enqueue_time = Some(self.now + parse_dur(v.trim_start_matches('+')))
                }
                "pk" => m.partition_key = Some(v.clone()),
                "size" => {}
                k if k.starts_with("prop.") => {
                    m.application_properties.insert(k[5..].to_owned(), parse_value(v));
                }
                other => {
                    return Err(Error::InvalidArgument(format!("unknown message option {other}")));
                }
            }
        }
        Ok(m)
    }
}

fn fmt_value(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Long(n) => n.to_string(),
        other => format!("{other:?}"),
    }
}

fn parse_value(v: &str) -> Value {
    v.parse::<i64>().map_or_else(|_| Value::String(v.to_owned()), Value::Long)
}

fn props(o: &HashMap<String, String>) -> Properties {
    o.iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("prop.")?.to_owned(), parse_value(v))))
        .collect()
}

fn seq_args(args: &[&str]) -> Vec<SequenceNumber> {
    args.iter().filter_map(|a| a.parse().ok()).map(SequenceNumber::new).collect()
}

pub(crate) fn parse_dur(s: &str) -> Duration {
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: u64 = n.parse().unwrap_or(0);
    match unit {
        "ms" => Duration::from_millis(n),
        "s" | "" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        "d" => Duration::from_secs(n * 86_400),
        _ => Duration::ZERO,
    }
}

fn definition(kind: &str, args: &[&str]) -> Result<EntityDefinition, Error> {
    let (name, rest, topic) = match kind {
        "sub" => (args[1], &args[2..], Some(args[0])),
        _ => (args[0], &args[1..], None),
    };
    let mut q = QueueProperties::default();
    let mut t = TopicProperties::default();
    let mut s = SubscriptionProperties::default();
    let mut rules = Vec::new();
    for a in rest {
        let (k, v) = a.split_once('=').unwrap_or((a, ""));
        match k {
            "lock" => {
                q.lock_duration = parse_dur(v);
                s.lock_duration = parse_dur(v);
            }
            "max" => {
                let n = v.parse().unwrap_or(0);
                q.max_delivery_count = n;
                s.max_delivery_count = n;
            }
            "ttl" => {
                q.default_message_time_to_live = Some(parse_dur(v));
                t.default_message_time_to_live = Some(parse_dur(v));
                s.default_message_time_to_live = Some(parse_dur(v));
            }
            "dlq-exp" => {
                q.dead_lettering_on_message_expiration = true;
                s.dead_lettering_on_message_expiration = true;
            }
            "dedup" => {
                q.requires_duplicate_detection = true;
                q.duplicate_detection_history_time_window = parse_dur(v);
                t.requires_duplicate_detection = true;
                t.duplicate_detection_history_time_window = parse_dur(v);
            }
            "session" => {
                q.requires_session = true;
                s.requires_session = true;
            }
            "fwd" => {
                q.forward_to = Some(v.to_owned());
                s.forward_to = Some(v.to_owned());
            }
            "fwd-dlq" => {
                q.forward_dead_lettered_messages_to = Some(v.to_owned());
                s.forward_dead_lettered_messages_to = Some(v.to_owned());
            }
            "rule" => {
                let (rname, spec) = v.split_once(':').unwrap_or((v, "true"));
                rules.push(Rule::new(rname, filter(spec)));
            }
            other => return Err(Error::InvalidArgument(format!("unknown entity option {other}"))),
        }
    }
    Ok(match (kind, topic) {
        ("queue", _) => EntityDefinition::queue(name, q),
        ("topic", _) => EntityDefinition::topic(name, t),
        (_, Some(topic)) => EntityDefinition::subscription(topic, name, s, rules),
        _ => return Err(Error::InvalidArgument(format!("unknown entity kind {kind}"))),
    })
}

fn filter(spec: &str) -> Filter {
    match spec {
        "true" => return Filter::True,
        "false" => return Filter::False,
        _ => {}
    }
    // Scripts split on whitespace, so `~` stands for a space in a SQL expression.
    if let Some(sql) = spec.strip_prefix("sql=") {
        return Filter::Sql(SqlFilter::parse(&sql.replace('~', " ")).expect("a valid SQL filter"));
    }
    let mut c = CorrelationFilter::default();
    for part in spec.split(',') {
        let (k, v) = part.split_once('=').unwrap_or((part, ""));
        let v = v.to_owned();
        match k {
            "id" => c.message_id = Some(v),
            "corr" => c.correlation_id = Some(v),
            "session" => c.session_id = Some(v),
            "label" => c.subject = Some(v),
            "to" => c.to = Some(v),
            "replyto" => c.reply_to = Some(v),
            "replytosession" => c.reply_to_session_id = Some(v),
            "ct" => c.content_type = Some(v),
            k => {
                if let Some(p) = k.strip_prefix("prop.") {
                    c.properties.insert(p.to_owned(), parse_value(&v));
                }
            }
        }
    }
    Filter::Correlation(c)
}
