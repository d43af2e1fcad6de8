//! The Service Bus vocabulary round trip: every `$management` operation and every settlement
//! goes through the encoder a client uses and the parser a server uses (and every reply back
//! the other way), as bytes.

use bytes::Bytes;
use twice::{DeadLetterReason, LockToken, Properties, SequenceNumber, SessionId, Timestamp};
use twice_amqp::codec::{Decoder, Value};
use twice_amqp::performative::Outcome;
use twice_amqp::sas::Claim;
use twice_amqp::servicebus::{
    Condition, ManagementReply, ManagementRequest, Operation, Reply, ReplyMessage, Request,
    RequestError, Scheduled, Settle, StatusKeys,
};

fn props() -> Properties {
    let mut p = Properties::new();
    p.insert("attempt".into(), twice::Value::Long(3));
    p.insert("why".into(), twice::Value::String("flaky".into()));
    p
}

/// Every settlement a receiver can ask for.
fn settlements() -> Vec<Settle> {
    vec![
        Settle::Complete,
        Settle::Abandon(Properties::new()),
        Settle::Abandon(props()),
        Settle::Defer(Properties::new()),
        Settle::Defer(props()),
        Settle::DeadLetter(DeadLetterReason::new("Poison", "failed 10 times"), Properties::new()),
        Settle::DeadLetter(DeadLetterReason::new("Poison", "failed 10 times"), props()),
        Settle::Release,
    ]
}

/// One request of each operation (settlements of every kind for `update-disposition`).
fn requests() -> Vec<ManagementRequest> {
    use ManagementRequest as R;
    let locks = vec![LockToken::random(), LockToken::random()];
    let seqs = vec![SequenceNumber::new(7), SequenceNumber::new(9)];
    let sid = SessionId::new("s-1");
    let mut out = vec![
        R::RenewLock { lock_tokens: locks.clone() },
        R::PeekMessage { from: 5, count: 20, session_id: None },
        R::PeekMessage { from: 1, count: 1, session_id: Some(sid.clone()) },
        R::ScheduleMessage {
            messages: vec![
                Scheduled {
                    message: Bytes::from_static(b"\x00\x53\x75\xa0\x01x"),
                    message_id: Some("m-1".into()),
                    session_id: Some("s-1".into()),
                    partition_key: Some("p".into()),
                },
                Scheduled {
                    message: Bytes::from_static(b"\x00\x53\x75\xa0\x01y"),
                    message_id: None,
                    session_id: None,
                    partition_key: None,
                },
            ],
        },
        R::CancelScheduledMessage { sequence_numbers: seqs.clone() },
        R::ReceiveBySequenceNumber {
            sequence_numbers: seqs.clone(),
            receive_and_delete: false,
            session_id: None,
        },
        R::ReceiveBySequenceNumber {
            sequence_numbers: seqs,
            receive_and_delete: true,
            session_id: Some(sid.clone()),
        },
        R::RenewSessionLock { session_id: sid.clone() },
        R::GetSessionState { session_id: sid.clone() },
        R::SetSessionState { session_id: sid.clone(), state: Some(Bytes::from_static(b"st")) },
        R::SetSessionState { session_id: sid.clone(), state: None },
        R::GetMessageSessions { skip: 10, top: 50 },
        R::AddRule {
            name: "r".into(),
            description: Value::Map(vec![(
                Value::string("sql-filter"),
                Value::Map(vec![(Value::string("expression"), Value::string("a = 1"))]),
            )]),
        },
        R::RemoveRule { name: "r".into() },
        R::EnumerateRules { skip: 0, top: 100 },
    ];
    for settle in settlements() {
        // `$management` has no release: it goes as the nearest, an abandon.
        if settle != Settle::Release {
            let session_id = matches!(settle, Settle::Complete).then(|| sid.clone());
            out.push(R::UpdateDisposition { lock_tokens: locks.clone(), settle, session_id });
        }
    }
    out
}

