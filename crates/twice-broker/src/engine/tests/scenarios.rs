//! One scenario per rule and boundary. Time moves only with `advance`; the engine runs in
//! durable mode with its log in memory, so `restart` replays it.

use super::harness::check;

// ----- 1. entities --------------------------------------------------------------------------

#[test]
fn send_receive_complete() {
    check(
        r"
        queue q
        send q a,b
        recv q 5
        complete a
        counts q
        complete a
        peek q
        ",
        r"
        send q a,b => 1,2
        recv q 5 => a#1 dc=1, b#2 dc=1
        complete a => ok
        counts q => active=1 locked=1 deferred=0 scheduled=0 dlq=0
        complete a => err MessageLockLost
        peek q => b#2 dc=1
        ",
    );
}

#[test]
fn entity_names_are_case_insensitive_and_unique() {
    check(
        r"
        queue Orders
        queue orders
        topic ORDERS
        send orders a
        recv OrDeRs
        info orders
        ",
        r#"
        queue orders => err EntityAlreadyExists("orders")
        topic ORDERS => err EntityAlreadyExists("ORDERS")
        send orders a => 1
        recv OrDeRs => a#1 dc=1
        info orders => Orders lock=60s max=Some(10) dedup=None session=false
        "#,
    );
}

#[test]
fn entity_names_follow_service_bus_rules() {
    check(
        r"
        queue -q
        queue q-
        queue a//b
        queue a/Subscriptions/b
        queue q$x
        queue a/b.c_d-e
        topic t
        sub t bad/name
        sub t ok.name_1
        sub missing s
        ",
        r#"
        queue -q => err InvalidEntityName { name: "-q", reason: "a name starts and ends with a letter or digit" }
        queue q- => err InvalidEntityName { name: "q-", reason: "a name starts and ends with a letter or digit" }
        queue a//b => err InvalidEntityName { name: "a//b", reason: "a path segment is empty or named 'Subscriptions'" }
        queue a/Subscriptions/b => err InvalidEntityName { name: "a/Subscriptions/b", reason: "a path segment is empty or named 'Subscriptions'" }
        queue q$x => err InvalidEntityName { name: "q$x", reason: "a queue or topic name has only letters, digits, '.', '-', '_' and '/'" }
        sub t bad/name => err InvalidEntityName { name: "bad/name", reason: "a subscription or rule name has only letters, digits, '.', '-' and '_'" }
        sub missing s => err EntityNotFound("missing")
        "#,
    );
}

#[test]
fn dead_letter_queue_paths() {
    check(
        r"
        queue q
        topic t
        sub t s
        send q a
        recv q
        deadletter a Bad why
        peek q/$deadletterqueue
        peek q/$DeadLetterQueue
        peek Q/$DEADLETTERQUEUE
        peek t/$DeadLetterQueue
        peek t/subscriptions/s/$deadletterqueue
        send q/$DeadLetterQueue b
        send t/Subscriptions/s b
        recv t
        ",
        r#"
        send q a => 1
        recv q => a#1 dc=1
        deadletter a Bad why => ok
        peek q/$deadletterqueue => a#1 dc=1 dl="Bad"
        peek q/$DeadLetterQueue => a#1 dc=1 dl="Bad"
        peek Q/$DEADLETTERQUEUE => a#1 dc=1 dl="Bad"
        peek t/$DeadLetterQueue => err EntityNotFound("t/$DeadLetterQueue")
        peek t/subscriptions/s/$deadletterqueue => none
        send q/$DeadLetterQueue b => err InvalidOperation("cannot send to \"q\": send to a queue or topic")
        send t/Subscriptions/s b => err InvalidOperation("cannot send to \"t/Subscriptions/s\": send to a queue or topic")
        recv t => err InvalidOperation("cannot receive from topic \"t\": receive from one of its subscriptions")
        "#,
    );
}

#[test]
fn topic_copies_to_every_matching_subscription() {
    check(
        r"
        topic t
        sub t all
        sub t red rule=r:label=red
        sub t two-rules rule=r1:label=red rule=r2:prop.k=1
        sub t none rule=f:false
        send t a label=red
        send t b prop.k=1
        send t c
        peek t/Subscriptions/all
        peek t/Subscriptions/red
        peek t/Subscriptions/two-rules
        peek t/Subscriptions/none
        send t d label=red prop.k=1
        peek t/Subscriptions/two-rules 4
        ",
        r"
        send t a label=red => 1
        send t b prop.k=1 => 2
        send t c => 3
        peek t/Subscriptions/all => a#1 dc=1, b#2 dc=1, c#3 dc=1
        peek t/Subscriptions/red => a#1 dc=1
        peek t/Subscriptions/two-rules => a#1 dc=1, b#2 dc=1
        peek t/Subscriptions/none => none
        send t d label=red prop.k=1 => 4
        peek t/Subscriptions/two-rules 4 => d#4 dc=1
        ",
    );
}

