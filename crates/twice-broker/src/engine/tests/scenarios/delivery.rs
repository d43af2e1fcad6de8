//! Send, batch and schedule; receive; settlement; lock expiry and MaxDeliveryCount.

use super::super::harness::check;

// ----- 4. send, batch, schedule ----------------------------------------------------------------

#[test]
fn batches_are_all_or_nothing() {
    check(
        r"
        queue q
        queue s session
        send q a,b,c size=100000
        send q a,b size=262144
        send q a size=262145
        send q a size=262000 prop.k=12345678901234567890
        send s a,b session=x
        send s c
        peek q
        peek s
        counts q
        ",
        r#"
        send q a,b,c size=100000 => err MessageSizeExceeded { size: 300003, limit: 262144 }
        send q a,b size=262144 => err MessageSizeExceeded { size: 262145, limit: 262144 }
        send q a size=262145 => err MessageSizeExceeded { size: 262146, limit: 262144 }
        send q a size=262000 prop.k=12345678901234567890 => 1
        send s a,b session=x => 1,2
        send s c => err SessionIdRequired("s")
        peek q => a#1 dc=1
        peek s => a#1 dc=1 s=x, b#2 dc=1 s=x
        counts q => active=1 locked=0 deferred=0 scheduled=0 dlq=0
        "#,
    );
}

#[test]
fn schedule_and_cancel() {
    check(
        r"
        queue q
        schedule q a,b +10s
        send q c at=+5s
        send q d
        recv q 10
        peek q
        counts q
        cancel q 1 99
        cancel q 1
        cancel q 1
        deadline
        advance 5s
        recv q 10
        advance 5s
        recv q 10
        counts q
        ",
        r"
        schedule q a,b +10s => 1,2
        send q c at=+5s => 3
        send q d => 4
        recv q 10 => d#4 dc=1
        peek q => a#1 dc=1 scheduled, b#2 dc=1 scheduled, c#3 dc=1 scheduled, d#4 dc=1
        counts q => active=1 locked=1 deferred=0 scheduled=3 dlq=0
        cancel q 1 99 => err MessageNotFound(99)
        cancel q 1 => ok
        cancel q 1 => err MessageNotFound(1)
        deadline => +5s
        recv q 10 => c#5 dc=1
        recv q 10 => b#6 dc=1
        counts q => active=3 locked=3 deferred=0 scheduled=0 dlq=0
        ",
    );
}

/// As in Service Bus, a scheduled message takes a new sequence number when it becomes active,
/// so it queues behind every message sent before that moment; the number survives a restart.
#[test]
fn scheduled_message_queues_behind_messages_sent_before_it_became_active() {
    check(
        r"
        queue q
        schedule q a +10s
        send q b
        advance 10s
        send q c
        peek q
        restart
        peek q
        recv q 10
        ",
        r"
        schedule q a +10s => 1
        send q b => 2
        send q c => 4
        peek q => b#2 dc=1, a#3 dc=1, c#4 dc=1
        peek q => b#2 dc=1, a#3 dc=1, c#4 dc=1
        recv q 10 => b#2 dc=1, a#3 dc=1, c#4 dc=1
        ",
    );
}

#[test]
fn scheduled_message_to_a_topic_fans_out_when_due() {
    check(
        r"
        topic t
        sub t red rule=r:label=red
        sub t all
        send t a label=red at=+10s
        send t b at=+10s
        peek t/Subscriptions/all
        counts t
        advance 10s
        peek t/Subscriptions/red
        peek t/Subscriptions/all
        counts t
        ",
        r"
        send t a label=red at=+10s => 1
        send t b at=+10s => 2
        peek t/Subscriptions/all => none
        counts t => active=0 locked=0 deferred=0 scheduled=2 dlq=0
        peek t/Subscriptions/red => a#3 dc=1
        peek t/Subscriptions/all => a#3 dc=1, b#4 dc=1
        counts t => active=0 locked=0 deferred=0 scheduled=0 dlq=0
        ",
    );
}

