//! The simulation the model test drives: the engine under random steps, beside the model.

#[allow(clippy::wildcard_imports)]
use super::*;

mod check;
mod sessions;

#[derive(Default)]
struct Receiver {
    tokens: Vec<LockToken>,
    session: Option<(String, SessionLock)>,
}

struct Segment {
    id: u32,
    records: Vec<Record>,
}

pub(super) struct Sim {
    seed: u64,
    rng: Rng,
    engine: Engine,
    segments: Vec<Segment>,
    now: Timestamp,
    model: Model,
    receivers: Vec<Receiver>,
    ids: Vec<String>,
    next_id: u64,
    json: bool,
    step: usize,
    trace: Vec<String>,
    /// Resolved entities (replay recreates them with the same ids, so they survive restarts).
    refs: [Option<EntityRef>; 4],
}

impl Sim {
    pub(super) fn new(seed: u64) -> Self {
        let now = Timestamp::from_millis(1_893_456_000_000);
        let mut engine = Engine::new(engine_options(seed, seed * 1000));
        let q = QueueProperties::default()
            .with_lock_duration(LOCK)
            .with_max_delivery_count(MAX_DC)
            .with_duplicate_detection(DEDUP)
            .with_dead_lettering_on_message_expiration(true);
        let s = QueueProperties::default()
            .with_lock_duration(LOCK)
            .with_max_delivery_count(MAX_DC)
            .with_default_message_time_to_live(S_TTL)
            .with_requires_session(true);
        engine.create_entity(now, EntityDefinition::queue("q", q)).expect("create q");
        engine.create_entity(now, EntityDefinition::queue("s", s)).expect("create s");
        let mut sim = Self {
            seed,
            rng: Rng(seed),
            engine,
            segments: vec![Segment { id: 0, records: Vec::new() }],
            now,
            model: Model::default(),
            receivers: (0..RECEIVERS).map(|_| Receiver::default()).collect(),
            ids: Vec::new(),
            next_id: 0,
            json: seed % 10 == 1,
            step: 0,
            trace: Vec::new(),
            refs: [None; 4],
        };
        for (i, (e, dlq)) in [(Ent::Q, false), (Ent::Q, true), (Ent::S, false), (Ent::S, true)]
            .into_iter()
            .enumerate()
        {
            sim.refs[i] = Some(sim.ent_ref(e, dlq));
        }
        sim.sync();
        sim
    }

    fn fail(&self, what: &str) -> ! {
        let tail: Vec<_> = self.trace.iter().rev().take(16).rev().cloned().collect();
        panic!("seed {} step {}: {what}\nlast steps:\n{}", self.seed, self.step, tail.join("\n"));
    }

    fn ent_ref(&self, e: Ent, dlq: bool) -> EntityRef {
        if let Some(r) = self.refs[usize::from(e == Ent::S) * 2 + usize::from(dlq)] {
            return r;
        }
        let path = match (e, dlq) {
            (Ent::Q, false) => "q",
            (Ent::Q, true) => "q/$DeadLetterQueue",
            (Ent::S, false) => "s",
            (Ent::S, true) => "s/$DeadLetterQueue",
        };
        self.engine.resolve(path).unwrap_or_else(|e| self.fail(&format!("resolve {path}: {e}")))
    }

    fn sync(&mut self) {
        for r in self.engine.take_records() {
            let key = r.body_key();
            // Every record goes through the log's encoding (postcard), and for one seed in ten
            // through JSON too, so the records hold no type a format cannot carry.
            let bytes =
                postcard::to_allocvec(&r).unwrap_or_else(|e| self.fail(&format!("encode: {e}")));
            let r: Record =
                postcard::from_bytes(&bytes).unwrap_or_else(|e| self.fail(&format!("decode: {e}")));
            let r = if self.json {
                let s = serde_json::to_string(&r)
                    .unwrap_or_else(|e| self.fail(&format!("encode: {e}")));
                serde_json::from_str(&s).unwrap_or_else(|e| self.fail(&format!("decode: {e}")))
            } else {
                r
            };
            let Some(seg) = self.segments.last_mut() else { self.fail("no segment") };
            let loc = Location { segment: seg.id, offset: seg.records.len() as u64, len: 0 };
            if let Some(key) = key {
                self.engine.set_location(key, loc);
            }
            seg.records.push(r);
        }
    }

