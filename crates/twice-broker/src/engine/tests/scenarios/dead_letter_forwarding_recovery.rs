//! Peek, the dead-letter queue and resubmit; auto-forwarding; counts; recovery; the memory mode,
//! counters and listing.

use super::super::harness::check;

// ----- 11. peek, DLQ, resubmit ------------------------------------------------------------------

#[test]
fn peek_from_a_sequence_number() {
    check(
        r"
        queue q
        send q a,b,c,d
        recv q
        peek q 2
        peek q 2 1
        peek q 9
        peek q 1 0
        ",
        r#"
        send q a,b,c,d => 1,2,3,4
        recv q => a#1 dc=1
        peek q 2 => b#2 dc=1, c#3 dc=1, d#4 dc=1
        peek q 2 1 => b#2 dc=1
        peek q 9 => none
        peek q 1 0 => err InvalidArgument("the maximum message count must be at least 1")
        "#,
    );
}

#[test]
fn peek_a_session() {
    check(
        r"
        queue q session
        send q a session=x
        send q b session=y
        send q c session=x
        peek q session=x
        peek q session=z
        ",
        r"
        send q a session=x => 1
        send q b session=y => 2
        send q c session=x => 3
        peek q session=x => a#1 dc=1 s=x, c#3 dc=1 s=x
        peek q session=z => none
        ",
    );
}

#[test]
fn resubmit_from_the_dead_letter_queue() {
    check(
        r"
        queue q
        send q a,b prop.k=1
        recv q 2
        deadletter a Bad
        abandon b prop.x=2
        recv q
        deadletter b Worse
        resubmit q 1
        resubmit q/$DeadLetterQueue 1 9
        resubmit q/$DeadLetterQueue 1 2
        peek q/$DeadLetterQueue
        peek q
        recv q/$DeadLetterQueue
        ",
        r#"
        send q a,b prop.k=1 => 1,2
        recv q 2 => a#1 dc=1, b#2 dc=1
        deadletter a Bad => ok
        abandon b prop.x=2 => ok
        recv q => b#2 dc=2 {x=2}
        deadletter b Worse => ok
        resubmit q 1 => err InvalidOperation("only messages in a dead-letter queue can be resubmitted")
        resubmit q/$DeadLetterQueue 1 9 => err MessageNotFound(9)
        resubmit q/$DeadLetterQueue 1 2 => 3,4
        peek q/$DeadLetterQueue => none
        peek q => a#3 dc=1, b#4 dc=1 {x=2}
        recv q/$DeadLetterQueue => none
        "#,
    );
}

#[test]
fn a_subscription_resubmits_to_itself() {
    check(
        r"
        topic t
        sub t s1
        sub t s2
        send t a
        recv t/Subscriptions/s1
        deadletter a
        resubmit t/Subscriptions/s1/$DeadLetterQueue 1
        peek t/Subscriptions/s1
        peek t/Subscriptions/s2
        send t b
        ",
        r"
        send t a => 1
        recv t/Subscriptions/s1 => a#1 dc=1
        deadletter a => ok
        resubmit t/Subscriptions/s1/$DeadLetterQueue 1 => 2
        peek t/Subscriptions/s1 => a#2 dc=1
        peek t/Subscriptions/s2 => a#1 dc=1
        send t b => 3
        ",
    );
}

// ----- 12. auto-forwarding -------------------------------------------------------------------

#[test]
fn forward_to_a_queue_and_a_topic() {
    check(
        r"
        queue dest
        topic t
        sub t s
        queue a fwd=dest
        queue b fwd=t
        send a m1
        send b m2
        peek a
        peek dest
        peek t/Subscriptions/s
        ",
        r"
        send a m1 => 1
        send b m2 => 1
        peek a => none
        peek dest => m1#1 dc=1
        peek t/Subscriptions/s => m2#1 dc=1
        ",
    );
}

#[test]
fn forwarding_stops_after_four_hops() {
    check(
        r"
        queue q6
        queue q5 fwd=q6
        queue q4 fwd=q5
        queue q3 fwd=q4
        queue q2 fwd=q3
        queue q1 fwd=q2
        send q2 a
        peek q6
        send q1 b
        peek q6
        peek q5/$DeadLetterQueue
        ",
        r#"
        send q2 a => 1
        peek q6 => a#1 dc=1
        send q1 b => 1
        peek q6 => a#1 dc=1
        peek q5/$DeadLetterQueue => b#1 dc=1 dl="MaxTransferHopCountExceeded"
        "#,
    );
}

#[test]
fn forwarding_loops_are_capped() {
    check(
        r"
        queue a
        queue b fwd=a
        update queue a fwd=b
        send a m
        counts a
        counts b
        ",
        r"
        send a m => 1
        counts a => active=0 locked=0 deferred=0 scheduled=0 dlq=1
        counts b => active=0 locked=0 deferred=0 scheduled=0 dlq=0
        ",
    );
}

