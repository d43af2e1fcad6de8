"""The Python SDK against twice: one test per operation of the Service Bus AMQP surface."""

import datetime
import threading
import urllib.request

import pytest
from azure.servicebus import (
    NEXT_AVAILABLE_SESSION,
    ServiceBusClient,
    ServiceBusMessage,
    ServiceBusMessageState,
    ServiceBusReceiveMode,
    ServiceBusSubQueue,
)
from azure.servicebus.exceptions import (
    MessageLockLostError,
    MessageNotFoundError,
    MessageSizeExceededError,
    MessagingEntityNotFoundError,
    OperationTimeoutError,
    ServiceBusAuthenticationError,
    ServiceBusError,
    SessionCannotBeLockedError,
)


def body(msg):
    return b"".join(msg.body)


def drain(client, queue, **kw):
    """Receives and completes everything left in a queue (test isolation)."""
    with client.get_queue_receiver(queue, max_wait_time=1, **kw) as r:
        while True:
            got = r.receive_messages(max_message_count=50, max_wait_time=1)
            if not got:
                return
            for m in got:
                r.complete_message(m)


def test_send_receive_complete_keeps_properties(client):
    with client.get_queue_sender("q1") as s:
        s.send_messages(
            ServiceBusMessage(
                b"hello-1",
                message_id="m1",
                subject="subj",
                correlation_id="corr",
                content_type="text/plain",
                application_properties={"k": "v", "n": 7},
                time_to_live=datetime.timedelta(minutes=5),
            )
        )
    with client.get_queue_receiver("q1", max_wait_time=5) as r:
        msgs = r.receive_messages(max_message_count=1, max_wait_time=5)
        assert len(msgs) == 1
        m = msgs[0]
        assert body(m) == b"hello-1"
        assert m.message_id == "m1"
        assert m.subject == "subj"
        assert m.correlation_id == "corr"
        assert m.content_type == "text/plain"
        assert m.application_properties[b"k"] == b"v"
        assert m.application_properties[b"n"] == 7
        assert m.delivery_count == 0
        assert m.sequence_number >= 1
        assert m.enqueued_time_utc is not None
        assert m.locked_until_utc is not None
        assert m.lock_token is not None
        assert m.time_to_live == datetime.timedelta(minutes=5)
        r.complete_message(m)
        assert r.receive_messages(max_message_count=1, max_wait_time=1) == []


def test_batch_send(client):
    with client.get_queue_sender("q2") as s:
        batch = s.create_message_batch()
        batch.add_message(ServiceBusMessage(b"batch-1"))
        batch.add_message(ServiceBusMessage(b"batch-2"))
        s.send_messages(batch)
    got = []
    with client.get_queue_receiver("q2", max_wait_time=5) as r:
        while len(got) < 2:
            msgs = r.receive_messages(max_message_count=2, max_wait_time=5)
            assert msgs, "the batch did not arrive"
            for m in msgs:
                got.append(body(m))
                r.complete_message(m)
    assert sorted(got) == [b"batch-1", b"batch-2"]


def test_abandon_raises_delivery_count(client):
    with client.get_queue_sender("q3") as s:
        s.send_messages(ServiceBusMessage(b"abandon-me"))
    with client.get_queue_receiver("q3", max_wait_time=5) as r:
        m = r.receive_messages(max_message_count=1, max_wait_time=5)[0]
        assert m.delivery_count == 0
        r.abandon_message(m)
        again = r.receive_messages(max_message_count=1, max_wait_time=5)[0]
        assert body(again) == b"abandon-me"
        assert again.delivery_count == 1
        r.complete_message(again)


def test_defer_and_receive_deferred(client):
    with client.get_queue_sender("q4") as s:
        s.send_messages(ServiceBusMessage(b"to-defer"))
    with client.get_queue_receiver("q4", max_wait_time=5) as r:
        m = r.receive_messages(max_message_count=1, max_wait_time=5)[0]
        seq = m.sequence_number
        r.defer_message(m)
        assert r.receive_messages(max_message_count=1, max_wait_time=1) == []
        deferred = r.receive_deferred_messages([seq])
        assert len(deferred) == 1
        assert body(deferred[0]) == b"to-defer"
        r.complete_message(deferred[0])
        assert r.peek_messages(max_message_count=5, sequence_number=seq) == []