    fn message_of(&self, d: &Delivery) -> Arc<Message> {
        match &d.body {
            Body::Memory(m) => Arc::clone(m),
            Body::Stored(loc) => self
                .segments
                .iter()
                .find(|s| s.id == loc.segment)
                .and_then(|s| s.records.get(usize::try_from(loc.offset).ok()?))
                .and_then(Record::message)
                .cloned()
                .unwrap_or_else(|| self.fail(&format!("body at {loc:?} is gone"))),
        }
    }

    pub(super) fn run(mut self, steps: usize) {
        for step in 0..steps {
            self.step = step;
            if self.trace.len() > 64 {
                self.trace.drain(..32);
            }
            self.one_step();
            // What a runtime does after each turn.
            self.engine.serve_waiters(self.now);
            drop(self.engine.take_freed());
            self.sync();
            // Keep the log short, as a runtime does: rotate full segments, compact old ones.
            if self.segments.last().is_some_and(|s| s.records.len() > 64) {
                self.rotate();
            }
            while self.segments.len() > 3 {
                self.compact();
            }
            self.check();
            self.model.msgs.retain(|m| m.state != MState::Gone);
        }
    }

    fn live(&self, e: Ent) -> usize {
        self.model.msgs.iter().filter(|m| m.ent == e && m.state != MState::Gone).count()
    }

    fn one_step(&mut self) {
        let r = self.rng.below(RECEIVERS);
        match self.rng.below(100) {
            0..=14 if self.live(Ent::Q) < 30 => self.send(Ent::Q),
            15..=22 if self.live(Ent::S) < 20 => self.send(Ent::S),
            0..=22 => self.advance(),
            23..=32 => self.receive(r, Ent::Q, false),
            33..=35 => self.receive(r, Ent::Q, true),
            36..=37 => self.receive(r, Ent::S, true),
            38 => self.receive(r, Ent::S, false),
            39..=48 => self.settle(r),
            49..=51 => self.receive_deferred(r),
            52..=57 => self.accept(r),
            58..=65 => self.session_receive(r),
            66..=68 => self.session_other(r),
            69 => self.cancel(),
            70..=71 => self.resubmit(),
            72..=89 => self.advance(),
            90..=93 => self.rotate(),
            94..=98 => self.compact(),
            _ => self.restart(),
        }
    }

    fn new_id(&mut self) -> String {
        self.next_id += 1;
        let id = format!("m{}", self.next_id);
        self.ids.push(id.clone());
        id
    }

    fn send(&mut self, e: Ent) {
        let n = 1 + self.rng.below(3);
        let mut msgs = Vec::new();
        let mut plan = Vec::new();
        for _ in 0..n {
            let id = if e == Ent::Q && self.rng.chance(20) && !self.ids.is_empty() {
                self.rng.pick(&self.ids).cloned().unwrap_or_default()
            } else {
                self.new_id()
            };
            let ttl = self.rng.chance(30).then(|| Duration::from_secs(5 + self.rng.next() % 26));
            let at = self
                .rng
                .chance(15)
                .then(|| self.now + Duration::from_secs(1 + self.rng.next() % 20));
            let session =
                (e == Ent::S).then(|| SESSIONS[self.rng.below(SESSIONS.len())].to_owned());
            let mut m = Message::new(Bytes::from(id.clone())).with_message_id(id.as_str());
            m.time_to_live = ttl;
            m.scheduled_enqueue_time = at;
            m.session_id = session.clone().map(SessionId::new);
            msgs.push(m);
            plan.push((id, ttl, at, session));
        }
        let target = self.ent_ref(e, false);
        self.trace.push(format!("send {e:?} {:?}", plan.iter().map(|p| &p.0).collect::<Vec<_>>()));
        let out = self
            .engine
            .send(self.now, target, msgs)
            .unwrap_or_else(|err| self.fail(&format!("send: {err}")));
        for ((id, ttl, at, session), outcome) in plan.into_iter().zip(out) {
            let dup = e == Ent::Q && self.model.dedup.get(&id).is_some_and(|&end| end > self.now);
            match (dup, outcome) {
                (true, SendOutcome::Duplicate) => continue,
                (false, SendOutcome::Enqueued(seq)) => {
                    let want = self.model.alloc(e);
                    if seq.get() != want {
                        self.fail(&format!("send {id}: sequence {seq}, model {want}"));
                    }
                    if e == Ent::Q {
                        self.model.dedup.insert(id.clone(), self.now + DEDUP);
                    }
                    let enqueued = at.unwrap_or(self.now);
                    let ttl_here = match e {
                        Ent::Q => ttl,
                        Ent::S => Some(ttl.map_or(S_TTL, |t| t.min(S_TTL))),
                    };
                    self.model.msgs.push(MMsg {
                        id,
                        ent: e,
                        dlq: false,
                        seq: want,
                        session,
                        state: if at.is_some() { MState::Scheduled } else { MState::Active },
                        dc: 1,
                        ttl,
                        expires: ttl_here.map(|t| enqueued + t),
                        at,
                        seen_dc: 1,
                    });
                }
                (dup, got) => self.fail(&format!("send {id}: got {got:?}, model duplicate={dup}")),
            }
        }
    }