#[test]
fn dead_lettered_messages_are_forwarded() {
    check(
        r"
        queue errors
        queue q fwd-dlq=errors max=1
        send q a
        recv q
        deadletter a Bad
        send q b
        recv q
        abandon b
        counts q
        peek errors
        ",
        r#"
        send q a => 1
        recv q => a#1 dc=1
        deadletter a Bad => ok
        send q b => 2
        recv q => b#2 dc=1
        abandon b => ok
        counts q => active=0 locked=0 deferred=0 scheduled=0 dlq=0
        peek errors => a#1 dc=1 dl="Bad" src=q, b#2 dc=1 dl="MaxDeliveryCountExceeded" src=q
        "#,
    );
}

#[test]
fn a_scheduled_message_is_forwarded_when_due() {
    check(
        r"
        queue dest
        queue q fwd=dest
        schedule q a +10s
        counts q
        cancel q 1
        schedule q b +10s
        restart
        advance 10s
        peek dest
        counts q
        ",
        r"
        schedule q a +10s => 1
        counts q => active=0 locked=0 deferred=0 scheduled=1 dlq=0
        cancel q 1 => ok
        schedule q b +10s => 2
        peek dest => b#1 dc=1
        counts q => active=0 locked=0 deferred=0 scheduled=0 dlq=0
        ",
    );
}

// ----- 13. counts ------------------------------------------------------------------------------

#[test]
fn runtime_counts() {
    check(
        r"
        queue q
        send q a,b,c,d
        schedule q e +1h
        recv q 3
        defer a
        deadletter b
        counts q
        deferred q 1
        counts q
        ",
        r"
        send q a,b,c,d => 1,2,3,4
        schedule q e +1h => 5
        recv q 3 => a#1 dc=1, b#2 dc=1, c#3 dc=1
        defer a => ok
        deadletter b => ok
        counts q => active=2 locked=1 deferred=1 scheduled=1 dlq=1
        deferred q 1 => a#1 dc=1 deferred
        counts q => active=2 locked=2 deferred=1 scheduled=1 dlq=1
        ",
    );
}

// ----- 14. recovery ---------------------------------------------------------------------------

#[test]
fn a_restart_unlocks_with_the_count_raised() {
    check(
        r"
        queue q max=2
        send q a,b,c,d
        recv q 3
        complete a
        defer c
        deferred q 3
        restart
        complete b
        peek q
        recv q 5
        restart
        peek q
        counts q
        ",
        r"
        send q a,b,c,d => 1,2,3,4
        recv q 3 => a#1 dc=1, b#2 dc=1, c#3 dc=1
        complete a => ok
        defer c => ok
        deferred q 3 => c#3 dc=1 deferred
        complete b => err MessageLockLost
        peek q => b#2 dc=2, c#3 dc=2 deferred, d#4 dc=1
        recv q 5 => b#2 dc=2, d#4 dc=1
        peek q => c#3 dc=2 deferred, d#4 dc=2
        counts q => active=1 locked=0 deferred=1 scheduled=0 dlq=1
        ",
    );
}

#[test]
fn a_restart_keeps_everything_else() {
    check(
        r"
        topic t ttl=1h
        sub t s lock=30s rule=r:label=x
        queue q session dedup=1m
        send t a label=x
        send t b label=y
        send q m session=s1
        schedule q n +10m session=s1
        recv t/Subscriptions/s
        abandon a prop.k=v
        recv t/Subscriptions/s
        deadletter a Bad
        restart
        peek t/Subscriptions/s/$DeadLetterQueue
        send t c label=x
        send q m session=s1
        peek q
        info t/Subscriptions/s
        advance 10m
        counts q
        ",
        r#"
        send t a label=x => 1
        send t b label=y => 2
        send q m session=s1 => 1
        schedule q n +10m session=s1 => 2
        recv t/Subscriptions/s => a#1 dc=1 exp=+3600s
        abandon a prop.k=v => ok
        recv t/Subscriptions/s => a#1 dc=2 {k=v} exp=+3600s
        deadletter a Bad => ok
        peek t/Subscriptions/s/$DeadLetterQueue => a#1 dc=2 dl="Bad" {k=v}
        send t c label=x => 3
        send q m session=s1 => dup
        peek q => m#1 dc=1 s=s1, n#2 dc=1 scheduled s=s1
        info t/Subscriptions/s => t/Subscriptions/s lock=30s max=Some(10) dedup=None session=false
        counts q => active=2 locked=0 deferred=0 scheduled=0 dlq=0
        "#,
    );
}

