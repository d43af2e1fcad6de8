//! The mapping's round trips and its in-place encoding against the value-built reference.

use super::*;
use twice::{LockToken, SequenceNumber};

/// A received message encoded by building its sections as values first: the reference
/// that the bytes of [`encode_received`] must equal.
fn encode_received_as_values(r: &ReceivedMessage, how: Presentation) -> Vec<u8> {
    let m = &r.message;
    let pass = PassThrough::of(m);
    let mut out = Vec::with_capacity(m.body.len() + 256);
    // The effective time to live, as Service Bus sends it: the message's own, else what its
    // entity's default made of it (when it fits the header's milliseconds).
    let effective = m.time_to_live.or_else(|| {
        let ms = r.expires_at?.as_millis().checked_sub(r.enqueued_time.as_millis())?;
        Some(Duration::from_millis(u64::try_from(ms).ok().filter(|&ms| ms > 0)?))
    });
    let ttl = effective
        .map_or(Value::Null, |d| Value::Uint(u32::try_from(d.as_millis()).unwrap_or(u32::MAX)));
    let wire_count = r.delivery_count.saturating_sub(1);
    described_list(
        section::HEADER,
        vec![Value::Null, Value::Null, ttl, Value::Null, Value::Uint(wire_count)],
    )
    .encode(&mut out);
    let lock = match how {
        Presentation::Locked => r.lock_token,
        Presentation::Unlocked => None,
    };
    if let Some(lock) = lock {
        Value::described(
            section::DELIVERY_ANNOTATIONS,
            Value::Map(vec![(Value::symbol("x-opt-lock-token"), Value::Uuid(*lock.as_uuid()))]),
        )
        .encode(&mut out);
    }
    let mut ma = vec![
        (Value::symbol("x-opt-sequence-number"), Value::Long(r.sequence_number.get())),
        (Value::symbol("x-opt-enqueued-time"), Value::Timestamp(r.enqueued_time.as_millis())),
    ];
    if lock.is_some()
        && let Some(until) = r.locked_until
    {
        ma.push((Value::symbol("x-opt-locked-until"), Value::Timestamp(until.as_millis())));
    }
    if let Some(at) = m.scheduled_enqueue_time {
        ma.push((Value::symbol("x-opt-scheduled-enqueue-time"), Value::Timestamp(at.as_millis())));
    }
    if let Some(pk) = &m.partition_key {
        ma.push((Value::symbol("x-opt-partition-key"), Value::String(pk.clone())));
    }
    if let Some(src) = &r.dead_letter_source {
        ma.push((Value::symbol("x-opt-deadletter-source"), Value::String(src.clone())));
    }
    match r.state {
        MessageState::Active => {}
        MessageState::Deferred => ma.push((Value::symbol("x-opt-message-state"), Value::Int(1))),
        MessageState::Scheduled => ma.push((Value::symbol("x-opt-message-state"), Value::Int(2))),
    }
    ma.extend(pass.annotations);
    Value::described(section::MESSAGE_ANNOTATIONS, Value::Map(ma)).encode(&mut out);
    let s = |o: &Option<String>| o.clone().map_or(Value::Null, Value::String);
    // The creation time is the sender's, else (as Service Bus sets it) the enqueued time.
    let created = pass.creation_time.unwrap_or(Value::Timestamp(r.enqueued_time.as_millis()));
    described_list(
        section::PROPERTIES,
        vec![
            m.message_id.as_ref().map_or(Value::Null, |id| Value::String(id.as_str().to_owned())),
            pass.user_id.unwrap_or(Value::Null),
            s(&m.to),
            s(&m.subject),
            s(&m.reply_to),
            s(&m.correlation_id),
            m.content_type.clone().map_or(Value::Null, Value::Symbol),
            pass.content_encoding.unwrap_or(Value::Null),
            r.expires_at.map_or(Value::Null, |t| Value::Timestamp(t.as_millis())),
            created,
            m.session_id.as_ref().map_or(Value::Null, |id| Value::String(id.as_str().to_owned())),
            Value::Null,
            s(&m.reply_to_session_id),
        ],
    )
    .encode(&mut out);
    let raw_body =
        matches!(m.application_properties.get(RAW_BODY_PROPERTY), Some(twice::Value::Bool(true)));
    let mut ap: Vec<(Value, Value)> = m
        .application_properties
        .iter()
        .filter(|(k, _)| k.as_str() != RAW_BODY_PROPERTY && k.as_str() != PASS_THROUGH_PROPERTY)
        .map(|(k, v)| (Value::String(k.clone()), from_twice_value(v)))
        .collect();
    ap.extend(pass.application_properties);
    let mut add = |key: &str, v: &Option<String>| {
        if let Some(v) = v
            && !m.application_properties.contains_key(key)
        {
            ap.push((Value::string(key), Value::String(v.clone())));
        }
    };
    add("DeadLetterReason", &r.dead_letter_reason);
    add("DeadLetterErrorDescription", &r.dead_letter_error_description);
    if !ap.is_empty() {
        Value::described(section::APPLICATION_PROPERTIES, Value::Map(ap)).encode(&mut out);
    }
    if raw_body {
        out.extend_from_slice(&m.body);
    } else {
        Value::described(section::DATA, Value::Binary(m.body.clone())).encode(&mut out);
    }
    if !pass.footer.is_empty() {
        Value::described(section::FOOTER, Value::Map(pass.footer)).encode(&mut out);
    }
    out
}