#[test]
fn a_subscription_without_rules_receives_nothing() {
    check(
        r"
        topic t
        sub t s
        sub t r rule=red:label=red
        send t a label=red
        update sub t s
        update sub t r
        send t b label=red
        restart
        send t c label=red
        peek t/Subscriptions/s
        peek t/Subscriptions/r
        update sub t s rule=all:true
        send t d
        peek t/Subscriptions/s
        ",
        r"
        send t a label=red => 1
        send t b label=red => 2
        send t c label=red => 3
        peek t/Subscriptions/s => a#1 dc=1
        peek t/Subscriptions/r => a#1 dc=1
        send t d => 4
        peek t/Subscriptions/s => a#1 dc=1, d#4 dc=1
        ",
    );
}

#[test]
fn a_subscription_recorded_with_an_empty_rule_list_has_the_default_rule() {
    // Logs written before a subscription could lose all its rules record `$Default` as an
    // empty list.
    let mut w = super::harness::World::new();
    w.run("topic t");
    w.sync();
    let sub = crate::config::EntityDefinition::subscription("t", "s", Default::default(), vec![]);
    w.log.push(crate::engine::Record::Entity {
        id: crate::engine::EntityId(2),
        definition: Box::new(sub),
        next_sequence: 1,
    });
    w.restart().unwrap();
    let out = w.run("send t a\npeek t/Subscriptions/s");
    assert_eq!(out.trim(), "send t a => 1\npeek t/Subscriptions/s => a#1 dc=1");
    let s = w.engine.resolve("t/Subscriptions/s").unwrap();
    let crate::config::EntityDefinition::Subscription { rules, .. } =
        w.engine.definition(s).unwrap()
    else {
        panic!("not a subscription")
    };
    assert_eq!(rules, vec![crate::config::Rule::default_rule()]);
}

#[test]
fn correlation_filter_fields() {
    check(
        r"
        topic t
        sub t id rule=r:id=m1
        sub t corr rule=r:corr=c1
        sub t sess rule=r:session=s1
        sub t to rule=r:to=x
        sub t replyto rule=r:replyto=y
        sub t ct rule=r:ct=application/json
        sub t both rule=r:label=red,prop.color=blue
        send t m1
        send t m2 corr=c1
        send t m3 session=s1
        send t m4 to=x
        send t m5 replyto=y
        send t m6 ct=application/json
        send t m7 label=red
        send t m8 label=red prop.color=blue
        peek t/Subscriptions/id
        peek t/Subscriptions/corr
        peek t/Subscriptions/sess
        peek t/Subscriptions/to
        peek t/Subscriptions/replyto
        peek t/Subscriptions/ct
        peek t/Subscriptions/both
        ",
        r"
        send t m1 => 1
        send t m2 corr=c1 => 2
        send t m3 session=s1 => 3
        send t m4 to=x => 4
        send t m5 replyto=y => 5
        send t m6 ct=application/json => 6
        send t m7 label=red => 7
        send t m8 label=red prop.color=blue => 8
        peek t/Subscriptions/id => m1#1 dc=1
        peek t/Subscriptions/corr => m2#2 dc=1
        peek t/Subscriptions/sess => m3#3 dc=1 s=s1
        peek t/Subscriptions/to => m4#4 dc=1
        peek t/Subscriptions/replyto => m5#5 dc=1
        peek t/Subscriptions/ct => m6#6 dc=1
        peek t/Subscriptions/both => m8#8 dc=1
        ",
    );
}

#[test]
fn sql_filters_select_by_properties_in_three_valued_logic() {
    check(
        r"
        topic t
        sub t big rule=r:sql=k~>~1~OR~sys.Label~LIKE~'r%'
        sub t none rule=r:sql=NOT~(missing~=~1)
        send t a prop.k=1
        send t b prop.k=2
        send t c label=red
        peek t/Subscriptions/big
        peek t/Subscriptions/none
        ",
        r"
        send t a prop.k=1 => 1
        send t b prop.k=2 => 2
        send t c label=red => 3
        peek t/Subscriptions/big => b#2 dc=1, c#3 dc=1
        peek t/Subscriptions/none => none
        ",
    );
}

