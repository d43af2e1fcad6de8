//! Sessions and links: `begin` and `end`, attach and detach, and the pools of channels and
//! handles. Their state is in [`super::state`].

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use twice::SessionId;

use crate::address::{self, Node};
use crate::backend::{Backend, BackendSession, EntityKind, ReceiveMode};
use crate::codec::Value;
use crate::conditions::{self as cond, not_found};
use crate::ids::IdPool;
use crate::performative::{AmqpError, Attach, Begin, Detach, Flow, Performative, ROLE_RECEIVER};
use crate::sas::Claim;

use super::links::{pump, settler, watch_session_lock};
use super::state::{Event, Link, PumpCtl, Session, Source, max_channel, update_pump};
use super::{Conn, DEFAULT_SESSION_WAIT, End, SENDER_CREDIT, SESSION_WINDOW};

impl<B: Backend> Conn<B> {
    pub(super) fn on_begin(&mut self, ch: u16, b: &Begin) -> Result<(), End> {
        // Beyond the channel-max twice announced: a framing error (AMQP 1.0 section 2.7.1),
        // which bounds the sessions of a connection.
        if ch > max_channel(self.shared.options.max_sessions_per_connection) {
            return Err(End::Close(Some(AmqpError::new(
                cond::FRAME_TOO_LARGE,
                format!("begin on channel {ch}, beyond the channel-max announced"),
            ))));
        }
        if ch > self.channel_max || self.sessions.contains_key(&ch) {
            return Ok(());
        }
        // At most as many sessions as channels, so a local channel always fits.
        let local = u16::try_from(self.channels.take()).unwrap_or(u16::MAX);
        self.sessions.insert(
            ch,
            Session {
                local_channel: local,
                next_outgoing_id: 0,
                next_delivery_id: 0,
                next_incoming_id: b.next_outgoing_id,
                incoming_window: SESSION_WINDOW,
                remote_incoming_window: b.incoming_window,
                frames_since_flow: 0,
                links: HashMap::new(),
                handles: IdPool::default(),
                unsettled: BTreeMap::new(),
                outgoing: VecDeque::new(),
            },
        );
        self.out.send(
            local,
            &Performative::Begin(Begin {
                remote_channel: Some(ch),
                next_outgoing_id: 0,
                incoming_window: SESSION_WINDOW,
                outgoing_window: SESSION_WINDOW,
                handle_max: handle_max(self.shared.options.max_links_per_session),
            }),
        );
        Ok(())
    }

    /// Forgets a session and everything its links hold (without sending anything).
    pub(super) fn drop_session(&mut self, ch: u16) {
        let Some(mut s) = self.sessions.remove(&ch) else { return };
        self.channels.give_back(u32::from(s.local_channel));
        s.discard_outgoing(None);
        for (_, link) in s.links.drain() {
            self.links.remove(&link.id);
            release_link(link);
        }
    }

