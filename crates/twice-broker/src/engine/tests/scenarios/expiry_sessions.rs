//! Time to live, duplicate detection, and sessions.

use super::super::harness::check;

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
