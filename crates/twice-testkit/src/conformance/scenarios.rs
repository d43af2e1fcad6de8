//! The scenarios of what users meet beyond the Service Bus rules: a handler longer than the
//! lock, a producer that is not twice, an entity made again under a transport, a transport told
//! another lock than the broker's, and a delivery in flight across a reconnect.
//!
//! Each returns its cell: `yes` when the transport behaves as Service Bus does, the difference
//! it observed otherwise, and `not run: <why>` when the harness cannot play it. Losing a
//! message or doing its work twice fails the scenario instead.

use std::sync::Arc;
use std::time::Duration;

use twice::{Delivery as _, Inbox, Message, Receive as _, Transport as _, TransportError};

use super::Entity as _;
use super::{
    BOUND, Batch, EntitySettings, Harness, Interruption, QUIET, YES, create, fail, not_run,
    nothing_comes, options, receive_one, send, start, take_dead_letters_until, unique,
};

/// A row of the capability table.
pub const LONG_HANDLER: &str = "processor: handler longer than the lock, renewed, work once";
/// A row of the capability table.
pub const FOREIGN_PRODUCER: &str = "a producer that is not twice (no message id)";
/// A row of the capability table.
pub const RECREATED: &str = "entity deleted and made again under a running transport";
/// A row of the capability table.
pub const LOCK_MISMATCH: &str = "lock told to the transport differs from the broker's";
/// A row of the capability table.
pub const IN_FLIGHT: &str = "a delivery in flight across a reconnect: settled or delivered again";