    /// Records a link and checks what needs no broker; the broker's answer about the entity
    /// comes back as [`Event::Resolved`].
    pub(super) fn on_attach(&mut self, ch: u16, a: Attach) -> Result<(), End> {
        let max_links = self.shared.options.max_links_per_session;
        // Beyond the handle-max twice announced: a framing error (AMQP 1.0 section 2.7.2),
        // which bounds the links of a session.
        if a.handle > handle_max(max_links) {
            return Err(End::Close(Some(AmqpError::new(
                cond::FRAME_TOO_LARGE,
                format!("attach with handle {}, beyond the handle-max announced", a.handle),
            ))));
        }
        let Some(s) = self.sessions.get_mut(&ch) else { return Ok(()) };
        if let Some(old) = s.links.get(&a.handle).map(|l| l.id) {
            // A reused handle: the client forgot the old link; so does twice.
            s.discard_outgoing(Some(old));
            if let Some(old) = s.remove_link(a.handle) {
                self.links.remove(&old.id);
                release_link(old);
            }
        }
        let client_receives = a.role == ROLE_RECEIVER;
        let terminus = crate::performative::Terminus::parse(
            if client_receives { a.source.as_ref() } else { a.target.as_ref() },
            client_receives,
        );
        let path = address::normalize(terminus.address.as_deref().unwrap_or(""));
        let node = Node::of(&path);
        let target_address = crate::performative::Terminus::parse(a.target.as_ref(), false).address;
        let id = self.next_link_id;
        self.next_link_id += 1;
        let local_handle = s.handles.take();
        let mode = if client_receives && a.snd_settle_mode == Some(1) {
            ReceiveMode::ReceiveAndDelete
        } else {
            ReceiveMode::PeekLock
        };
        let link = Link {
            id,
            name: a.name.clone(),
            local_handle,
            client_receives,
            node: node.clone(),
            path: path.clone(),
            target_address,
            rx_delivery_count: a.initial_delivery_count.unwrap_or(0),
            attach: a,
            attached: false,
            detached: false,
            mode,
            delivery_count: 0,
            credit: 0,
            drain: false,
            drain_seq: 0,
            taken: 0,
            unsettled: 0,
            pump: None,
            session: None,
            settle: None,
            lock_watch: None,
            replies: VecDeque::new(),
            rx_credit: 0,
            rx_in_flight: 0,
            partial: None,
            sends: None,
            requests: None,
        };
        let handle = link.attach.handle;
        let too_many = s.links.len() >= max_links;
        s.links.insert(handle, link);
        self.links.insert(id, (ch, handle));
        if too_many {
            let error = AmqpError::new(
                cond::RESOURCE_LIMIT,
                format!("a session may attach at most {max_links} links"),
            );
            self.refuse(ch, handle, error);
            return Ok(());
        }
        let entity = match &node {
            Node::Cbs => {
                self.accept_attach(ch, handle, None);
                return Ok(());
            }
            Node::Management(e) | Node::Entity(e) => e.clone(),
        };
        // A token for the entity covers its management node; so does one for the node.
        let need = match &node {
            Node::Management(_) | Node::Cbs => None,
            Node::Entity(_) if client_receives => Some(Claim::Listen),
            Node::Entity(_) => Some(Claim::Send),
        };
        if !self.authorized(&path, need) {
            let error = AmqpError::new(
                cond::UNAUTHORIZED,
                format!("unauthorized access to '{entity}': put a valid token to $cbs first"),
            );
            self.refuse(ch, handle, error);
            return Ok(());
        }
        let backend = self.shared.backend.clone();
        let events = self.events.clone();
        tokio::spawn(async move {
            let kind = backend.entity(&entity).await;
            let _ = events.send(Event::Resolved { link: id, kind });
        });
        Ok(())
    }

    /// Finishes an attach once the broker said what its entity is.
    pub(super) fn on_resolved(&mut self, link: u64, kind: Option<EntityKind>) {
        let Some(&(ch, handle)) = self.links.get(&link) else { return };
        let Some(l) = self.sessions.get(&ch).and_then(|s| s.links.get(&handle)) else { return };
        if l.detached {
            // Refused meanwhile (a transfer beyond its credit).
            return;
        }
        let (e, node) = match &l.node {
            Node::Cbs => return,
            Node::Management(e) | Node::Entity(e) => (e.clone(), l.node.clone()),
        };
        let Some(kind) = kind else {
            // A broker whose storage failed answers no question: the entity is not missing.
            let error = match self.shared.backend.health() {
                Err(reason) => cond::unavailable(&reason),
                Ok(()) => not_found(&e),
            };
            self.refuse(ch, handle, error);
            return;
        };
        if let Node::Management(_) = node {
            self.accept_attach(ch, handle, None);
            return;
        }
        let client_receives = l.client_receives;
        if !client_receives {
            if matches!(kind, EntityKind::Subscription { .. } | EntityKind::DeadLetter) {
                let error = AmqpError::new(cond::NOT_ALLOWED, format!("cannot send to '{e}'"));
                self.refuse(ch, handle, error);
            } else {
                self.accept_attach(ch, handle, None);
            }
            return;
        }
        if kind == EntityKind::Topic {
            let error = AmqpError::new(
                cond::NOT_ALLOWED,
                format!("cannot receive from topic '{e}'; receive from one of its subscriptions"),
            );
            self.refuse(ch, handle, error);
            return;
        }
        let terminus = crate::performative::Terminus::parse(l.attach.source.as_ref(), true);
        let session_filter = terminus.filter.as_ref().and_then(|f| f.as_map()).and_then(|m| {
            m.iter()
                .find(|(k, _)| k.as_str() == Some(cond::SESSION_FILTER))
                .map(|(_, v)| v.undescribed().clone())
        });
        let Some(want) = session_filter else {
            if kind.requires_session() {
                let error = AmqpError::new(
                    cond::NOT_ALLOWED,
                    "It is not possible for an entity that requires sessions to create a non-sessionful message receiver.",
                );
                self.refuse(ch, handle, error);
            } else {
                self.accept_attach(ch, handle, None);
            }
            return;
        };
        let want = want.as_str().map(SessionId::new);
        let wait = l
            .attach
            .properties
            .as_ref()
            .and_then(|p| p.get(cond::TIMEOUT_PROPERTY))
            .and_then(Value::as_i64)
            .and_then(|ms| u64::try_from(ms).ok())
            .map_or(DEFAULT_SESSION_WAIT, Duration::from_millis);
        let wait = if want.is_some() { Duration::ZERO } else { wait };
        let backend = self.shared.backend.clone();
        let events = self.events.clone();
        tokio::spawn(async move {
            // Bounded in real time whatever clock the broker runs on.
            let result = match tokio::time::timeout(
                wait + Duration::from_millis(50),
                backend.accept_session(&e, want, wait),
            )
            .await
            {
                Ok(r) => r,
                Err(_) => Ok(None),
            };
            if let Err(mpsc::error::SendError(Event::SessionAccepted {
                result: Ok(Some(s)), ..
            })) = events.send(Event::SessionAccepted { link, result })
            {
                s.close().await;
            }
        });
    }

