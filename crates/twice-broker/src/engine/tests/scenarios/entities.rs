//! Entities, their properties, and the fields the broker sets on messages.

use super::super::harness::check;

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
    let mut w = super::super::harness::World::new();
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