#[test]
fn message_id_is_assigned_when_missing() {
    let mut w = super::super::harness::World::new();
    w.run("queue q\nsend q -,-");
    let q = w.engine.resolve("q").unwrap();
    let ds = w.engine.peek(w.now, q, twice::SequenceNumber::new(1), 10, None).unwrap();
    let ids: Vec<String> =
        ds.iter().map(|d| w.message_of(d).message_id.clone().unwrap().into_string()).collect();
    assert_eq!(ids.len(), 2);
    for id in &ids {
        assert_eq!(id.len(), 32, "{id}");
        assert!(id.chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()), "{id}");
    }
    assert_ne!(ids[0], ids[1]);
}

#[test]
fn message_validation() {
    check(
        r"
        queue q
        send q a ttl=0s
        send q a session=
        send q a pk=x
        send q a prop.x=1
        recv q 0
        ",
        r#"
        send q a ttl=0s => err InvalidArgument("a time to live must be positive")
        send q a session= => err InvalidArgument("a session id has 1 to 128 characters")
        send q a pk=x => 1
        send q a prop.x=1 => 2
        recv q 0 => err InvalidArgument("the maximum message count must be at least 1")
        "#,
    );
}

// ----- 5. receive ---------------------------------------------------------------------------

#[test]
fn peek_lock_hides_a_message_until_settled_or_expired() {
    check(
        r"
        queue q lock=30s
        send q a
        recv q
        recv q
        advance 29s
        recv q
        advance 1s
        recv q
        ",
        r"
        send q a => 1
        recv q => a#1 dc=1
        recv q => none
        recv q => none
        recv q => a#1 dc=2
        ",
    );
}

#[test]
fn receive_and_delete_removes_at_once() {
    check(
        r"
        queue q
        send q a,b,c
        recv q 2 rad
        counts q
        recv q 5 rad
        recv q rad
        ",
        r"
        send q a,b,c => 1,2,3
        recv q 2 rad => a#1 dc=1, b#2 dc=1
        counts q => active=1 locked=0 deferred=0 scheduled=0 dlq=0
        recv q 5 rad => c#3 dc=1
        recv q rad => none
        ",
    );
}

#[test]
fn parked_receivers_are_served_in_order_on_arrival() {
    check(
        r"
        queue q
        recv q 2 wait=w1
        recv q 2 wait=w2
        recv q wait=w1
        ready
        send q a
        ready
        send q b,c,d
        ready
        recv q wait=w3
        unwait w3
        unwait w3
        send q e
        ready
        ",
        r#"
        recv q 2 wait=w1 => none
        recv q 2 wait=w2 => none
        recv q wait=w1 => err InvalidArgument("waiter 1 is already parked")
        ready => none
        send q a => 1
        ready => w1: a#1 dc=1
        send q b,c,d => 2,3,4
        ready => w2: b#2 dc=1, c#3 dc=1
        recv q wait=w3 => d#4 dc=1
        unwait w3 => false
        unwait w3 => false
        send q e => 5
        ready => none
        "#,
    );
}

#[test]
fn cancelled_waiters_are_skipped() {
    check(
        r"
        queue q
        recv q wait=w1
        recv q wait=w2
        unwait w1
        send q a
        ready
        recv q rad wait=w3
        send q b
        ready
        counts q
        ",
        r"
        recv q wait=w1 => none
        recv q wait=w2 => none
        unwait w1 => true
        send q a => 1
        ready => w2: a#1 dc=1
        recv q rad wait=w3 => none
        send q b => 2
        ready => w3: b#2 dc=1
        counts q => active=1 locked=1 deferred=0 scheduled=0 dlq=0
        ",
    );
}

#[test]
fn a_lock_expiry_wakes_a_parked_receiver() {
    check(
        r"
        queue q lock=10s
        send q a
        recv q
        recv q wait=w1
        advance 10s
        ready
        ",
        r"
        send q a => 1
        recv q => a#1 dc=1
        recv q wait=w1 => none
        ready => w1: a#1 dc=2
        ",
    );
}