    /// Sends twice's attach for a link, then the credit a client sender needs, or starts the
    /// tasks a client receiver needs.
    pub(super) fn accept_attach(&mut self, ch: u16, handle: u32, session: Option<B::Session>) {
        let shared = self.shared.clone();
        let events = self.events.clone();
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(l) = s.links.get_mut(&handle) else { return };
        if l.detached {
            // Refused meanwhile: whatever was taken for it goes back.
            if let Some(sess) = session {
                tokio::spawn(async move { sess.close().await });
            }
            return;
        }
        let mut source = l.attach.source.clone();
        let mut properties = None;
        if let Some(sess) = session {
            let sid = sess.session_id().as_str().to_owned();
            source = source.map(|v| with_session_filter(&v, &sid));
            let ticks = sess
                .locked_until()
                .as_millis()
                .saturating_mul(10_000)
                .saturating_add(621_355_968_000_000_000);
            properties =
                Some(Value::Map(vec![(Value::symbol(cond::LOCKED_UNTIL_UTC), Value::Long(ticks))]));
            l.session = Some(Arc::new(sess));
        }
        let reply = Attach {
            name: l.name.clone(),
            handle: l.local_handle,
            role: !l.attach.role,
            snd_settle_mode: l.attach.snd_settle_mode,
            rcv_settle_mode: l.attach.rcv_settle_mode,
            source,
            target: l.attach.target.clone(),
            initial_delivery_count: l.client_receives.then_some(0),
            max_message_size: Some(shared.options.max_message_size),
            properties,
        };
        l.attached = true;
        self.out.send(s.local_channel, &Performative::Attach(reply));
        if !l.client_receives {
            l.rx_credit = SENDER_CREDIT;
            let fl = Flow {
                handle: Some(l.local_handle),
                delivery_count: Some(l.rx_delivery_count),
                link_credit: Some(SENDER_CREDIT),
                ..sflow!(s)
            };
            self.out.send(s.local_channel, &Performative::Flow(fl));
            return;
        }
        let Node::Entity(e) = &l.node else { return };
        let source = match &l.session {
            Some(sess) => Source::Session(sess.clone()),
            None => Source::Entity(e.clone()),
        };
        let (settle_tx, settle_rx) = mpsc::unbounded_channel();
        tokio::spawn(settler(
            shared.backend.clone(),
            e.clone(),
            l.session.clone(),
            shared.metrics.clone(),
            settle_rx,
            events.clone(),
            l.id,
        ));
        l.settle = Some(settle_tx);
        if let Some(sess) = &l.session {
            let (stop, stopped) = oneshot::channel();
            tokio::spawn(watch_session_lock(
                sess.clone(),
                shared.options.clock.clone(),
                stopped,
                events.clone(),
                l.id,
            ));
            l.lock_watch = Some(stop);
        }
        let (tx, rx) = watch::channel(PumpCtl::default());
        tokio::spawn(pump(shared.backend.clone(), source, rx, events, l.id));
        l.pump = Some(tx);
        // Credit the client granted before the attach was answered counts from now.
        update_pump(l, shared.options.max_unsettled_per_link);
    }

    /// Refuses a link: attach with a null source (or target) and detach with the error.
    pub(super) fn refuse(&mut self, ch: u16, handle: u32, error: AmqpError) {
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(l) = s.links.get_mut(&handle) else { return };
        tracing::debug!(link = %l.name, condition = %error.condition, "refusing link");
        let reply = Attach {
            name: l.name.clone(),
            handle: l.local_handle,
            role: !l.attach.role,
            snd_settle_mode: l.attach.snd_settle_mode,
            rcv_settle_mode: l.attach.rcv_settle_mode,
            source: if l.client_receives { None } else { l.attach.source.clone() },
            target: if l.client_receives { l.attach.target.clone() } else { None },
            initial_delivery_count: l.client_receives.then_some(0),
            ..Attach::default()
        };
        l.attached = true;
        l.detached = true;
        let local = s.local_channel;
        let lh = l.local_handle;
        self.out.send(local, &Performative::Attach(reply));
        self.out.send(
            local,
            &Performative::Detach(Detach { handle: lh, closed: true, error: Some(error) }),
        );
    }