/// A handler that runs for 2.5 lock durations on every delivery, with the processor renewing
/// the lock: the work is done once, and the message is not delivered again.
pub(super) async fn long_handler<H: Harness, I: Inbox>(
    h: &H,
    inbox: &Arc<I>,
    batch: Batch,
) -> Option<String> {
    const S: &str = "processor: long handler";
    let settings = EntitySettings { lock_duration: h.short_lock(), ..EntitySettings::default() };
    let e = create(h, settings).await?;
    let id = unique("long");
    let sleep = settings.lock_duration * 5 / 2;
    let body = format!(r#"{{"sleep_ms":{}}}"#, sleep.as_millis());
    send(&e, Message::new(body).with_message_id(id.as_str()), S).await;
    let p = start(e.transport(), inbox, options(&unique("kit"), batch));
    p.wait(S, |p| p.snapshot().completed >= 1).await;
    let commits = p.commits_of(&id);
    let snapshot = p.snapshot();
    p.stop(S).await;
    if !nothing_comes(e.transport().as_ref()).await {
        fail(S, "the message is still there after it was completed");
    }
    Some(match (commits, snapshot.lock_lost) {
        (1, 0) => YES.into(),
        (1, n) => format!("the lock was lost {n} time(s) under renewal; the work was done once"),
        (n, _) => fail(S, format!("work committed {n} times")),
    })
}

/// A message sent with the broker's own client and no message id: Service Bus names it at
/// enqueue, and it is handled under that id.
pub(super) async fn foreign_producer<H: Harness>(h: &H) -> Option<String> {
    const S: &str = "foreign producer";
    let e = create(h, EntitySettings::default()).await?;
    match e.send_without_id(b"{}").await {
        None => return Some(not_run("the harness has no producer other than twice")),
        Some(Err(err)) => fail(S, format!("send failed: {err}")),
        Some(Ok(())) => {}
    }
    let t = e.transport();
    if let Some(d) = t.receive(1, QUIET * 3).await.unwrap_or_else(|err| fail(S, err)).pop() {
        let id = d.message().message_id().as_str().to_owned();
        t.complete(&d).await.unwrap_or_else(|err| fail(S, err));
        if id.is_empty() {
            fail(S, "handed out without an id: two such messages could not be told apart");
        }
        return Some(YES.into());
    }
    let dead = take_dead_letters_until(&e, 1, S).await;
    Some(match dead.first().and_then(|m| m.dead_letter_reason.as_deref()) {
        Some(twice::dead_letter_reasons::MISSING_MESSAGE_ID) => {
            "no: never handed out, dead-lettered as MissingMessageId (an identity policy names it otherwise)".into()
        }
        Some(other) => format!("dead-lettered as {other}"),
        None => fail(S, "the message is neither handed out nor dead-lettered: lost"),
    })
}

/// The entity deleted and made again (empty) while the transport stays connected: a message
/// sent to the new entity reaches the same transport.
pub(super) async fn recreated<H: Harness>(h: &H) -> Option<String> {
    const S: &str = "entity made again";
    let e = create(h, EntitySettings::default()).await?;
    let t = e.transport();
    send(&e, Message::new("a").with_message_id(unique("m")), S).await;
    let d = receive_one(t.as_ref(), S).await;
    t.complete(&d).await.unwrap_or_else(|err| fail(S, err));
    match e.recreate().await {
        None => return Some(not_run("the harness cannot delete and make the entity again")),
        Some(Err(err)) => fail(S, format!("making the entity again failed: {err}")),
        Some(Ok(())) => {}
    }
    let fresh = unique("m");
    let clock = twice::SharedClock::system();
    let until = clock.now() + BOUND;
    let mut sent = false;
    while clock.now() < until {
        if !sent {
            sent = e.send(Message::new("b").with_message_id(fresh.as_str())).await.is_ok();
        }
        // A receiver may first report that the entity it had is gone; as the processor does,
        // the scenario goes on receiving.
        if let Ok(got) = t.receive(1, Duration::from_secs(1)).await {
            for d in &got {
                let id = d.message().message_id().as_str().to_owned();
                if t.complete(d).await.is_ok() && id == fresh {
                    return Some(YES.into());
                }
            }
        }
        clock.sleep(Duration::from_millis(100)).await;
    }
    Some("the transport did not receive from the entity made again within the bound".into())
}

/// The transport was told a lock six times the broker's: the lock it reports, and the
/// redelivery, follow the broker's.
pub(super) async fn lock_mismatch<H: Harness>(h: &H) -> Option<String> {
    const S: &str = "lock told";
    let settings = EntitySettings { lock_duration: h.short_lock(), ..EntitySettings::default() };
    let lock = settings.lock_duration;
    let e = match h.create_with_lock_told(settings, lock * 6).await? {
        Ok(e) => e,
        Err(why) => return Some(not_run(&why)),
    };
    let t = e.transport();
    let reported = t.entity().lock_duration;
    send(&e, Message::new("a").with_message_id(unique("m")), S).await;
    let clock = twice::SharedClock::system();
    let before = clock.now();
    let d = receive_one(t.as_ref(), S).await;
    let locked_until = d.message().locked_until;
    let again = receive_one(t.as_ref(), S).await;
    let old = t.complete(&d).await;
    t.complete(&again).await.unwrap_or_else(|err| fail(S, err));
    // The transport counts from a moment before the broker's delivery, or reads the broker's.
    let slack = Duration::from_millis(250);
    let within = locked_until.is_some_and(|u| u <= before + lock + slack);
    Some(match (reported == lock, within, old) {
        (true, true, Err(err)) if err.is_lock_lost() => YES.into(),
        (false, _, _) => format!("reports a lock of {reported:?}; the broker's is {lock:?}"),
        (_, false, _) => {
            format!("a delivery locked until {locked_until:?}, past the broker's lock")
        }
        (_, _, other) => format!("the delivery the broker gave again settled: {other:?}"),
    })
}

/// A message received, the connection cut (or the broker restarted), then completed: the
/// completion holds and the message is gone, or it fails as a lost lock and the message comes
/// again, or (AMQP 0-9-1, where an ack has no reply) it seemed to hold and the message comes
/// again, which the claim makes a duplicate. Which of the three happens depends on how fast the
/// transport notices the loss and connects again, so the cell is `yes` for all of them; a
/// message lost, or gone after a completion that failed, fails the scenario.
pub(super) async fn in_flight<H: Harness>(h: &H) -> Option<String> {
    const S: &str = "in flight";
    // A lock that outlives a reconnection, so that what happens does not depend on how fast
    // the transport connects again.
    let lock = h.short_lock().max(Duration::from_secs(5));
    let settings = EntitySettings { lock_duration: lock, ..EntitySettings::default() };
    let e = create(h, settings).await?;
    let t = e.transport();
    let id = unique("m");
    send(&e, Message::new("a").with_message_id(id.as_str()), S).await;
    let d = receive_one(t.as_ref(), S).await;
    let how = e.interrupt().await;
    if how == Interruption::Reopened {
        return Some(not_run(super::IN_PROCESS));
    }
    let clock = twice::SharedClock::system();
    let until = clock.now() + BOUND;
    let completed = loop {
        match t.complete(&d).await {
            Err(err) if err.is_transient() && clock.now() < until => {
                clock.sleep(Duration::from_millis(100)).await;
            }
            other => break other,
        }
    };
    match completed {
        Ok(()) => {
            // Held past its lock, a completion that did not take would show as a redelivery.
            // Either nothing comes within the lock (settled after the reconnect: the lock
            // outlived the connection), or the message comes again (the ack was lost with the
            // connection: the claim makes it a duplicate).
            let until = clock.now() + settings.lock_duration + QUIET;
            while clock.now() < until {
                match t.receive(1, Duration::from_millis(500)).await {
                    Ok(got) => {
                        if let Some(d) = got.first() {
                            t.complete(d).await.unwrap_or_else(|err| fail(S, err));
                            break;
                        }
                    }
                    Err(err) if err.is_transient() => clock.sleep(Duration::from_millis(100)).await,
                    Err(err) => fail(S, format!("receive failed: {err}")),
                }
            }
            Some(YES.into())
        }
        Err(TransportError::LockLost) => {
            // The message must come again, to this transport once it is back.
            while clock.now() < until {
                match t.receive(1, Duration::from_secs(1)).await {
                    Ok(got) => {
                        for d in &got {
                            if d.message().message_id().as_str() == id {
                                t.complete(d).await.unwrap_or_else(|err| fail(S, err));
                                return Some(YES.into());
                            }
                        }
                    }
                    Err(err) if err.is_transient() => {}
                    Err(err) => fail(S, format!("receive failed: {err}")),
                }
            }
            fail(S, "the lock was lost with the connection and the message never came again")
        }
        Err(err) => fail(S, format!("the completion after the reconnect failed: {err}")),
    }
}