/// `encode_received` writes exactly the bytes of the sections built as values, for every
/// field a message and its delivery may carry, in both presentations, with lists and maps
/// of both widths.
#[test]
fn encode_received_writes_the_bytes_of_its_values() {
    let bare =
        ReceivedMessage::new(Message::new(""), SequenceNumber::new(1), Timestamp::from_millis(0));
    let mut full = ReceivedMessage::new(
        Message::new(vec![9u8; 1024])
            .with_message_id("m-1")
            .with_session_id("s")
            .with_correlation_id("c")
            .with_subject("subj")
            .with_content_type("application/json")
            .with_to("to")
            .with_reply_to("reply")
            .with_reply_to_session_id("rs")
            .with_time_to_live(Duration::from_secs(60))
            .with_scheduled_enqueue_time(Timestamp::from_millis(5_000))
            .with_partition_key("pk")
            .with_property("text", "v")
            .with_property("n", 42i64)
            .with_property("i", -7i32)
            .with_property("yes", true)
            .with_property("x", 1.5f64)
            .with_property("bin", twice::Value::Binary(Bytes::from_static(b"\x00\x01")))
            .with_property("sym", twice::Value::Symbol("s".into()))
            .with_property("at", twice::Value::Timestamp(Timestamp::from_millis(77)))
            .with_property("id", twice::Value::Uuid(uuid::Uuid::from_u128(5)))
            .with_property("small", twice::Value::Ubyte(3))
            .with_property("long", "p".repeat(300)),
        SequenceNumber::new(1 << 40),
        Timestamp::from_millis(1_700_000_000_000),
    );
    full.expires_at = Some(Timestamp::from_millis(1_700_000_060_000));
    full.lock_token = Some(LockToken::random());
    full.locked_until = Some(Timestamp::from_millis(1_700_000_030_000));
    full.delivery_count = 4;
    full.state = MessageState::Scheduled;
    full.dead_letter_source = Some("q".into());
    full.dead_letter_reason = Some("Poison".into());
    full.dead_letter_error_description = Some("d".repeat(300));
    // A time to live only from the entity's default, and a reason the sender set itself.
    let mut derived = bare.clone();
    derived.expires_at = Some(Timestamp::from_millis(90_000));
    derived.state = MessageState::Deferred;
    derived.message =
        Message::new("b").with_property("DeadLetterReason", "own").with_message_id("m");
    derived.dead_letter_reason = Some("Poison".into());
    let mut many = bare.clone();
    for i in 0..200 {
        many.message = many.message.with_property(format!("k{i}"), i64::from(i));
    }
    // Pass-through fields (annotations, typed properties, footer) and a raw body.
    let mut payload = Vec::new();
    Value::described(
        section::MESSAGE_ANNOTATIONS,
        Value::Map(vec![(Value::symbol("custom"), Value::string("kept"))]),
    )
    .encode(&mut payload);
    described_list(
        section::PROPERTIES,
        vec![
            Value::Ulong(12),
            Value::Binary(Bytes::from_static(b"alice")),
            Value::Null,
            Value::Null,
            Value::Null,
            Value::Null,
            Value::Null,
            Value::symbol("gzip"),
            Value::Null,
            Value::Timestamp(1_700_000_000_000),
        ],
    )
    .encode(&mut payload);
    Value::described(
        section::APPLICATION_PROPERTIES,
        Value::Map(vec![(
            Value::string("price"),
            Value::Described(
                Box::new(Value::symbol("com.microsoft:decimal")),
                Box::new(Value::Binary(Bytes::from_static(&[1, 2, 3]))),
            ),
        )]),
    )
    .encode(&mut payload);
    Value::described(0x77, Value::string("hello")).encode(&mut payload);
    Value::described(section::FOOTER, Value::Map(vec![(Value::symbol("f"), Value::string("v"))]))
        .encode(&mut payload);
    let passed = ReceivedMessage::new(
        Sections::parse(&payload).unwrap().to_message(),
        SequenceNumber::new(3),
        Timestamp::from_millis(1000),
    );
    for r in [bare, full, derived, many, passed] {
        for how in [Presentation::Locked, Presentation::Unlocked] {
            let want = encode_received_as_values(&r, how);
            assert_eq!(encode_received(&r, how), want, "{how:?} {:?}", r.message.message_id);
            Sections::parse(&want).unwrap();
        }
    }
}