#[test]
fn delete_entity_removes_messages_and_wakes_waiters() {
    check(
        r"
        queue q
        queue other
        send q a
        recv other wait=w1
        delete other
        ready
        delete q
        send q a
        queue q
        peek q
        send q b
        ",
        r#"
        send q a => 1
        recv other wait=w1 => none
        ready => w1: none
        send q a => err EntityNotFound("q")
        peek q => none
        send q b => 1
        "#,
    );
}

#[test]
fn deleting_a_topic_deletes_its_subscriptions() {
    check(
        r"
        topic t
        sub t s
        send t a
        delete t
        peek t/Subscriptions/s
        topic t
        sub t s
        peek t/Subscriptions/s
        ",
        r#"
        send t a => 1
        peek t/Subscriptions/s => err EntityNotFound("t/Subscriptions/s")
        peek t/Subscriptions/s => none
        "#,
    );
}

// ----- 2. entity properties -----------------------------------------------------------------

#[test]
fn property_ranges() {
    check(
        r"
        queue q1 lock=4s
        queue q2 lock=5s
        queue q3 lock=5m
        queue q4 lock=301s
        queue q5 max=0
        queue q6 max=1
        queue q7 dedup=4s
        queue q8 dedup=5s
        queue q9 dedup=7d
        queue q10 dedup=8d
        queue q11 ttl=0s
        queue q12 fwd=q12
        queue q13 fwd=bad$name
        ",
        r#"
        queue q1 lock=4s => err InvalidProperty { property: "LockDuration", reason: "PT4S is outside PT5S..=PT5M" }
        queue q4 lock=301s => err InvalidProperty { property: "LockDuration", reason: "PT5M1S is outside PT5S..=PT5M" }
        queue q5 max=0 => err InvalidProperty { property: "MaxDeliveryCount", reason: "must be at least 1" }
        queue q7 dedup=4s => err InvalidProperty { property: "DuplicateDetectionHistoryTimeWindow", reason: "PT4S is outside PT5S..=P7D" }
        queue q10 dedup=8d => err InvalidProperty { property: "DuplicateDetectionHistoryTimeWindow", reason: "P8D is outside PT5S..=P7D" }
        queue q11 ttl=0s => err InvalidProperty { property: "DefaultMessageTimeToLive", reason: "PT0S is shorter than the minimum PT1S" }
        queue q12 fwd=q12 => err InvalidProperty { property: "ForwardTo", reason: "an entity cannot forward to itself" }
        queue q13 fwd=bad$name => err InvalidProperty { property: "ForwardTo", reason: "invalid entity name \"bad$name\": a queue or topic name has only letters, digits, '.', '-', '_' and '/'" }
        "#,
    );
}

#[test]
fn duplicate_detection_and_sessions_are_fixed_at_creation() {
    check(
        r"
        queue q
        update queue q session
        update queue q dedup=1m
        topic t dedup=1m
        update topic t
        sub t s session
        update sub t s
        update queue q lock=10s max=2
        info q
        update topic q
        update queue missing
        ",
        r#"
        update queue q session => err ImmutableProperty { entity: "q", property: "RequiresSession" }
        update queue q dedup=1m => err ImmutableProperty { entity: "q", property: "RequiresDuplicateDetection" }
        update topic t => err ImmutableProperty { entity: "t", property: "RequiresDuplicateDetection" }
        update sub t s => err ImmutableProperty { entity: "t/Subscriptions/s", property: "RequiresSession" }
        info q => q lock=10s max=Some(2) dedup=None session=false
        update topic q => err EntityAlreadyExists("q")
        update queue missing => err EntityNotFound("missing")
        "#,
    );
}

#[test]
fn lock_duration_change_applies_to_new_locks() {
    check(
        r"
        queue q lock=30s
        send q a,b
        recv q
        update queue q lock=10s
        recv q
        advance 10s
        peek q
        recv q 2
        ",
        r"
        send q a,b => 1,2
        recv q => a#1 dc=1
        recv q => b#2 dc=1
        peek q => a#1 dc=1, b#2 dc=2
        recv q 2 => b#2 dc=2
        ",
    );
}

// ----- 3. messages and broker-set fields ------------------------------------------------------