// ----- 6. settlement --------------------------------------------------------------------------

#[test]
fn abandon_merges_properties_and_counts() {
    check(
        r"
        queue q
        send q a prop.orig=1
        recv q
        abandon a prop.reason=boom prop.orig=2
        recv q
        abandon a
        abandon a
        recv q
        ",
        r"
        send q a prop.orig=1 => 1
        recv q => a#1 dc=1
        abandon a prop.reason=boom prop.orig=2 => ok
        recv q => a#1 dc=2 {orig=2,reason=boom}
        abandon a => ok
        abandon a => err MessageLockLost
        recv q => a#1 dc=3 {orig=2,reason=boom}
        ",
    );
}

#[test]
fn abandoned_properties_show_in_the_received_message() {
    let mut w = super::super::harness::World::new();
    w.run("queue q\nsend q a prop.orig=1 prop.keep=1\nrecv q\nabandon a prop.orig=2");
    let q = w.engine.resolve("q").unwrap();
    let ds = w.engine.receive(w.now, q, crate::engine::ReceiveMode::PeekLock, 1, None).unwrap();
    let m = w.message_of(&ds[0]);
    let r = crate::engine::received_message(&m, &ds[0].meta);
    assert_eq!(r.message.application_properties.get("orig"), Some(&twice::Value::Long(2)));
    assert_eq!(r.message.application_properties.get("keep"), Some(&twice::Value::Long(1)));
    assert_eq!(r.delivery_count, 2);
    assert_eq!(r.sequence_number.get(), 1);
    assert!(
        r.lock_token.is_some()
            && r.locked_until == Some(w.now + std::time::Duration::from_secs(60))
    );
}

#[test]
fn dead_letter_with_reason_and_description() {
    let mut w = super::super::harness::World::new();
    let out = w.run(
        "queue q\nsend q a\nrecv q\ndeadletter a Poison bad-json\ncounts q\nrecv q/$DeadLetterQueue\n\
         deadletter a Again no\ncomplete a\ncounts q",
    );
    assert_eq!(
        out,
        "send q a => 1\nrecv q => a#1 dc=1\ndeadletter a Poison bad-json => ok\n\
         counts q => active=0 locked=0 deferred=0 scheduled=0 dlq=1\n\
         recv q/$DeadLetterQueue => a#1 dc=1 dl=\"Poison\"\n\
         deadletter a Again no => err InvalidOperation(\"a message in a dead-letter queue cannot be dead-lettered again\")\n\
         complete a => ok\ncounts q => active=0 locked=0 deferred=0 scheduled=0 dlq=0\n"
    );
    // The description travels as DeadLetterErrorDescription.
    w.run("send q b\nrecv q\ndeadletter b Poison bad-json");
    let dlq = w.engine.resolve("q/$DeadLetterQueue").unwrap();
    let ds = w.engine.peek(w.now, dlq, twice::SequenceNumber::new(1), 10, None).unwrap();
    let r = crate::engine::received_message(&w.message_of(&ds[0]), &ds[0].meta);
    assert_eq!(r.dead_letter_reason.as_deref(), Some("Poison"));
    assert_eq!(r.dead_letter_error_description.as_deref(), Some("bad-json"));
    assert_eq!(r.dead_letter_source, None);
    let props = &r.message.application_properties;
    assert_eq!(props.get("DeadLetterReason"), Some(&twice::Value::from("Poison")));
    assert_eq!(props.get("DeadLetterErrorDescription"), Some(&twice::Value::from("bad-json")));
}