/// As the server receives it: bytes, the envelope, then the operation and body.
fn through_the_wire(req: &ManagementRequest) -> ManagementRequest {
    let mut envelope = req.to_request();
    envelope.message_id = Value::Uuid(uuid::Uuid::new_v4());
    envelope.reply_to = Some("reply-1".into());
    let received = Request::parse(&envelope.encode()).unwrap();
    assert_eq!(received, envelope);
    assert_eq!(received.operation(), Some(req.operation().name()));
    ManagementRequest::parse(&received).unwrap()
}

#[test]
fn every_operation_round_trips_from_client_to_server() {
    let _alone = crate::alone();
    let all = requests();
    for op in Operation::ALL {
        assert!(all.iter().any(|r| r.operation() == *op), "no request of {op} is tested");
        assert_eq!(Operation::parse(op.name()), Some(*op));
    }
    for req in all {
        assert_eq!(through_the_wire(&req), req, "{}", req.operation());
    }
}

#[test]
fn each_operation_needs_its_claim() {
    let _alone = crate::alone();
    let claim = |op: Operation| op.claim();
    assert_eq!(claim(Operation::ScheduleMessage), Claim::Send);
    assert_eq!(claim(Operation::CancelScheduledMessage), Claim::Send);
    for op in [Operation::AddRule, Operation::RemoveRule, Operation::EnumerateRules] {
        assert_eq!(claim(op), Claim::Manage);
    }
    for op in [
        Operation::RenewLock,
        Operation::UpdateDisposition,
        Operation::PeekMessage,
        Operation::ReceiveBySequenceNumber,
        Operation::RenewSessionLock,
        Operation::GetSessionState,
        Operation::SetSessionState,
        Operation::GetMessageSessions,
    ] {
        assert_eq!(claim(op), Claim::Listen);
    }
}

#[test]
fn a_release_through_management_is_an_abandon() {
    let _alone = crate::alone();
    let req = ManagementRequest::UpdateDisposition {
        lock_tokens: vec![LockToken::random()],
        settle: Settle::Release,
        session_id: None,
    };
    let ManagementRequest::UpdateDisposition { settle, .. } = through_the_wire(&req) else {
        panic!("not an update-disposition");
    };
    assert_eq!(settle, Settle::Abandon(Properties::new()));
}

#[test]
fn bad_requests_are_named() {
    let _alone = crate::alone();
    let mut req = Request::new("com.microsoft:renew-lock", Value::Map(vec![]));
    assert_eq!(
        ManagementRequest::parse(&req),
        Err(RequestError::Invalid("'lock-tokens' is missing".into()))
    );
    req.body = Value::Map(vec![(Value::string("lock-tokens"), Value::List(vec![Value::Int(1)]))]);
    assert_eq!(
        ManagementRequest::parse(&req),
        Err(RequestError::Invalid("'lock-tokens' must hold uuids".into()))
    );
    let unknown = Request::new("com.microsoft:no-such-thing", Value::Null);
    assert_eq!(
        ManagementRequest::parse(&unknown),
        Err(RequestError::Unsupported("com.microsoft:no-such-thing".into()))
    );
    let session = Request::new(Operation::RenewSessionLock.name(), Value::Map(vec![]));
    assert_eq!(
        ManagementRequest::parse(&session),
        Err(RequestError::Invalid("'session-id' is missing".into()))
    );
}

#[test]
fn every_settlement_round_trips_as_an_outcome() {
    let _alone = crate::alone();
    for settle in settlements() {
        // As the client sends it on the link, and the server reads it.
        let bytes = settle.to_outcome().to_value().to_bytes();
        let outcome = Outcome::from_value(&Decoder::new(&bytes).value().unwrap()).unwrap();
        assert_eq!(Settle::from_outcome(&outcome), Some(settle.clone()), "{settle:?}");
        // The server's echo, as the client reads it: never a failure.
        let echo = Settle::echo_of(&outcome);
        let bytes = echo.to_value().to_bytes();
        let echo = Outcome::from_value(&Decoder::new(&bytes).value().unwrap()).unwrap();
        assert_eq!(Settle::echo_error(&echo), None, "{settle:?}");
        assert_eq!(std::mem::discriminant(&echo), std::mem::discriminant(&outcome));
    }
    assert_eq!(Settle::from_outcome(&Outcome::Other), None);
    assert_eq!(Settle::echo_of(&Outcome::Other), Outcome::Accepted);
}