def test_dead_letter_with_reason_and_dlq_receive(client):
    with client.get_queue_sender("q5") as s:
        s.send_messages(ServiceBusMessage(b"poison"))
    with client.get_queue_receiver("q5", max_wait_time=5) as r:
        m = r.receive_messages(max_message_count=1, max_wait_time=5)[0]
        r.dead_letter_message(m, reason="bad", error_description="very bad")
    with client.get_queue_receiver("q5", sub_queue=ServiceBusSubQueue.DEAD_LETTER, max_wait_time=5) as d:
        dm = d.receive_messages(max_message_count=1, max_wait_time=5)[0]
        assert body(dm) == b"poison"
        assert dm.dead_letter_reason == "bad"
        assert dm.dead_letter_error_description == "very bad"
        d.complete_message(dm)


def test_renew_lock(client):
    with client.get_queue_sender("q6") as s:
        s.send_messages(ServiceBusMessage(b"renew"))
    with client.get_queue_receiver("q6", max_wait_time=5) as r:
        m = r.receive_messages(max_message_count=1, max_wait_time=5)[0]
        before = m.locked_until_utc
        after = r.renew_message_lock(m)
        assert after >= before
        r.complete_message(m)


def test_peek(client):
    with client.get_queue_sender("q7") as s:
        s.send_messages([ServiceBusMessage(b"p1"), ServiceBusMessage(b"p2")])
    with client.get_queue_receiver("q7", max_wait_time=5) as r:
        peeked = r.peek_messages(max_message_count=5, sequence_number=1)
        assert [body(p) for p in peeked] == [b"p1", b"p2"]
        assert peeked[0].sequence_number < peeked[1].sequence_number
        assert r.peek_messages(max_message_count=5, sequence_number=1_000_000_000) == []
    drain(client, "q7")


def test_schedule_and_cancel(client, advance):
    now = datetime.datetime.now(datetime.timezone.utc)
    with client.get_queue_sender("q8") as s:
        seqs = s.schedule_messages([ServiceBusMessage(b"s1"), ServiceBusMessage(b"s2")], now + datetime.timedelta(minutes=10))
        assert len(seqs) == 2
        s.cancel_scheduled_messages(seqs)
        s.schedule_messages(ServiceBusMessage(b"s3"), now + datetime.timedelta(minutes=10))
        later = ServiceBusMessage(b"s4")
        later.scheduled_enqueue_time_utc = now + datetime.timedelta(minutes=10)
        s.send_messages(later)
    with client.get_queue_receiver("q8", max_wait_time=1) as r:
        peeked = r.peek_messages(max_message_count=10, sequence_number=1)
        assert sorted(body(p) for p in peeked) == [b"s3", b"s4"]
        assert r.receive_messages(max_message_count=5, max_wait_time=1) == []
    # Past the receiver's long poll first, then past the scheduled time, so the two deadlines
    # do not fall in the same broker tick.
    advance(31 * 1000)
    advance(10 * 60 * 1000)
    with client.get_queue_receiver("q8", max_wait_time=5) as r:
        got = []
        for _ in range(5):
            for m in r.receive_messages(max_message_count=5, max_wait_time=2):
                got.append(body(m))
                r.complete_message(m)
            if len(got) == 2:
                break
        assert sorted(got) == [b"s3", b"s4"]