#[test]
fn sequence_numbers_are_per_entity_and_monotonic() {
    check(
        r"
        queue q1
        queue q2
        send q1 a,b
        send q2 c
        recv q1 rad
        send q1 d
        peek q1
        peek q2
        ",
        r"
        send q1 a,b => 1,2
        send q2 c => 1
        recv q1 rad => a#1 dc=1
        send q1 d => 3
        peek q1 => b#2 dc=1, d#3 dc=1
        peek q2 => c#1 dc=1
        ",
    );
}

#[test]
fn renew_lock_and_locked_until() {
    check(
        r"
        queue q lock=30s
        send q a
        recv q
        advance 20s
        renew a
        advance 20s
        complete a
        renew a
        ",
        r"
        send q a => 1
        recv q => a#1 dc=1
        renew a => until=+50s
        complete a => ok
        renew a => err MessageLockLost
        ",
    );
}

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
    let mut w = super::harness::World::new();
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
    let mut w = super::harness::World::new();
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
    let mut w = super::harness::World::new();
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
    let mut w = super::harness::World::new();
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

// ----- 8. time to live --------------------------------------------------------------------------

#[test]
fn expired_messages_are_never_delivered() {
    check(
        r"
        queue q ttl=1m
        send q a ttl=10s
        send q b
        send q c ttl=2m
        peek q
        advance 10s
        peek q
        advance 50s
        recv q 5
        counts q
        ",
        r"
        send q a ttl=10s => 1
        send q b => 2
        send q c ttl=2m => 3
        peek q => a#1 dc=1 exp=+10s, b#2 dc=1 exp=+60s, c#3 dc=1 exp=+60s
        peek q => b#2 dc=1 exp=+60s, c#3 dc=1 exp=+60s
        recv q 5 => none
        counts q => active=0 locked=0 deferred=0 scheduled=0 dlq=0
        ",
    );
}

#[test]
fn expiry_dead_letters_when_enabled_and_the_dlq_has_no_ttl() {
    check(
        r"
        queue q ttl=10s dlq-exp
        send q a
        deadline
        advance 10s
        counts q
        advance 1d
        recv q/$DeadLetterQueue
        abandon a
        advance 1d
        peek q/$DeadLetterQueue
        ",
        r#"
        send q a => 1
        deadline => +10s
        counts q => active=0 locked=0 deferred=0 scheduled=0 dlq=1
        recv q/$DeadLetterQueue => a#1 dc=1 dl="TTLExpiredException"
        abandon a => ok
        peek q/$DeadLetterQueue => a#1 dc=2 dl="TTLExpiredException"
        "#,
    );
}

#[test]
fn a_locked_message_expires_when_its_lock_ends() {
    check(
        r"
        queue q lock=30s dlq-exp
        send q a ttl=10s
        recv q
        advance 20s
        counts q
        complete a
        send q b ttl=10s
        recv q
        advance 20s
        abandon b
        counts q
        peek q/$DeadLetterQueue
        ",
        r#"
        send q a ttl=10s => 1
        recv q => a#1 dc=1 exp=+10s
        counts q => active=1 locked=1 deferred=0 scheduled=0 dlq=0
        complete a => ok
        send q b ttl=10s => 2
        recv q => b#2 dc=1 exp=+30s
        abandon b => ok
        counts q => active=0 locked=0 deferred=0 scheduled=0 dlq=1
        peek q/$DeadLetterQueue => b#2 dc=2 dl="TTLExpiredException"
        "#,
    );
}

/// As in Service Bus, a deferred message whose time to live passed stays deferred (and in
/// peeks and counts) until a receive by its sequence number tries it: that receive expires it
/// (here: into the dead-letter queue) and finds no message.
#[test]
fn an_expired_deferred_message_stays_until_a_receive_tries_it() {
    check(
        r"
        queue q dlq-exp
        send q a ttl=10s
        recv q
        defer a
        advance 1h
        peek q
        counts q
        deferred q 1
        counts q
        peek q/$DeadLetterQueue
        deferred q 1
        ",
        r#"
        send q a ttl=10s => 1
        recv q => a#1 dc=1 exp=+10s
        defer a => ok
        peek q => a#1 dc=1 deferred exp=+10s
        counts q => active=0 locked=0 deferred=1 scheduled=0 dlq=0
        deferred q 1 => err MessageNotFound(1)
        counts q => active=0 locked=0 deferred=0 scheduled=0 dlq=1
        peek q/$DeadLetterQueue => a#1 dc=1 dl="TTLExpiredException"
        deferred q 1 => err MessageNotFound(1)
        "#,
    );
}