/// The first message of a batch the Python SDK sent, as bytes from its frame log.
#[test]
fn decodes_a_python_batch_entry() {
    let raw =
        b"\x00Ss\xc03\r\xa1$d6f5cbb1-b18e-4bcf-ba51-b2a22ee6970e@@@@@@@@@@@@\x00Su\xa0\x07batch-1";
    let s = Sections::parse(raw).unwrap();
    let m = s.to_message();
    assert_eq!(m.message_id.unwrap().as_str(), "d6f5cbb1-b18e-4bcf-ba51-b2a22ee6970e");
    assert_eq!(&m.body[..], b"batch-1");
}

/// A JS batch entry: empty header, a 32-bit empty annotations map, empty properties.
#[test]
fn decodes_a_js_batch_entry() {
    let raw = b"\x00SpE\x00Sr\xd1\x00\x00\x00\x04\x00\x00\x00\x00\x00SsE\x00Su\xa0\x07\"js-b1\"";
    let m = Sections::parse(raw).unwrap().to_message();
    assert_eq!(m.message_id, None);
    assert_eq!(&m.body[..], b"\"js-b1\"");
}

#[test]
fn batch_payload_splits_into_messages() {
    let one = encode_message(&Message::new("a").with_message_id("1"));
    let two = encode_message(&Message::new("b").with_session_id("s"));
    let mut payload = Vec::new();
    Value::described(0x75, Value::Binary(Bytes::from(one))).encode(&mut payload);
    Value::described(0x75, Value::Binary(Bytes::from(two))).encode(&mut payload);
    let ms = messages_of(&payload, BATCH_FORMAT).unwrap();
    assert_eq!(ms.len(), 2);
    assert_eq!(ms[1].session_id.as_ref().unwrap().as_str(), "s");
}

#[test]
fn received_message_carries_broker_fields_with_exact_types() {
    let mut r = ReceivedMessage::new(
        Message::new("x").with_message_id("m").with_property("k", "v"),
        SequenceNumber::new(7),
        Timestamp::from_millis(1000),
    );
    let token = LockToken::random();
    r.lock_token = Some(token);
    r.locked_until = Some(Timestamp::from_millis(2000));
    r.delivery_count = 2;
    let bytes = encode_received(&r, Presentation::Locked);
    let mut d = Decoder::new(&bytes);
    let header = d.value().unwrap();
    assert_eq!(header.undescribed().as_seq().unwrap()[4], Value::Uint(1));
    let da = d.value().unwrap();
    assert_eq!(da.undescribed().get("x-opt-lock-token"), Some(&Value::Uuid(*token.as_uuid())));
    let ma = d.value().unwrap();
    assert_eq!(ma.undescribed().get("x-opt-sequence-number"), Some(&Value::Long(7)));
    assert_eq!(ma.undescribed().get("x-opt-enqueued-time"), Some(&Value::Timestamp(1000)));
    assert_eq!(ma.undescribed().get("x-opt-locked-until"), Some(&Value::Timestamp(2000)));
    let back = Sections::parse(&bytes).unwrap().to_message();
    assert_eq!(back.message_id.unwrap().as_str(), "m");
    assert_eq!(&back.body[..], b"x");
}

#[test]
fn a_received_message_decodes_back_with_the_broker_fields() {
    let mut r = ReceivedMessage::new(
        Message::new("x").with_message_id("m").with_session_id("s"),
        SequenceNumber::new(42),
        Timestamp::from_millis(1000),
    );
    let token = LockToken::random();
    r.lock_token = Some(token);
    r.locked_until = Some(Timestamp::from_millis(2000));
    r.delivery_count = 3;
    r.state = MessageState::Deferred;
    r.dead_letter_reason = Some("Poison".into());
    let back = decode_received(&encode_received(&r, Presentation::Locked)).unwrap();
    assert_eq!(back.sequence_number, SequenceNumber::new(42));
    assert_eq!(back.enqueued_time, Timestamp::from_millis(1000));
    assert_eq!(back.lock_token, Some(token));
    assert_eq!(back.locked_until, Some(Timestamp::from_millis(2000)));
    assert_eq!(back.delivery_count, 3);
    assert_eq!(back.state, MessageState::Deferred);
    assert_eq!(back.dead_letter_reason.as_deref(), Some("Poison"));
    assert_eq!(back.message.session_id, r.message.session_id);
    assert!(
        !back.message.application_properties.contains_key(PASS_THROUGH_PROPERTY),
        "nothing but what was sent: {:?}",
        back.message.application_properties
    );
    assert_eq!(lock_token_of_tag(&token.as_uuid().to_bytes_le()), Some(token));
    assert_eq!(lock_token_of_tag(b"short"), None);
}