def test_scheduled_message_takes_a_new_number_when_due(client, advance):
    # As in Service Bus: a scheduled message queues behind what was sent before its time.
    # The server's clock stands still between advances and earlier tests moved it: a probe's
    # enqueued time tells where it is.
    with client.get_queue_sender("q21") as s:
        s.send_messages(ServiceBusMessage(b"probe"))
    with client.get_queue_receiver("q21", max_wait_time=5) as r:
        [probe] = r.receive_messages(max_message_count=1, max_wait_time=5)
        server_now = probe.enqueued_time_utc
        r.complete_message(probe)
    with client.get_queue_sender("q21") as s:
        [scheduled] = s.schedule_messages(ServiceBusMessage(b"later"), server_now + datetime.timedelta(minutes=10))
        s.send_messages(ServiceBusMessage(b"before"))
    advance(10 * 60 * 1000)
    try:
        with client.get_queue_receiver("q21", max_wait_time=5) as r:
            got = []
            for _ in range(5):
                for m in r.receive_messages(max_message_count=5, max_wait_time=2):
                    got.append((body(m), m.sequence_number))
                    r.complete_message(m)
                if len(got) == 2:
                    break
    finally:
        advance(-10 * 60 * 1000)
    assert [b for b, _ in got] == [b"before", b"later"]
    assert got[1][1] > got[0][1] > scheduled


def test_scheduling_a_message_id_twice_returns_two_real_numbers(client):
    # Scheduling answers with a number for every message, even on a duplicate-detecting queue
    # (the number cancels it), as Service Bus does.
    now = datetime.datetime.now(datetime.timezone.utc)
    with client.get_queue_sender("dupq2") as s:
        at = now + datetime.timedelta(days=1)
        first = s.schedule_messages(ServiceBusMessage(b"a", message_id="same"), at)
        second = s.schedule_messages(ServiceBusMessage(b"b", message_id="same"), at)
        assert len(first) == 1 and len(second) == 1
        assert first[0] > 0 and second[0] > 0 and first[0] != second[0]
        s.cancel_scheduled_messages(first + second)


def test_transfer_dead_letter_queue_attaches_and_is_empty(client):
    # twice does not forward across namespaces, so nothing is ever dead-lettered in transfer;
    # the queue exists, as in Service Bus, and holds none of the dead-letter queue's messages.
    with client.get_queue_sender("q22") as s:
        s.send_messages(ServiceBusMessage(b"poison"))
    with client.get_queue_receiver("q22", max_wait_time=5) as r:
        [m] = r.receive_messages(max_message_count=1, max_wait_time=5)
        r.dead_letter_message(m, reason="bad")
    with client.get_queue_receiver("q22", sub_queue=ServiceBusSubQueue.TRANSFER_DEAD_LETTER, max_wait_time=1) as t:
        assert t.peek_messages(max_message_count=10) == []
        assert t.receive_messages(max_message_count=10, max_wait_time=1) == []
    with client.get_queue_receiver("q22", sub_queue=ServiceBusSubQueue.DEAD_LETTER, max_wait_time=5) as d:
        [m] = d.receive_messages(max_message_count=1, max_wait_time=5)
        assert body(m) == b"poison"
        d.complete_message(m)


def test_receive_and_delete(client):
    with client.get_queue_sender("q9") as s:
        s.send_messages([ServiceBusMessage(b"d1"), ServiceBusMessage(b"d2")])
    with client.get_queue_receiver("q9", receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE, max_wait_time=5) as r:
        got = []
        while len(got) < 2:
            msgs = r.receive_messages(max_message_count=10, max_wait_time=5)
            assert msgs
            got += [body(m) for m in msgs]
        assert sorted(got) == [b"d1", b"d2"]
    with client.get_queue_receiver("q9", max_wait_time=1) as r:
        assert r.peek_messages(max_message_count=5, sequence_number=1) == []


def test_sessions_next_named_state_and_renew(client):
    with client.get_queue_sender("sessq1") as s:
        s.send_messages([ServiceBusMessage(b"s1-a", session_id="s1"), ServiceBusMessage(b"s1-b", session_id="s1")])
    with client.get_queue_receiver("sessq1", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=5) as r:
        assert r.session.session_id == "s1"
        assert r.session.locked_until_utc is not None
        got = []
        while len(got) < 2:
            msgs = r.receive_messages(max_message_count=5, max_wait_time=5)
            assert msgs
            for m in msgs:
                got.append(body(m))
                r.complete_message(m)
        assert got == [b"s1-a", b"s1-b"]
        r.session.set_state(b"state-1")
        assert r.session.get_state() == b"state-1"
        before = r.session.locked_until_utc
        r.session.renew_lock()
        assert r.session.locked_until_utc >= before
    with client.get_queue_sender("sessq1") as s:
        s.send_messages(ServiceBusMessage(b"s2-a", session_id="s2"))
    with client.get_queue_receiver("sessq1", session_id="s2", max_wait_time=5) as r:
        m = r.receive_messages(max_message_count=1, max_wait_time=5)[0]
        assert body(m) == b"s2-a"
        assert m.session_id == "s2"
        r.complete_message(m)