#[test]
fn scheduled_messages_expire_and_deferred_ones_wait_for_a_receive() {
    check(
        r"
        queue q
        send q a ttl=10s
        recv q
        defer a
        advance 10s
        peek q
        schedule q b +10s ttl=5s
        peek q
        advance 10s
        peek q
        advance 5s
        peek q
        ",
        r"
        send q a ttl=10s => 1
        recv q => a#1 dc=1 exp=+10s
        defer a => ok
        peek q => a#1 dc=1 deferred exp=+10s
        schedule q b +10s ttl=5s => 2
        peek q => a#1 dc=1 deferred exp=+10s, b#2 dc=1 scheduled exp=+25s
        peek q => a#1 dc=1 deferred exp=+10s, b#3 dc=1 exp=+25s
        peek q => a#1 dc=1 deferred exp=+10s
        ",
    );
}

// ----- 9. duplicate detection ------------------------------------------------------------------

#[test]
fn duplicate_detection_window() {
    check(
        r"
        queue q dedup=1m
        send q a
        send q a,b,b
        advance 30s
        send q a
        deadline
        advance 30s
        send q a
        recv q 5
        counts q
        ",
        r"
        send q a => 1
        send q a,b,b => dup,2,dup
        send q a => dup
        deadline => +60s
        send q a => 3
        recv q 5 => a#1 dc=1, b#2 dc=1, a#3 dc=1
        counts q => active=3 locked=3 deferred=0 scheduled=0 dlq=0
        ",
    );
}

#[test]
fn duplicate_detection_survives_a_restart() {
    check(
        r"
        topic t dedup=1m
        sub t s
        send t a
        restart
        send t a
        advance 1m
        send t a
        peek t/Subscriptions/s
        ",
        r"
        send t a => 1
        send t a => dup
        send t a => 2
        peek t/Subscriptions/s => a#1 dc=1, a#2 dc=1
        ",
    );
}

#[test]
fn duplicate_detection_is_off_by_default() {
    check(
        r"
        queue q
        send q a,a
        ",
        r"
        send q a,a => 1,2
        ",
    );
}

// ----- 10. sessions -----------------------------------------------------------------------------

#[test]
fn sessions_deliver_in_order_to_one_holder() {
    check(
        r"
        queue q session lock=30s
        send q a1,a2 session=a
        send q b1 session=b
        send q a3 session=a
        recv q
        accept q
        accept q a
        accept q
        srecv a 2
        srecv b 5
        srecv a 5
        complete a1
        abandon a2
        srecv a 5
        accept q
        ",
        r#"
        send q a1,a2 session=a => 1,2
        send q b1 session=b => 3
        send q a3 session=a => 4
        recv q => err SessionRequired("q")
        accept q => a until=+30s
        accept q a => err SessionCannotBeLocked("a")
        accept q => b until=+30s
        srecv a 2 => a1#1 dc=1 s=a, a2#2 dc=1 s=a
        srecv b 5 => b1#3 dc=1 s=b
        srecv a 5 => a3#4 dc=1 s=a
        complete a1 => ok
        abandon a2 => ok
        srecv a 5 => a2#2 dc=2 s=a
        accept q => none
        "#,
    );
}

#[test]
fn session_lock_expiry_frees_the_session_and_its_messages() {
    check(
        r"
        queue q session lock=30s
        send q a1,a2 session=a
        accept q a
        srecv a
        advance 20s
        srenew a
        advance 40s
        srecv a
        complete a1
        accept q
        srecv a 2
        srelease a
        srecv a
        accept q a
        srecv a 2
        ",
        r"
        send q a1,a2 session=a => 1,2
        accept q a => a until=+30s
        srecv a => a1#1 dc=1 s=a
        srenew a => until=+50s
        srecv a => err SessionLockLost
        complete a1 => err MessageLockLost
        accept q => a until=+90s
        srecv a 2 => a1#1 dc=2 s=a, a2#2 dc=1 s=a
        srelease a => ok
        srecv a => err SessionLockLost
        accept q a => a until=+90s
        srecv a 2 => a1#1 dc=2 s=a, a2#2 dc=1 s=a
        ",
    );
}