    /// Checks deliveries against the model's prediction and applies them.
    fn take(
        &mut self,
        r: usize,
        expect: Vec<usize>,
        got: &[Delivery],
        mode: ReceiveMode,
        session_until: Option<Timestamp>,
    ) {
        let got_ids: Vec<(String, i64, u32)> = got
            .iter()
            .map(|d| {
                let m = self.message_of(d);
                (
                    m.message_id.clone().map(|i| i.into_string()).unwrap_or_default(),
                    d.meta.sequence_number.get(),
                    d.meta.delivery_count,
                )
            })
            .collect();
        let want: Vec<(String, i64, u32)> = expect
            .iter()
            .map(|&i| {
                (self.model.msgs[i].id.clone(), self.model.msgs[i].seq, self.model.msgs[i].dc)
            })
            .collect();
        if got_ids != want {
            self.fail(&format!("delivered {got_ids:?}, model says {want:?}"));
        }
        for (d, i) in got.iter().zip(expect) {
            match mode {
                ReceiveMode::ReceiveAndDelete => self.model.msgs[i].state = MState::Gone,
                ReceiveMode::PeekLock => {
                    let Some(token) = d.meta.lock_token else {
                        self.fail("peek-lock delivery without a lock")
                    };
                    let until = session_until.unwrap_or(self.now + LOCK);
                    if d.meta.locked_until != Some(until) {
                        self.fail(&format!(
                            "locked until {:?}, model {until:?}",
                            d.meta.locked_until
                        ));
                    }
                    let m = &mut self.model.msgs[i];
                    m.state = match m.state {
                        MState::Deferred => MState::DeferredLocked { token, until },
                        _ => MState::Locked { token, until },
                    };
                    let tokens = &mut self.receivers[r].tokens;
                    tokens.push(token);
                    if tokens.len() > 8 {
                        tokens.remove(0);
                    }
                }
            }
        }
    }

    fn receive(&mut self, r: usize, e: Ent, dlq: bool) {
        let n = 1 + self.rng.below(3);
        let mode =
            if self.rng.chance(10) { ReceiveMode::ReceiveAndDelete } else { ReceiveMode::PeekLock };
        let target = self.ent_ref(e, dlq);
        self.trace.push(format!("r{r} receive {e:?} dlq={dlq} n={n} {mode:?}"));
        let got = self.engine.receive(self.now, target, mode, n, None);
        if e == Ent::S && !dlq {
            if !matches!(got, Err(Error::SessionRequired(_))) {
                self.fail(&format!("non-session receive on a session queue: {got:?}"));
            }
            return;
        }
        let got = got.unwrap_or_else(|err| self.fail(&format!("receive: {err}")));
        let mut expect = self.model.available(e, dlq, None, self.now);
        expect.truncate(n);
        self.take(r, expect, &got, mode, None);
    }