#[test]
fn config_files_apply_all_or_nothing() {
    check(
        r#"
        config {"UserConfig":{"Namespaces":[{"Name":"x","Queues":[{"Name":"q","Properties":{"RequiresSession":true}}],"Topics":[]}],"Logging":{"Type":"Console"}}}
        info q
        config {"UserConfig":{"Namespaces":[{"Name":"x","Queues":[{"Name":"a"},{"Name":"q","Properties":{"RequiresSession":false}}],"Topics":[]}]}}
        peek a
        config {"UserConfig":{"Namespaces":[{"Name":"x","Queues":[{"Name":"a"},{"Name":"q","Properties":{"RequiresSession":true,"LockDuration":"PT10S"}}],"Topics":[{"Name":"t","Subscriptions":[{"Name":"s"}]}]}]}}
        info q
        info t/Subscriptions/s
        "#,
        r#"
        info q => q lock=60s max=Some(3) dedup=None session=true
        config {"UserConfig":{"Namespaces":[{"Name":"x","Queues":[{"Name":"a"},{"Name":"q","Properties":{"RequiresSession":false}}],"Topics":[]}]}} => err ImmutableProperty { entity: "q", property: "RequiresSession" }
        peek a => err EntityNotFound("a")
        info q => q lock=10s max=Some(3) dedup=None session=true
        info t/Subscriptions/s => t/Subscriptions/s lock=60s max=Some(3) dedup=None session=false
        "#,
    );
}

// ----- memory mode, counters, listing ---------------------------------------------------------

#[test]
fn memory_mode_keeps_bodies_and_writes_nothing() {
    use crate::engine::{Engine, EngineOptions, ReceiveMode, received_message};
    let now = twice::Timestamp::from_millis(1_000_000);
    let mut e = Engine::new(EngineOptions { durable: false, seed: 7, ..EngineOptions::default() });
    let q = e
        .create_entity(now, crate::config::EntityDefinition::queue("q", Default::default()))
        .unwrap();
    e.send(now, q, vec![twice::Message::new("hello").with_message_id("a")]).unwrap();
    let ds = e.receive(now, q, ReceiveMode::PeekLock, 1, None).unwrap();
    let crate::engine::Body::Memory(m) = &ds[0].body else { panic!("the body is on disk") };
    let r = received_message(m, &ds[0].meta);
    assert_eq!(r.body().as_ref(), b"hello");
    assert_eq!(r.message_id().as_str(), "a");
    assert_eq!(r.delivery_count, 1);
    e.dead_letter(now, r.lock_token.unwrap(), None, None, twice::Properties::new()).unwrap();
    let dlq = e.resolve("q/$DeadLetterQueue").unwrap();
    assert!(dlq.is_dead_letter());
    let dlq = e.peek(now, dlq, twice::SequenceNumber::new(1), 10, None).unwrap();
    assert_eq!(dlq.len(), 1);
    assert!(e.take_records().is_empty());
    assert_eq!(e.entities().len(), 1);
}

#[test]
fn monotone_counters() {
    let mut w = super::super::harness::World::new();
    w.run(
        "queue q dedup=1m lock=10s ttl=1h\nsend q a,a,b,c,d\nrecv q 4\ncomplete a\nabandon b\ndeadletter c\n\
         advance 10s\nadvance 1h",
    );
    let q = w.engine.resolve("q").unwrap();
    let c = w.engine.counters(q).unwrap();
    assert_eq!(
        (
            c.sent,
            c.duplicates,
            c.received,
            c.completed,
            c.abandoned,
            c.dead_lettered,
            c.lock_lost,
            c.expired
        ),
        (4, 1, 4, 1, 1, 1, 1, 2)
    );
    assert_eq!(w.engine.total_counters(), c);
    let names: Vec<String> = w.engine.entities().into_iter().map(|(_, p)| p).collect();
    assert_eq!(names, ["q"]);
}

#[test]
fn deferred_serving_hands_a_parked_receiver_a_batch_and_keeps_it_first() {
    use crate::config::EntityDefinition;
    use crate::engine::{Engine, EngineOptions, ReceiveMode, WaiterId};
    use twice::Message;
    let now = twice::Timestamp::from_millis(1_893_456_000_000);
    let mut e = Engine::new(EngineOptions { deferred_serving: true, ..EngineOptions::default() });
    let q = e.create_entity(now, EntityDefinition::queue("q", Default::default())).unwrap();
    let parked = e.receive(now, q, ReceiveMode::PeekLock, 10, Some(WaiterId(1))).unwrap();
    assert!(parked.is_empty());
    for id in ["a", "b"] {
        e.send(now, q, vec![Message::new("x").with_message_id(id)]).unwrap();
    }
    // Sends leave the waiter parked: it is served once, with both messages.
    assert!(e.take_ready().is_empty());
    // A receive that comes later does not overtake it.
    let later = e.receive(now, q, ReceiveMode::PeekLock, 10, None).unwrap();
    assert!(later.is_empty());
    let ready = e.take_ready();
    assert_eq!(ready.len(), 1);
    let (w, got) = &ready[0];
    assert_eq!(*w, WaiterId(1));
    let seqs: Vec<i64> = got.iter().map(|d| d.meta.sequence_number.get()).collect();
    assert_eq!(seqs, [1, 2]);
    // With nobody parked, serving does nothing and messages wait for the next receive.
    e.send(now, q, vec![Message::new("x").with_message_id("c")]).unwrap();
    e.serve_waiters(now);
    assert!(e.take_ready().is_empty());
    assert_eq!(e.receive(now, q, ReceiveMode::PeekLock, 10, None).unwrap().len(), 1);
}