#[test]
fn a_rejection_that_is_no_dead_letter_is_an_error() {
    let _alone = crate::alone();
    let refused = Outcome::Rejected(Some(twice_amqp::performative::AmqpError::new(
        Condition::MessageLockLost,
        "gone",
    )));
    let e = Settle::echo_error(&refused).unwrap();
    assert_eq!(Condition::parse(&e.condition), Some(Condition::MessageLockLost));
    let dead = Settle::DeadLetter(DeadLetterReason::new("r", "d"), Properties::new());
    assert_eq!(Settle::echo_error(&dead.to_outcome()), None);
}

#[test]
fn every_reply_round_trips_from_server_to_client() {
    let _alone = crate::alone();
    let lock = LockToken::random();
    let msg = Bytes::from_static(b"\x00\x53\x75\xa0\x01x");
    let cases = vec![
        (Operation::RenewLock, ManagementReply::Expirations(vec![Timestamp::from_millis(5)])),
        (
            Operation::PeekMessage,
            ManagementReply::Messages(vec![ReplyMessage {
                lock_token: None,
                message: msg.clone(),
            }]),
        ),
        (
            Operation::ReceiveBySequenceNumber,
            ManagementReply::Messages(vec![ReplyMessage { lock_token: Some(lock), message: msg }]),
        ),
        (
            Operation::ScheduleMessage,
            ManagementReply::SequenceNumbers(vec![SequenceNumber::new(1), SequenceNumber::new(2)]),
        ),
        (Operation::RenewSessionLock, ManagementReply::Expiration(Timestamp::from_millis(9))),
        (Operation::GetSessionState, ManagementReply::SessionState(Some(Bytes::from_static(b"s")))),
        (Operation::GetSessionState, ManagementReply::SessionState(None)),
        (
            Operation::GetMessageSessions,
            ManagementReply::Sessions { skip: 3, ids: vec![SessionId::new("a")] },
        ),
        (Operation::EnumerateRules, ManagementReply::Rules(vec![Value::string("rule")])),
        (Operation::UpdateDisposition, ManagementReply::Empty),
        (Operation::CancelScheduledMessage, ManagementReply::Empty),
        (Operation::SetSessionState, ManagementReply::Empty),
        (Operation::AddRule, ManagementReply::Empty),
        (Operation::RemoveRule, ManagementReply::Empty),
    ];
    for op in Operation::ALL {
        assert!(cases.iter().any(|(o, _)| o == op), "no reply of {op} is tested");
    }
    let req = Request::new("x", Value::Null);
    for (op, body) in cases {
        let mut reply = Reply::to_request(&req, 200, "OK");
        reply.body = body.to_value();
        let back = Reply::parse(&reply.encode()).unwrap();
        assert!(back.is_success());
        assert_eq!(ManagementReply::parse(op, &back.body).unwrap(), body, "{op}");
    }
    // A 204 (nothing found) carries an empty map: an empty list to the client.
    let none = ManagementReply::parse(Operation::PeekMessage, &Value::Map(vec![])).unwrap();
    assert_eq!(none, ManagementReply::Messages(vec![]));
}

#[test]
fn a_cbs_reply_is_read_in_its_own_spelling() {
    let _alone = crate::alone();
    let req = Request::new("put-token", Value::string("t"));
    let mut reply = Reply::to_request(&req, 202, "Accepted");
    reply.keys = StatusKeys::Cbs;
    let back = Reply::parse(&reply.encode()).unwrap();
    assert_eq!((back.status, back.keys), (202, StatusKeys::Cbs));
}