def test_named_session_conflict(client, conn_str):
    with client.get_queue_sender("sessq2") as s:
        s.send_messages(ServiceBusMessage(b"x", session_id="busy"))
    with client.get_queue_receiver("sessq2", session_id="busy", max_wait_time=5) as holder:
        with ServiceBusClient.from_connection_string(conn_str, retry_total=0) as other:
            with pytest.raises(SessionCannotBeLockedError):
                with other.get_queue_receiver("sessq2", session_id="busy", max_wait_time=2) as r:
                    r.receive_messages(max_message_count=1, max_wait_time=1)
        m = holder.receive_messages(max_message_count=1, max_wait_time=5)[0]
        holder.complete_message(m)


def test_next_session_timeout(client):
    with pytest.raises(OperationTimeoutError):
        with client.get_queue_receiver("sessq3", session_id=NEXT_AVAILABLE_SESSION, max_wait_time=2) as r:
            r.receive_messages(max_message_count=1, max_wait_time=1)


def test_list_sessions(client):
    with client.get_queue_sender("sessq7") as s:
        s.send_messages([ServiceBusMessage(b"x", session_id="la"), ServiceBusMessage(b"y", session_id="lb")])
    assert sorted(client.list_queue_sessions("sessq7")) == ["la", "lb"]
    assert list(client.list_queue_sessions("sessq8")) == []


def test_duplicate_detection(client):
    with client.get_queue_sender("dupq") as s:
        s.send_messages(ServiceBusMessage(b"first", message_id="same-id"))
        s.send_messages(ServiceBusMessage(b"second", message_id="same-id"))
    with client.get_queue_receiver("dupq", max_wait_time=2) as r:
        got = r.receive_messages(max_message_count=5, max_wait_time=3)
        assert [body(m) for m in got] == [b"first"]
        r.complete_message(got[0])
        assert r.receive_messages(max_message_count=5, max_wait_time=1) == []


def test_topic_subscription(client):
    with client.get_topic_sender("topic1") as s:
        s.send_messages(ServiceBusMessage(b"to-topic"))
    for sub in ("sub1", "sub2"):
        with client.get_subscription_receiver("topic1", sub, max_wait_time=5) as r:
            m = r.receive_messages(max_message_count=1, max_wait_time=5)[0]
            assert body(m) == b"to-topic"
            r.complete_message(m)


def test_lock_lost_after_expiry(client, advance):
    with client.get_queue_sender("q10") as s:
        s.send_messages(ServiceBusMessage(b"lock-lost"))
    with client.get_queue_receiver("q10", max_wait_time=5) as r:
        m = r.receive_messages(max_message_count=1, max_wait_time=5)[0]
        advance(61 * 1000)
        with pytest.raises(MessageLockLostError):
            r.complete_message(m)
        again = r.receive_messages(max_message_count=1, max_wait_time=5)[0]
        assert body(again) == b"lock-lost"
        assert again.delivery_count == 1
        r.complete_message(again)


def test_two_receivers_never_share_a_locked_message(client, conn_str):
    with client.get_queue_sender("q11") as s:
        s.send_messages([ServiceBusMessage(f"m{i}".encode()) for i in range(20)])
    seen = [[], []]

    def consume(i):
        with ServiceBusClient.from_connection_string(conn_str, retry_total=0) as c:
            with c.get_queue_receiver("q11", max_wait_time=3) as r:
                while True:
                    msgs = r.receive_messages(max_message_count=3, max_wait_time=3)
                    if not msgs:
                        return
                    for m in msgs:
                        seen[i].append(body(m))
                        r.complete_message(m)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(f"m{i}".encode() for i in range(20))