    pub(super) fn on_detach(&mut self, ch: u16, d: &Detach) {
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(id) = s.links.get(&d.handle).map(|l| l.id) else { return };
        // Releases of what never went out are queued before the settler learns the link ended.
        s.discard_outgoing(Some(id));
        let Some(l) = s.remove_link(d.handle) else { return };
        self.links.remove(&l.id);
        let local = s.local_channel;
        s.unsettled.retain(|_, u| u.link != l.id);
        if !l.detached && l.attached {
            self.out.send(
                local,
                &Performative::Detach(Detach {
                    handle: l.local_handle,
                    closed: d.closed,
                    error: None,
                }),
            );
        }
        release_link(l);
    }

    /// Ends a session for a session error: `end` with the error, and everything it held goes.
    pub(super) fn end_session(&mut self, ch: u16, error: AmqpError) {
        let Some(local) = self.sessions.get(&ch).map(|s| s.local_channel) else { return };
        tracing::debug!(channel = ch, condition = %error.condition, "ending session");
        self.drop_session(ch);
        self.out.send(local, &Performative::End(Some(error)));
    }

    /// Ends a link for a link error: refused if twice has not answered its attach yet,
    /// detached otherwise.
    pub(super) fn link_error(&mut self, ch: u16, handle: u32, error: AmqpError) {
        let attached =
            self.sessions.get(&ch).and_then(|s| s.links.get(&handle)).is_some_and(|l| l.attached);
        if attached {
            self.detach_with(ch, handle, error);
        } else {
            self.refuse(ch, handle, error);
        }
    }

    /// Detaches a link twice's side ends (e.g. a session lock lost).
    pub(super) fn detach_with(&mut self, ch: u16, handle: u32, error: AmqpError) {
        let Some(s) = self.sessions.get_mut(&ch) else { return };
        let Some(l) = s.links.get_mut(&handle) else { return };
        if l.detached {
            return;
        }
        l.detached = true;
        l.pump.take();
        l.lock_watch.take();
        let (id, lh) = (l.id, l.local_handle);
        s.discard_outgoing(Some(id));
        self.out.send(
            s.local_channel,
            &Performative::Detach(Detach { handle: lh, closed: true, error: Some(error) }),
        );
    }

    /// The session handle a receiver link of this connection holds for `entity`/`sid`.
    pub(super) fn held_session(&self, entity: &str, sid: &str) -> Option<Arc<B::Session>> {
        self.sessions.values().flat_map(|s| s.links.values()).find_map(|l| {
            match (&l.node, &l.session) {
                (Node::Entity(e), Some(s))
                    if e == entity && s.session_id().as_str() == sid && !l.detached =>
                {
                    Some(s.clone())
                }
                _ => None,
            }
        })
    }
}

/// The highest handle a session with at most `links` links announces.
fn handle_max(links: usize) -> u32 {
    u32::try_from(links.saturating_sub(1)).unwrap_or(u32::MAX)
}

/// Ends what a link holds: its pump and lock timer stop; its settler finishes the work queued
/// and then releases the session lock.
fn release_link<S: BackendSession>(mut l: Link<S>) {
    l.pump.take();
    l.lock_watch.take();
    let session = l.session.take();
    if l.settle.take().is_none()
        && let Some(s) = session
    {
        tokio::spawn(async move { s.close().await });
    }
}

/// The source with `com.microsoft:session-filter` set to the session id, as a plain string.
fn with_session_filter(source: &Value, sid: &str) -> Value {
    let Value::Described(d, inner) = source else { return source.clone() };
    let mut fields = inner.as_seq().map(<[Value]>::to_vec).unwrap_or_default();
    while fields.len() < 8 {
        fields.push(Value::Null);
    }
    let mut filter: Vec<(Value, Value)> = fields[7].as_map().map(<[_]>::to_vec).unwrap_or_default();
    filter.retain(|(k, _)| k.as_str() != Some(cond::SESSION_FILTER));
    filter.push((Value::symbol(cond::SESSION_FILTER), Value::string(sid)));
    fields[7] = Value::Map(filter);
    Value::Described(d.clone(), Box::new(Value::List(fields)))
}