    fn settle(&mut self, r: usize) {
        let Some(&token) = self.rng.pick(&self.receivers[r].tokens) else { return };
        let target = self.model.by_token(token);
        let op = self.rng.below(6);
        self.trace.push(format!(
            "r{r} settle op={op} {token} -> {:?}",
            target.map(|i| &self.model.msgs[i].id)
        ));
        let now = self.now;
        let result = match op {
            0 => self.engine.complete(now, &[token]).map(|()| None),
            1 => self.engine.abandon(now, token, Properties::new()).map(|()| None),
            2 => self
                .engine
                .dead_letter(now, token, Some("Bad".to_owned()), None, Properties::new())
                .map(|()| None),
            3 => self.engine.defer(now, token, Properties::new()).map(|()| None),
            4 => self.engine.release(now, &[token]).map(|()| None),
            _ => self.engine.renew_lock(now, &[token]).map(|v| v.first().copied()),
        };
        let Some(i) = target else {
            if !matches!(result, Err(Error::MessageLockLost)) {
                self.fail(&format!("settle with a dead token: {result:?}"));
            }
            return;
        };
        if op == 2 && self.model.msgs[i].dlq {
            if !matches!(result, Err(Error::InvalidOperation(_))) {
                self.fail(&format!("dead-letter in the dead-letter queue: {result:?}"));
            }
            return;
        }
        let until = match result {
            Ok(until) => until,
            Err(err) => self.fail(&format!("settle op {op}: {err}")),
        };
        let deferred = matches!(self.model.msgs[i].state, MState::DeferredLocked { .. });
        match op {
            0 => self.model.msgs[i].state = MState::Gone,
            1 => self.model.unlock_counted(i, now),
            2 => self.model.dead_letter(i),
            3 => {
                self.model.msgs[i].state = MState::Deferred;
                self.model.expire_if_due(i, now);
            }
            4 => {
                self.model.msgs[i].state = if deferred { MState::Deferred } else { MState::Active };
                self.model.expire_if_due(i, now);
            }
            _ => {
                let want = now + LOCK;
                if until != Some(want) {
                    self.fail(&format!("renewed until {until:?}, model {want:?}"));
                }
                let m = &mut self.model.msgs[i];
                let session = (m.ent == Ent::S && !m.dlq).then(|| m.session.clone()).flatten();
                match session {
                    Some(s) => self.renew_session_in_model(&s, want),
                    None => {
                        if let MState::Locked { until, .. } | MState::DeferredLocked { until, .. } =
                            &mut m.state
                        {
                            *until = want;
                        }
                    }
                }
            }
        }
    }

    fn renew_session_in_model(&mut self, session: &str, until: Timestamp) {
        if let Some(h) = self.model.holders.get_mut(session) {
            h.until = until;
        }
        for m in &mut self.model.msgs {
            if m.ent == Ent::S
                && !m.dlq
                && m.session.as_deref() == Some(session)
                && let MState::Locked { until: u, .. } | MState::DeferredLocked { until: u, .. } =
                    &mut m.state
            {
                *u = until;
            }
        }
    }

    fn receive_deferred(&mut self, r: usize) {
        let deferred: Vec<i64> = self
            .model
            .msgs
            .iter()
            .filter(|m| m.ent == Ent::Q && !m.dlq && m.state == MState::Deferred)
            .map(|m| m.seq)
            .collect();
        let seq = match self.rng.pick(&deferred) {
            Some(&s) if self.rng.chance(80) => s,
            _ => 1 + i64::try_from(self.rng.below(40)).unwrap_or(0),
        };
        let target = self.ent_ref(Ent::Q, false);
        self.trace.push(format!("r{r} receive deferred {seq}"));
        let got = self.engine.receive_deferred(
            self.now,
            target,
            &[SequenceNumber::new(seq)],
            ReceiveMode::PeekLock,
            None,
        );
        match self.model.find(Ent::Q, false, seq) {
            Some(i)
                if self.model.msgs[i].state == MState::Deferred
                    && !self.model.msgs[i].expired(self.now) =>
            {
                let got = got.unwrap_or_else(|err| self.fail(&format!("receive deferred: {err}")));
                self.take(r, vec![i], &got, ReceiveMode::PeekLock, None);
            }
            Some(i) if self.model.msgs[i].state == MState::Deferred => {
                // Past its time to live: the receive expires it and finds nothing.
                self.model.expire(i);
                if !matches!(got, Err(Error::MessageNotFound(s)) if s == seq) {
                    self.fail(&format!("receive expired deferred {seq}: {got:?}"));
                }
            }
            _ => {
                if !matches!(got, Err(Error::MessageNotFound(s)) if s == seq) {
                    self.fail(&format!("receive deferred {seq}: {got:?}"));
                }
            }
        }
    }