def test_max_delivery_count_dead_letters(client):
    with client.get_queue_sender("q12") as s:
        s.send_messages(ServiceBusMessage(b"always-fails"))
    with client.get_queue_receiver("q12", max_wait_time=5) as r:
        for _ in range(10):
            m = r.receive_messages(max_message_count=1, max_wait_time=5)[0]
            r.abandon_message(m)
        assert r.receive_messages(max_message_count=1, max_wait_time=1) == []
    with client.get_queue_receiver("q12", sub_queue=ServiceBusSubQueue.DEAD_LETTER, max_wait_time=5) as d:
        dm = d.receive_messages(max_message_count=1, max_wait_time=5)[0]
        assert body(dm) == b"always-fails"
        assert dm.dead_letter_reason == "MaxDeliveryCountExceeded"
        d.complete_message(dm)


def test_ttl_expiry(client, advance):
    with client.get_queue_sender("q13") as s:
        s.send_messages(ServiceBusMessage(b"short-lived", time_to_live=datetime.timedelta(seconds=30)))
    advance(31 * 1000)
    with client.get_queue_receiver("q13", max_wait_time=1) as r:
        assert r.receive_messages(max_message_count=1, max_wait_time=1) == []


def test_expired_deferred_message_waits_for_a_receive(client, advance):
    # As in Service Bus: a deferred message past its time to live stays deferred until a
    # receive by its sequence number tries it; then it expires and is not found.
    with client.get_queue_sender("q23") as s:
        s.send_messages(ServiceBusMessage(b"deferred", time_to_live=datetime.timedelta(seconds=30)))
    with client.get_queue_receiver("q23", max_wait_time=5) as r:
        [m] = r.receive_messages(max_message_count=1, max_wait_time=5)
        seq = m.sequence_number
        r.defer_message(m)
    advance(31 * 1000)
    with client.get_queue_receiver("q23", max_wait_time=1) as r:
        [p] = r.peek_messages(max_message_count=5, sequence_number=seq)
        assert p.sequence_number == seq
        assert p.state == ServiceBusMessageState.DEFERRED
        with pytest.raises(MessageNotFoundError):
            r.receive_deferred_messages([seq])
        assert r.peek_messages(max_message_count=5, sequence_number=seq) == []


def test_unknown_entity(client):
    with pytest.raises(MessagingEntityNotFoundError):
        with client.get_queue_sender("no-such-queue") as s:
            s.send_messages(ServiceBusMessage(b"x"))


def test_message_too_large(client):
    with client.get_queue_sender("q14") as s:
        with pytest.raises((MessageSizeExceededError, ValueError)):
            s.send_messages(ServiceBusMessage(b"x" * (300 * 1024)))


def test_wrong_key_is_refused(conn_str):
    bad = conn_str.replace("SAS_KEY_VALUE", "not-the-key")
    with ServiceBusClient.from_connection_string(bad, retry_total=0) as c:
        with pytest.raises((ServiceBusAuthenticationError, ServiceBusError)):
            with c.get_queue_sender("q15") as s:
                s.send_messages(ServiceBusMessage(b"x"))


def test_expired_token_is_refused(conn_str, advance):
    # The SDK signs tokens for an hour; the server's clock two hours on makes them expired.
    advance(2 * 3600 * 1000)
    try:
        with ServiceBusClient.from_connection_string(conn_str, retry_total=0) as c:
            with pytest.raises((ServiceBusAuthenticationError, ServiceBusError)):
                with c.get_queue_sender("q15") as s:
                    s.send_messages(ServiceBusMessage(b"x"))
    finally:
        advance(-2 * 3600 * 1000)


def test_http_side_port(client):
    import json
    import os

    with client.get_queue_sender("q16") as s:
        s.send_messages(ServiceBusMessage(b"counted"))
    base = os.environ["SB_HTTP"]
    with urllib.request.urlopen(f"{base}/health") as r:
        assert json.loads(r.read())["status"] == "healthy"
    with urllib.request.urlopen(f"{base}/metrics") as r:
        text = r.read().decode()
        assert "twice_servicebus_connections" in text
        assert 'twice_servicebus_operations_total{entity="q16",operation="send"} 1' in text
        assert 'twice_servicebus_messages{entity="q16",state="active"} 1' in text
    with urllib.request.urlopen(f"{base}/entities") as r:
        # Entity paths are case-insensitive in Service Bus; the canonical form capitalises
        # "Subscriptions".
        paths = {e["path"].lower() for e in json.loads(r.read())}
        assert "q16" in paths and "topic1/subscriptions/sub1" in paths