/// Application properties of the .NET SDK's own types travel as described values
/// (`com.microsoft:decimal`, `:uri`, `:datetime-offset`, `:timespan`); they come back as
/// they were sent, and a sender cannot forge the property that keeps them.
#[test]
fn dotnet_typed_properties_and_amqp_fields_round_trip() {
    let dotnet =
        |name: &str, v: Value| Value::Described(Box::new(Value::symbol(name)), Box::new(v));
    let typed = vec![
        (
            Value::string("price"),
            dotnet("com.microsoft:decimal", Value::Binary(Bytes::from_static(&[1, 2, 3]))),
        ),
        (Value::string("link"), dotnet("com.microsoft:uri", Value::string("https://example.com/"))),
        (
            Value::string("at"),
            dotnet("com.microsoft:datetime-offset", Value::Long(638_000_000_000_000_000)),
        ),
        (Value::string("took"), dotnet("com.microsoft:timespan", Value::Long(10_000_000))),
        (Value::string("plain"), Value::Int(7)),
        (Value::string(PASS_THROUGH_PROPERTY), Value::Binary(Bytes::from_static(b"forged"))),
    ];
    let mut payload = Vec::new();
    Value::described(
        section::MESSAGE_ANNOTATIONS,
        Value::Map(vec![
            (Value::symbol("custom"), Value::string("kept")),
            (Value::symbol("x-opt-sequence-number"), Value::Long(999)),
        ]),
    )
    .encode(&mut payload);
    described_list(
        section::PROPERTIES,
        vec![
            Value::string("m"),
            Value::Binary(Bytes::from_static(b"alice")),
            Value::Null,
            Value::Null,
            Value::Null,
            Value::Null,
            Value::Null,
            Value::symbol("gzip"),
            Value::Null,
            Value::Timestamp(1_700_000_000_000),
        ],
    )
    .encode(&mut payload);
    Value::described(section::APPLICATION_PROPERTIES, Value::Map(typed.clone()))
        .encode(&mut payload);
    Value::described(section::DATA, Value::Binary(Bytes::from_static(b"x"))).encode(&mut payload);
    Value::described(section::FOOTER, Value::Map(vec![(Value::symbol("f"), Value::string("v"))]))
        .encode(&mut payload);
    let m = Sections::parse(&payload).unwrap().to_message();
    assert_eq!(m.application_properties.get("plain"), Some(&twice::Value::Int(7)));
    let r = ReceivedMessage::new(m, SequenceNumber::new(5), Timestamp::from_millis(1000));
    let back = Sections::parse(&encode_received(&r, Presentation::Unlocked)).unwrap();
    let mut want: Vec<_> = typed[..5].to_vec();
    want.sort_by_key(|(k, _)| k.as_str().map(str::to_owned));
    let mut got = back.application_properties.clone();
    got.sort_by_key(|(k, _)| k.as_str().map(str::to_owned));
    assert_eq!(got, want, "typed values back as sent, the forged property gone");
    assert_eq!(back.properties[1], Value::Binary(Bytes::from_static(b"alice")));
    assert_eq!(back.properties[7], Value::symbol("gzip"));
    assert_eq!(back.properties[9], Value::Timestamp(1_700_000_000_000));
    assert_eq!(back.annotation("custom"), Some(&Value::string("kept")));
    assert_eq!(back.annotation("x-opt-sequence-number"), Some(&Value::Long(5)));
    assert_eq!(back.footer, vec![(Value::symbol("f"), Value::string("v"))]);
    // And the same through a send of the message as twice holds it.
    let again = Sections::parse(&encode_message(&r.message)).unwrap();
    assert_eq!(again.footer, back.footer);
    assert_eq!(again.properties[1], back.properties[1]);
}

#[test]
fn non_data_bodies_round_trip_raw() {
    let mut payload = Vec::new();
    Value::described(0x77, Value::string("hello")).encode(&mut payload);
    let m = Sections::parse(&payload).unwrap().to_message();
    let r = ReceivedMessage::new(m, SequenceNumber::new(1), Timestamp::from_millis(0));
    let out = encode_received(&r, Presentation::Unlocked);
    let s = Sections::parse(&out).unwrap();
    assert_eq!(s.body, vec![Value::described(0x77, Value::string("hello"))]);
    assert!(s.application_properties.is_empty());
}