#[test]
fn accept_next_session_waits_for_a_message() {
    check(
        r"
        queue q session
        accept q wait=w1
        accept q wait=w2
        send q a1 session=a
        ready
        srecv a wait=w3
        srecv a wait=w4
        complete a1
        srecv a wait=w4
        send q a2 session=a
        send q b1 session=b
        ready
        ",
        r#"
        accept q wait=w1 => none
        accept q wait=w2 => none
        send q a1 session=a => 1
        ready => w1: session a until=+60s
        srecv a wait=w3 => a1#1 dc=1 s=a
        srecv a wait=w4 => none
        complete a1 => ok
        srecv a wait=w4 => err InvalidArgument("waiter 4 is already parked")
        send q a2 session=a => 2
        send q b1 session=b => 3
        ready => w4: a2#2 dc=1 s=a; w2: session b until=+60s
        "#,
    );
}

#[test]
fn session_state_is_kept_and_persisted() {
    check(
        r"
        queue q session
        accept q s1
        sstate s1
        sstate s1 = hello
        sstate s1
        srelease s1
        restart
        accept q s1
        sstate s1
        sstate s1 = -
        restart
        accept q s1
        sstate s1
        ",
        r"
        accept q s1 => s1 until=+60s
        sstate s1 => none
        sstate s1 = hello => ok
        sstate s1 => hello
        srelease s1 => ok
        accept q s1 => s1 until=+60s
        sstate s1 => hello
        sstate s1 = - => ok
        accept q s1 => s1 until=+60s
        sstate s1 => none
        ",
    );
}

#[test]
fn session_operations_on_entities_without_sessions() {
    check(
        r"
        queue q
        accept q
        accept q/$DeadLetterQueue
        queue s session
        send s a session=x
        recv s/$DeadLetterQueue
        srecv nobody
        ",
        r#"
        accept q => err SessionsNotEnabled("q")
        accept q/$DeadLetterQueue => err SessionsNotEnabled("q")
        send s a session=x => 1
        recv s/$DeadLetterQueue => none
        srecv nobody => err SessionLockLost
        "#,
    );
}

#[test]
fn deferred_session_messages_need_the_session() {
    check(
        r"
        queue q session
        send q a session=x
        send q b session=y
        accept q x
        srecv x
        defer a
        deferred q 1
        deferred q 1 session=x
        accept q y
        deferred q 1 session=y
        ",
        r#"
        send q a session=x => 1
        send q b session=y => 2
        accept q x => x until=+60s
        srecv x => a#1 dc=1 s=x
        defer a => ok
        deferred q 1 => err SessionRequired("q")
        deferred q 1 session=x => a#1 dc=1 deferred s=x
        accept q y => y until=+60s
        deferred q 1 session=y => err MessageNotFound(1)
        "#,
    );
}

#[test]
fn a_topic_message_without_session_is_dead_lettered_in_a_session_subscription() {
    check(
        r"
        topic t
        sub t s session
        sub t plain
        send t a
        counts t/Subscriptions/s
        peek t/Subscriptions/s/$DeadLetterQueue
        peek t/Subscriptions/plain
        ",
        r#"
        send t a => 1
        counts t/Subscriptions/s => active=0 locked=0 deferred=0 scheduled=0 dlq=1
        peek t/Subscriptions/s/$DeadLetterQueue => a#1 dc=1 dl="Session ID is null"
        peek t/Subscriptions/plain => a#1 dc=1
        "#,
    );
}

#[test]
fn sessions_are_listed_by_their_oldest_message_then_state_only() {
    check(
        r"
        queue q session
        sessions q
        send q a session=s2
        send q b session=s1
        send q c session=s2
        sessions q
        accept q s1
        srecv s1
        sstate s1 = x
        sessions q
        complete b
        send q d session=s3 at=+10s
        sessions q
        sessions q/$DeadLetterQueue
        ",
        r#"
        sessions q => none
        send q a session=s2 => 1
        send q b session=s1 => 2
        send q c session=s2 => 3
        sessions q => s2, s1
        accept q s1 => s1 until=+60s
        srecv s1 => b#2 dc=1 s=s1
        sstate s1 = x => ok
        sessions q => s2, s1 state=x
        complete b => ok
        send q d session=s3 at=+10s => 4
        sessions q => s2, s3, s1 (state only) state=x
        sessions q/$DeadLetterQueue => err SessionsNotEnabled("q/$DeadLetterQueue")
        "#,
    );
}

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
    let mut w = super::harness::World::new();
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