    fn cancel(&mut self) {
        let scheduled: Vec<i64> = self
            .model
            .msgs
            .iter()
            .filter(|m| m.ent == Ent::Q && m.state == MState::Scheduled)
            .map(|m| m.seq)
            .collect();
        let seq = match self.rng.pick(&scheduled) {
            Some(&s) => s,
            None => 1 + i64::try_from(self.rng.below(40)).unwrap_or(0),
        };
        let target = self.ent_ref(Ent::Q, false);
        self.trace.push(format!("cancel {seq}"));
        let got = self.engine.cancel_scheduled(self.now, target, &[SequenceNumber::new(seq)]);
        match self.model.find(Ent::Q, false, seq) {
            Some(i) if self.model.msgs[i].state == MState::Scheduled => {
                got.unwrap_or_else(|err| self.fail(&format!("cancel: {err}")));
                self.model.msgs[i].state = MState::Gone;
            }
            _ => {
                if !matches!(got, Err(Error::MessageNotFound(_))) {
                    self.fail(&format!("cancel {seq}: {got:?}"));
                }
            }
        }
    }

    fn resubmit(&mut self) {
        let dead: Vec<i64> = self
            .model
            .msgs
            .iter()
            .filter(|m| {
                m.ent == Ent::Q && m.dlq && matches!(m.state, MState::Active | MState::Deferred)
            })
            .map(|m| m.seq)
            .collect();
        let Some(&seq) = self.rng.pick(&dead) else { return };
        let target = self.ent_ref(Ent::Q, true);
        self.trace.push(format!("resubmit {seq}"));
        let got = self
            .engine
            .resubmit(self.now, target, &[SequenceNumber::new(seq)])
            .unwrap_or_else(|err| self.fail(&format!("resubmit: {err}")));
        let Some(i) = self.model.find(Ent::Q, true, seq) else {
            self.fail("model lost a dead letter")
        };
        let new_seq = self.model.alloc(Ent::Q);
        if got != [SequenceNumber::new(new_seq)] {
            self.fail(&format!("resubmitted as {got:?}, model {new_seq}"));
        }
        let now = self.now;
        let m = &mut self.model.msgs[i];
        m.dlq = false;
        m.seq = new_seq;
        m.dc = 1;
        m.seen_dc = 1;
        m.state = MState::Active;
        m.expires = m.ttl.map(|t| now + t);
    }

    fn advance(&mut self) {
        let d = if self.rng.chance(20) {
            Duration::from_millis(100 + self.rng.next() % 900)
        } else {
            Duration::from_secs(1 + self.rng.next() % 15)
        };
        self.now = self.now + d;
        self.trace.push(format!("advance {d:?}"));
        self.engine.tick(self.now);
        self.model.advance(self.now);
        let next = self.engine.next_deadline();
        if next.is_some_and(|t| t <= self.now) {
            self.fail(&format!("a deadline {next:?} is due after tick"));
        }
    }

    fn rotate(&mut self) {
        self.trace.push("rotate".to_owned());
        let id = self.segments.last().map_or(0, |s| s.id + 1);
        let records = self.engine.checkpoint_records();
        self.segments.push(Segment { id, records });
    }

    fn compact(&mut self) {
        if self.segments.len() < 2 {
            return;
        }
        let oldest = self.segments[0].id;
        let live = self.engine.live_in_segment(oldest);
        self.trace.push(format!("compact segment {oldest}: {} live", live.len()));
        for r in &live {
            let msg = self.segments[0]
                .records
                .get(usize::try_from(r.location.offset).unwrap_or(usize::MAX))
                .and_then(Record::message)
                .cloned()
                .unwrap_or_else(|| self.fail("a live message's record is missing"));
            self.engine.relocate(r, msg);
        }
        self.sync();
        if self.engine.segment_refs(oldest) != 0 {
            self.fail("relocation left live messages in the oldest segment");
        }
        self.segments.remove(0);
    }

    fn restart(&mut self) {
        self.trace.push("restart".to_owned());
        self.sync();
        let mut engine = Engine::new(engine_options(self.seed, self.rng.next()));
        for seg in &self.segments {
            for (i, r) in seg.records.iter().enumerate() {
                let loc = Location { segment: seg.id, offset: i as u64, len: 0 };
                if let Err(e) = engine.replay(r.clone(), loc) {
                    self.fail(&format!("replay of segment {} record {i}: {e}", seg.id));
                }
            }
        }
        if let Err(e) = engine.finish_recovery(self.now) {
            self.fail(&format!("recovery: {e}"));
        }
        self.engine = engine;
        self.model.restart(self.now);
        self.model.advance(self.now);
    }
}