def test_received_messages_carry_the_effective_ttl_and_creation_time(client):
    # A message sent without a time to live lives as long as its queue's default says, and
    # the SDK reads that from the message's header, as Service Bus sends it.
    with client.get_queue_sender("ttlq") as s:
        s.send_messages(ServiceBusMessage(b"no ttl of its own"))
    with client.get_queue_receiver("ttlq", max_wait_time=5) as r:
        m = r.receive_messages(max_message_count=1, max_wait_time=5)[0]
        assert m.time_to_live == datetime.timedelta(minutes=10)
        assert m.expires_at_utc == m.enqueued_time_utc + datetime.timedelta(minutes=10)
        enqueued_ms = int(m.enqueued_time_utc.timestamp() * 1000)
        assert m.raw_amqp_message.properties.creation_time == enqueued_ms
        r.complete_message(m)


def test_amqp_fields_the_broker_does_not_read_pass_through(client):
    from azure.servicebus.amqp import AmqpAnnotatedMessage

    sent = AmqpAnnotatedMessage(
        data_body=b"raw",
        properties={
            "message_id": "pt1",
            "user_id": b"alice",
            "content_encoding": "gzip",
            "creation_time": 1700000000000,
        },
        annotations={"custom-annotation": "kept", "x-opt-custom": 7},
        footer={"footer-key": "signed"},
        application_properties={"k": "v"},
    )
    with client.get_queue_sender("rawq") as s:
        s.send_messages(sent)
    with client.get_queue_receiver("rawq", max_wait_time=5) as r:
        m = r.receive_messages(max_message_count=1, max_wait_time=5)[0]
        raw = m.raw_amqp_message
        assert raw.properties.user_id == b"alice"
        assert raw.properties.content_encoding in (b"gzip", "gzip")
        assert raw.properties.creation_time == 1700000000000
        assert raw.annotations[b"custom-annotation"] in (b"kept", "kept")
        assert raw.annotations[b"x-opt-custom"] == 7
        assert raw.annotations[b"x-opt-sequence-number"] >= 1
        assert raw.footer == {b"footer-key": b"signed"}
        assert raw.application_properties == {b"k": b"v"}
        r.complete_message(m)


def test_dotnet_typed_properties_round_trip(client):
    # The .NET SDK sends decimal, Uri, DateTimeOffset and TimeSpan properties as described
    # values; the Python SDK can send the same through its AMQP types. They come back (the
    # Python SDK shows the value inside; the descriptor is checked at the wire in Rust).
    from azure.servicebus._pyamqp.types import AMQPTypes, TYPE, VALUE

    def described(name, kind, value):
        return {TYPE: AMQPTypes.described, VALUE: ({TYPE: AMQPTypes.symbol, VALUE: name}, {TYPE: kind, VALUE: value})}

    props = {
        "link": described(b"com.microsoft:uri", AMQPTypes.string, "https://example.com/"),
        "took": described(b"com.microsoft:timespan", AMQPTypes.long, 10_000_000),
        "at": described(b"com.microsoft:datetime-offset", AMQPTypes.long, 638_000_000_000_000_000),
        "price": described(b"com.microsoft:decimal", AMQPTypes.binary, b"\x01\x02\x03"),
        "plain": 7,
    }
    with client.get_queue_sender("rawq") as s:
        s.send_messages(ServiceBusMessage(b"typed", application_properties=props))
    with client.get_queue_receiver("rawq", max_wait_time=5) as r:
        m = r.receive_messages(max_message_count=1, max_wait_time=5)[0]
        assert m.raw_amqp_message.application_properties == {
            b"plain": 7,
            b"link": b"https://example.com/",
            b"took": 10_000_000,
            b"at": 638_000_000_000_000_000,
            b"price": b"\x01\x02\x03",
        }
        r.complete_message(m)