#[test]
fn defer_then_receive_by_sequence_number() {
    check(
        r"
        queue q
        send q a,b
        recv q
        defer a
        recv q 5
        peek q
        counts q
        deferred q 1 2
        deferred q 1
        recv q
        deferred q 1
        abandon a
        peek q
        deferred q 1
        complete a
        counts q
        ",
        r"
        send q a,b => 1,2
        recv q => a#1 dc=1
        defer a => ok
        recv q 5 => b#2 dc=1
        peek q => a#1 dc=1 deferred, b#2 dc=1
        counts q => active=1 locked=1 deferred=1 scheduled=0 dlq=0
        deferred q 1 2 => err MessageNotFound(2)
        deferred q 1 => a#1 dc=1 deferred
        recv q => none
        deferred q 1 => err MessageNotFound(1)
        abandon a => ok
        peek q => a#1 dc=2 deferred, b#2 dc=1
        deferred q 1 => a#1 dc=2 deferred
        complete a => ok
        counts q => active=1 locked=1 deferred=0 scheduled=0 dlq=0
        ",
    );
}

#[test]
fn release_does_not_count_a_delivery() {
    check(
        r"
        queue q max=1
        send q a
        recv q
        release a
        recv q
        release a
        release a
        recv q
        abandon a
        counts q
        ",
        r"
        send q a => 1
        recv q => a#1 dc=1
        release a => ok
        recv q => a#1 dc=1
        release a => ok
        release a => err MessageLockLost
        recv q => a#1 dc=1
        abandon a => ok
        counts q => active=0 locked=0 deferred=0 scheduled=0 dlq=1
        ",
    );
}

#[test]
fn a_lost_lock_changes_nothing() {
    check(
        r"
        queue q lock=10s
        send q a,b
        recv q 2
        complete x
        complete a x
        counts q
        advance 10s
        complete a
        abandon a
        deadletter a
        defer a
        renew a
        peek q
        recv q 2
        complete a b
        complete a
        ",
        r"
        send q a,b => 1,2
        recv q 2 => a#1 dc=1, b#2 dc=1
        complete x => err MessageLockLost
        complete a x => err MessageLockLost
        counts q => active=2 locked=2 deferred=0 scheduled=0 dlq=0
        complete a => err MessageLockLost
        abandon a => err MessageLockLost
        deadletter a => err MessageLockLost
        defer a => err MessageLockLost
        renew a => err MessageLockLost
        peek q => a#1 dc=2, b#2 dc=2
        recv q 2 => a#1 dc=2, b#2 dc=2
        complete a b => ok
        complete a => err MessageLockLost
        ",
    );
}

// ----- 7. lock expiry and MaxDeliveryCount -----------------------------------------------------

#[test]
fn max_delivery_count_dead_letters() {
    check(
        r"
        queue q max=2 lock=10s
        send q a
        recv q
        abandon a
        recv q
        advance 10s
        recv q
        counts q
        recv q/$DeadLetterQueue
        abandon a
        recv q/$DeadLetterQueue
        ",
        r#"
        send q a => 1
        recv q => a#1 dc=1
        abandon a => ok
        recv q => a#1 dc=2
        recv q => none
        counts q => active=0 locked=0 deferred=0 scheduled=0 dlq=1
        recv q/$DeadLetterQueue => a#1 dc=3 dl="MaxDeliveryCountExceeded"
        abandon a => ok
        recv q/$DeadLetterQueue => a#1 dc=4 dl="MaxDeliveryCountExceeded"
        "#,
    );
}

#[test]
fn max_delivery_count_description() {
    let mut w = super::super::harness::World::new();
    w.run("queue q max=1\nsend q a\nrecv q\nabandon a");
    let dlq = w.engine.resolve("q/$DeadLetterQueue").unwrap();
    let ds = w.engine.peek(w.now, dlq, twice::SequenceNumber::new(1), 1, None).unwrap();
    let r = crate::engine::received_message(&w.message_of(&ds[0]), &ds[0].meta);
    assert_eq!(r.dead_letter_reason.as_deref(), Some("MaxDeliveryCountExceeded"));
    assert_eq!(
        r.dead_letter_error_description.as_deref(),
        Some("Message could not be consumed after 1 delivery attempts.")
    );
}
